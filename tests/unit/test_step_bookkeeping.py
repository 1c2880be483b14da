"""A step's directory, cache-bust and hold records advise later steps, so the inference
worker writes them after the step has returned (off its path). What that must not
break: the records still land, a hold decided late is not made for a job that has
already moved on, and a worker's shutdown waits for them (real Redis, fake engine)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
import redis.asyncio as aioredis

from tests.unit.engine_fakes import engine, generate, inference, step_request
from warmloop.activities.cachebust import CacheBustDetector
from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.holds import HoldManager
from warmloop.activities.pauses import PauseStats
from warmloop.activities.registry import EngineHeartbeat, EngineRegistry, RedisOutage


class GatedDirectory(PrefixDirectory):
    """A directory whose writes wait for ``gate``: the step's records are still being
    written while the test looks."""

    def __init__(self, redis: aioredis.Redis) -> None:
        super().__init__(redis)
        self.gate = asyncio.Event()

    async def record_served(self, *args: Any, **kw: Any) -> None:
        await self.gate.wait()
        await super().record_served(*args, **kw)


def wired(redis: aioredis.Redis) -> tuple[Any, GatedDirectory, HoldManager, list[int]]:
    info = EngineHeartbeat(engine_id="e0", task_queue="engine.e0", model="tiny",
                           url="http://e0", healthy=True, kv_capacity_tokens=16384,
                           block_size=16, at=time.time())
    outage = RedisOutage()
    directory = GatedDirectory(redis)
    transport = engine()
    holds = HoldManager(engine_id="e0", base_url="http://engine", model="tiny",
                        http=httpx.AsyncClient(transport=transport), redis=redis,
                        pauses=PauseStats(redis, outage=outage), engine_info=lambda: info,
                        directory=directory, outage=outage)
    held_after: list[int] = []  # the step whose hold decision was made
    decide = holds.after_step

    async def after_step(**kw: Any) -> Any:
        held_after.append(kw["prefix_tokens"][0] if kw["prefix_tokens"] else -1)
        return await decide(**kw)

    holds.after_step = after_step  # type: ignore[method-assign]
    inf = inference(transport, directory=directory, registry=EngineRegistry(redis, ttl_s=5),
                    detector=CacheBustDetector(redis, directory), engine_info=lambda: info,
                    holds=holds, outage=outage)
    return inf, directory, holds, held_after


async def test_a_step_returns_before_its_directory_records_are_written(
        redis: aioredis.Redis) -> None:
    inf, directory, holds, _ = wired(redis)
    result = await generate(inf, step_request(job_id="jb1", hold_policy="always_hold"),
                            drain=False)
    assert result.tool_calls and result.cached_tokens == 256
    # returned while the directory write waits: nothing recorded, no hold yet
    assert await directory.job_chain("jb1") is None
    assert "jb1" not in holds.holds
    directory.gate.set()
    assert await inf.drain() == 0
    known = await directory.job_chain("jb1")
    assert known is not None and known[1] == "e0"
    assert "jb1" in holds.holds  # decided once the records were written


async def test_no_hold_is_made_for_a_step_whose_job_has_moved_on(
        redis: aioredis.Redis) -> None:
    inf, directory, holds, held_after = wired(redis)
    await generate(inf, step_request(step=1, job_id="jb2", hold_policy="always_hold"),
                   drain=False)
    # the job's next step arrives while step 1's bookkeeping is still under way
    await generate(inf, step_request(step=2, job_id="jb2", hold_policy="always_hold"),
                   drain=False)
    directory.gate.set()
    assert await inf.drain() == 0
    # one hold decision, step 2's: step 1's would hold blocks for a pause already over
    assert len(held_after) == 1
    assert "jb2" in holds.holds


async def test_a_shutdown_cancels_bookkeeping_that_outlives_its_bound(
        redis: aioredis.Redis) -> None:
    inf, directory, holds, held_after = wired(redis)
    await generate(inf, step_request(job_id="jb3", hold_policy="always_hold"), drain=False)
    assert await inf.drain(timeout_s=0.2) == 1  # the gate never opens: cancelled
    assert await directory.job_chain("jb3") is None and held_after == []
    assert await inf.drain() == 0  # nothing left behind
