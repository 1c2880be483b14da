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


class _Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


def test_an_outage_is_logged_once_and_probed_ever_less_often(
        monkeypatch: pytest.MonkeyPatch) -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError

    from tests.unit.engine_fakes import Recorder
    from warmloop.activities import registry as registry_module
    from warmloop.activities.registry import RedisOutage

    rec = Recorder()
    monkeypatch.setattr(registry_module, "log", rec)
    clock = _Clock()
    outage = RedisOutage(probe_s=1.0, max_probe_s=4.0, clock=clock)
    assert outage.should_try() and not outage.away
    waits = []
    for _ in range(5):
        outage.failed(RedisConnectionError("refused"), what="test")
        start = clock.t
        while not outage.should_try():
            clock.t += 0.25
        waits.append(clock.t - start)
    assert waits == [1.0, 2.0, 4.0, 4.0, 4.0]  # doubling, capped
    assert len(rec.named("redis_unavailable")) == 1 and outage.failures == 5
    outage.ok()
    outage.ok()
    assert rec.named("redis_back") == [{"away_s": clock.t, "failed_calls": 5}]
    assert outage.should_try() and not outage.away


async def test_an_attempt_gives_the_default_while_redis_is_away() -> None:
    from redis.exceptions import ConnectionError as RedisConnectionError

    from warmloop.activities.registry import RedisOutage

    clock = _Clock()
    outage = RedisOutage(clock=clock)
    calls = 0

    async def down() -> int:
        nonlocal calls
        calls += 1
        raise RedisConnectionError("refused")

    async def up() -> int:
        nonlocal calls
        calls += 1
        return 7

    assert await outage.attempt("t", down, -1) == -1 and calls == 1
    assert await outage.attempt("t", up, -1) == -1 and calls == 1  # skipped: no probe due
    assert await outage.attempt("t", up, -1, probe=True) == 7 and calls == 2
    assert not outage.away
