from __future__ import annotations

import builtins
import time

import pytest

from warmloop.activities.registry import EngineHeartbeat, EngineRegistry, parse_vllm_metrics

METRICS = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
vllm:num_requests_running{engine="0",model_name="tiny"} 3.0
vllm:num_requests_waiting{engine="0",model_name="tiny"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
vllm:prefix_cache_hits_total{engine="0",model_name="tiny"} 1024.0
vllm:prefix_cache_hits_created{engine="0",model_name="tiny"} 1.7e9
python_gc_objects_collected_total{generation="0"} 5.0
"""


def test_parse_vllm_metrics() -> None:
    m = parse_vllm_metrics(METRICS)
    assert m["vllm:num_requests_running"] == 3
    assert m["vllm:num_requests_waiting"] == 1
    assert m["vllm:kv_cache_usage_perc"] == 0.25
    assert "python_gc_objects_collected_total" not in m


class FakeRedis:
    """Just enough of redis.asyncio for the registry (unit test only)."""

    def __init__(self) -> None:
        self.kv: dict[str, bytes] = {}
        self.sets: dict[str, set[str]] = {}

    def pipeline(self, transaction: bool = False) -> FakeRedis:
        return self

    def set(self, key: str, value: str, px: int) -> None:
        self.kv[key] = value.encode()

    def sadd(self, key: str, member: str) -> None:
        self.sets.setdefault(key, set()).add(member)

    async def execute(self) -> None:
        return None

    async def smembers(self, key: str) -> builtins.set[str]:
        return self.sets.get(key, set())

    async def mget(self, keys: list[str]) -> list[bytes | None]:
        return [self.kv.get(k) for k in keys]

    async def delete(self, key: str) -> None:
        self.kv.pop(key, None)


def _hb(engine_id: str, at: float, healthy: bool = True) -> EngineHeartbeat:
    return EngineHeartbeat(engine_id=engine_id, task_queue=f"engine.{engine_id}", model="tiny",
                           url="http://x", healthy=healthy, at=at)


@pytest.mark.asyncio
async def test_stale_unhealthy_and_departed_engines_are_not_live() -> None:
    r = FakeRedis()
    reg = EngineRegistry(r, ttl_s=5)  # type: ignore[arg-type]
    now = time.time()
    await reg.heartbeat(_hb("a", now))
    await reg.heartbeat(_hb("b", now - 60))  # stale: its key would have expired
    await reg.heartbeat(_hb("c", now, healthy=False))
    await reg.heartbeat(_hb("d", now))
    await reg.leave("d")
    assert [e.engine_id for e in await reg.live(now=now)] == ["a"]
