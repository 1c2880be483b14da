"""`warmloop calibrate` on the real stack: a real engine measured by the short standard
load, its KV pool as vLLM reports it, the calibration published and carried by the
engine's heartbeat (so pricing, holds and routing read it), and the preset put back."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import pytest
import redis.asyncio as aioredis

from tests.integration.cli import warmloop
from tests.polling import eventually
from warmloop.activities.registry import EngineRegistry
from warmloop.infra.stack import Stack
from warmloop.workers.calibrate import read_calibration, store_calibration
from warmloop.workers.settings import Settings
from warmloop.workflows.calibration import EngineCalibration

pytestmark = pytest.mark.integration


async def test_an_engine_is_measured_published_and_heartbeats_with_it(
        stack: Stack, settings: Settings, redis: aioredis.Redis, tmp_path: Path) -> None:
    engine = settings.engine_endpoints[0]
    registry = EngineRegistry(redis, ttl_s=settings.engine_ttl_s)
    before = next(hb for hb in await registry.live() if hb.engine_id == engine.id)
    assert before.calibration is not None and before.priced
    out = tmp_path / f"{engine.id}.json"
    try:
        done = await asyncio.to_thread(warmloop, "calibrate", engine.id, "--quick",
                                       "--out", str(out))
        assert done.returncode == 0 and "published" in done.stdout, done.stderr
        measured = EngineCalibration.model_validate_json(out.read_text())
        assert measured.source.startswith(f"measured {engine.id} ")
        # the KV pool and block size are vLLM's own (as the heartbeat reports them)
        assert measured.block_size == before.block_size
        assert measured.kv_pool_tokens == before.kv_capacity_tokens
        assert all(p.tokens_per_s > 0 for p in measured.prefill)
        assert [d.batch_size for d in measured.decode] == [1, 4]
        assert measured.decode[1].step_s >= measured.decode[0].step_s > 0
        assert await read_calibration(redis, engine.id) == measured

        async def carried() -> EngineCalibration | None:
            hb = next((h for h in await registry.live() if h.engine_id == engine.id), None)
            return hb.calibration if hb and hb.calibration == measured else None

        await eventually(carried, attempts=120, interval_s=0.5)
        shown = await asyncio.to_thread(warmloop, "engines", "--json")
        rows = {r["engine_id"]: r for r in map(json.loads, shown.stdout.splitlines())}
        assert rows[engine.id]["calibration"]["source"] == measured.source
    finally:
        # later tests expect the engine as it was: its preset back in the heartbeat
        preset = settings.engine_calibration_base(engine)
        await store_calibration(redis, engine.id, preset)

        async def restored() -> bool | None:
            hb = next((h for h in await registry.live() if h.engine_id == engine.id), None)
            return True if hb and hb.calibration == preset else None

        await eventually(restored, attempts=120, interval_s=0.5)
