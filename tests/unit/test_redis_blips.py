"""Redis is an optimisation (registry, prefix directory, holds, statistics): while it
is away the workers stay up, steps run on the last known engines, and jobs wait rather
than end. A throwaway redis-server is killed, restarted and SIGSTOPped here to make the
outages real; "away" without a server is a port where nothing listens."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import msgpack
import pytest
import redis.asyncio as aioredis
import zmq
import zmq.asyncio
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from tests.unit.engine_fakes import (
    Recorder,
    RedisServer,
    generate,
    nowhere_redis,
    redis_backed_inference,
    step_request,
)
from warmloop.activities import registry as registry_module
from warmloop.activities.directory import ENGINE_BLOCKS, KvEventApplier, PrefixDirectory
from warmloop.activities.holds import HoldManager
from warmloop.activities.pauses import PauseStats
from warmloop.activities.registry import (
    INFLIGHT_KEY,
    EngineHeartbeat,
    EngineRegistry,
    RedisOutage,
)
from warmloop.activities.routing import RoutingActivities
from warmloop.workers import inference_worker
from warmloop.workers.clients import build_redis
from warmloop.workers.settings import EngineEndpoint, Settings
from warmloop.workflows.contracts import RouteRequest
from warmloop.workflows.holding import HoldConfig
from warmloop.workflows.profiles import get_profile

REDIS_UNAVAILABLE = "RedisUnavailable"


@pytest.fixture
def outage_log(monkeypatch: pytest.MonkeyPatch) -> Recorder:
    """What the outage tracker logs (it lives beside the registry)."""
    rec = Recorder()
    monkeypatch.setattr(registry_module, "log", rec, raising=False)
    return rec


def hb(engine_id: str, *, running: int = 0, at: float | None = None) -> EngineHeartbeat:
    return EngineHeartbeat(engine_id=engine_id, task_queue=f"engine.{engine_id}", model="tiny",
                           url=f"http://{engine_id}", healthy=True, running=running,
                           at=time.time() if at is None else at)


async def eventually(check: Any, timeout_s: float = 8.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        assert time.monotonic() < deadline, "condition not reached in time"
        await asyncio.sleep(0.05)


# ---- the client ---------------------------------------------------------------------------


def test_the_redis_client_retries_with_backoff_and_timeouts() -> None:
    r = build_redis(Settings(redis_url="redis://127.0.0.1:1/0"))
    kw = r.connection_pool.connection_kwargs
    retry = kw.get("retry")
    assert retry is not None and retry.get_retries() >= 2
    assert kw.get("socket_timeout") and kw["socket_timeout"] <= 5
    assert kw.get("socket_connect_timeout") and kw["socket_connect_timeout"] <= 5
    assert kw.get("health_check_interval", 0) > 0


async def test_the_redis_client_rides_out_a_restart(server: RedisServer,
                                                    client: aioredis.Redis) -> None:
    assert await client.ping()
    server.kill()  # the pooled connection is dead now

    async def back_soon() -> None:
        await asyncio.sleep(0.3)
        await asyncio.to_thread(server.start)

    restart = asyncio.ensure_future(back_soon())
    try:
        assert await client.ping()  # retried (with backoff) until the server is back
    finally:
        await restart


# ---- background loops ---------------------------------------------------------------------


def metrics_engine() -> httpx.MockTransport:
    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/health":
            return httpx.Response(200)
        return httpx.Response(200, text="vllm:num_requests_running 1.0\n")
    return httpx.MockTransport(handle)


async def test_the_engine_heartbeat_rides_out_a_redis_outage(
        server: RedisServer, client: aioredis.Redis, outage_log: Recorder) -> None:
    registry = EngineRegistry(client, ttl_s=5)
    view = inference_worker.EngineView()
    e0 = EngineEndpoint(id="e0", url="http://e0")
    async with httpx.AsyncClient(transport=metrics_engine()) as http:
        loop = asyncio.ensure_future(inference_worker.heartbeat_loop(
            registry, http, e0, 0.05, view, directory=PrefixDirectory(client)))
        try:
            async def joined() -> bool:
                return [e.engine_id for e in await registry.live()] == ["e0"]

            await eventually(joined)
            server.kill()
            await asyncio.sleep(1.5)  # several beats while Redis is away
            assert not loop.done(), loop.exception() if loop.done() else None
            assert view.last is not None and time.time() - view.last.at < 1.0
            server.start()  # empty: the engine is registered again by its next beat
            await eventually(joined)
            assert not loop.done()
        finally:
            loop.cancel()
    assert len(outage_log.named("redis_unavailable")) == 1  # once per outage, not per beat
    assert len(outage_log.named("redis_back")) == 1


class Holding:
    """What the heartbeat reads of a worker's holds."""

    def __init__(self) -> None:
        self.held_tokens = 0
        self.regret = None
        self.held_more = asyncio.Event()
        self.touching = 0

    def observe_engine(self, computed_tokens_total: float) -> None:
        pass


@contextlib.asynccontextmanager
async def heartbeating(registry: Any, holds: Holding, interval_s: float
                       ) -> AsyncIterator[None]:
    """e0's worker heartbeat (over ``metrics_engine``, one running request) publishing to
    ``registry`` every ``interval_s``, with ``holds`` as its worker's holds."""
    async with httpx.AsyncClient(transport=metrics_engine()) as http:
        loop = asyncio.ensure_future(inference_worker.heartbeat_loop(
            registry, http, EngineEndpoint(id="e0", url="http://e0"), interval_s,
            holds=holds))  # type: ignore[arg-type]
        try:
            yield
        finally:
            loop.cancel()


async def published(registry: EngineRegistry, field: str, value: int) -> bool:
    live = await registry.live()
    return bool(live) and getattr(live[0], field) == value


async def test_a_new_hold_is_published_without_waiting_for_the_next_beat(
        client: aioredis.Redis) -> None:
    # The router counts held tokens as taken KV: a hold the registry learns of a beat
    # late lets a job that starts meanwhile see the engine as empty.
    registry = EngineRegistry(client, ttl_s=120)
    holds = Holding()
    async with heartbeating(registry, holds, 60.0):
        await eventually(lambda: published(registry, "held_tokens", 0))
        holds.held_tokens = 1_537
        holds.held_more.set()
        # not 60 s later
        await eventually(lambda: published(registry, "held_tokens", 1_537), timeout_s=5.0)


async def test_the_workers_own_touches_are_not_published_as_its_engines_load(
        client: aioredis.Redis) -> None:
    # The engine reports one running request. Were it a touch of the worker's own holds
    # (in flight through the probe), it is upkeep, not load: counted, it sent a held job's
    # next step to another engine when a heartbeat caught one (CI, 2026-12-08).
    registry = EngineRegistry(client, ttl_s=120)
    holds = Holding()
    holds.touching = 1
    async with heartbeating(registry, holds, 0.05):
        await eventually(lambda: published(registry, "running", 0))
        holds.touching = 0  # a step, then: load
        await eventually(lambda: published(registry, "running", 1))


class SlowRegistry:
    """Records each heartbeat's held tokens; the first with ``block_at`` waits on ``gate``."""

    def __init__(self, block_at: int) -> None:
        self.held: list[int] = []
        self.block_at = block_at
        self.gate = asyncio.Event()
        self.blocked = asyncio.Event()

    async def heartbeat(self, hb: EngineHeartbeat) -> None:
        self.held.append(hb.held_tokens)
        if hb.held_tokens == self.block_at and not self.gate.is_set():
            self.blocked.set()
            await self.gate.wait()


async def test_holds_made_while_a_publish_hangs_follow_it_the_latest_once() -> None:
    registry = SlowRegistry(block_at=100)
    holds = Holding()
    async with heartbeating(registry, holds, 60.0):
        async def sent(tokens: int) -> bool:
            return tokens in registry.held

        await eventually(lambda: sent(0))
        holds.held_tokens = 100
        holds.held_more.set()
        await asyncio.wait_for(registry.blocked.wait(), 5)  # Redis hangs on this one
        async def woken() -> bool:
            return not holds.held_more.is_set()

        for tokens in (200, 300):  # two more holds meanwhile: one follow-up, the latest
            holds.held_tokens = tokens
            holds.held_more.set()
            await eventually(woken)  # the loop took the wake
        registry.gate.set()
        await eventually(lambda: sent(300), timeout_s=5.0)
        assert registry.held == [0, 100, 300]


async def test_the_kv_event_loop_rides_out_a_redis_outage(server: RedisServer,
                                                          client: aioredis.Redis) -> None:
    """Events that arrive while Redis is away are not lost for good: when it is back,
    the directory is rebuilt from what the worker knows the engine holds."""
    directory = PrefixDirectory(client)
    applier = KvEventApplier(directory, "e0")
    endpoint = "inproc://kv-events-redis-blip"
    loop = asyncio.ensure_future(inference_worker.kv_event_loop(endpoint, applier))
    pub = zmq.asyncio.Context.instance().socket(zmq.PUB)
    seq = 0

    async def publish(block: int) -> None:
        nonlocal seq
        seq += 1
        stored = {"type": "BlockStored", "block_hashes": [block], "parent_block_hash": None,
                  "token_ids": [block] * 4, "block_size": 4, "lora_id": None}
        await pub.send_multipart([b"kv-events", seq.to_bytes(8, "big"),
                                  msgpack.packb([time.time(), [stored]])])

    try:
        await asyncio.sleep(0.1)
        pub.connect(endpoint)
        await asyncio.sleep(0.2)  # the subscription reaches the publisher

        async def blocks(n: int) -> bool:
            return await directory.engine_blocks("e0") == n

        await publish(1)
        await eventually(lambda: blocks(1))
        server.kill()
        await publish(2)  # Redis away: the directory cannot take it now
        await asyncio.sleep(2.0)  # past the client's retries: the write failed
        assert not loop.done(), loop.exception() if loop.done() else None
        server.start()  # empty, as a Redis without persistence comes back
        await publish(3)
        await eventually(lambda: blocks(3))  # 1 and 2 (restored) and 3
        assert not loop.done()
    finally:
        loop.cancel()
        pub.close(linger=0)
    assert await client.zcard(ENGINE_BLOCKS.format("e0")) == 3


async def test_the_agent_workers_heartbeat_rides_out_a_redis_outage(
        server: RedisServer, client: aioredis.Redis) -> None:
    from warmloop.workers.agent_worker import beat

    loop = asyncio.ensure_future(beat(client, "warmloop:worker:agent:test", ttl_s=5,
                                      interval_s=0.05))
    try:
        await eventually(lambda: client.exists("warmloop:worker:agent:test"))
        server.kill()
        await asyncio.sleep(1.0)
        assert not loop.done(), loop.exception() if loop.done() else None
        server.start()
        await eventually(lambda: client.exists("warmloop:worker:agent:test"))
    finally:
        loop.cancel()


# ---- holds and statistics -----------------------------------------------------------------


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def holds_without_redis(touches: list[dict[str, Any]]) -> tuple[HoldManager, Clock]:
    def engine_touch(request: httpx.Request) -> httpx.Response:
        import json
        body = json.loads(request.content)
        touches.append(body)
        n = len(body["prompt"])
        return httpx.Response(200, json={"usage": {
            "prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": n - 1}}})

    info = hb("e0").model_copy(update={"kv_capacity_tokens": 16384, "kv_usage": 0.3})
    redis, clock, outage = nowhere_redis(), Clock(), RedisOutage()  # one per worker
    return HoldManager(engine_id="e0", base_url="http://engine", model="tiny",
                       http=httpx.AsyncClient(transport=httpx.MockTransport(engine_touch)),
                       redis=redis, pauses=PauseStats(redis, outage=outage),
                       engine_info=lambda: info, config=HoldConfig(), clock=clock,
                       outage=outage), clock


async def test_holds_are_kept_warm_while_redis_is_away(outage_log: Recorder) -> None:
    touches: list[dict[str, Any]] = []
    m, clock = holds_without_redis(touches)
    triage = get_profile("ticket-triage")
    choice = await m.after_step(job_id="j0", profile=triage, kind="tool:search_kb",
                                prefix_tokens=list(range(257)), policy="cost_model",
                                interactive=True)  # decided on the prior
    assert choice is not None and "j0" in m.holds
    m.resume("j0")
    await m.after_step(job_id="j1", profile=triage, kind="tool:search_kb",
                       prefix_tokens=list(range(257)), policy="always_hold", interactive=True)
    for _ in range(3):
        clock.t = m.holds["j1"].next_touch
        await m.tick()  # raised before: the touch's statistics could not be counted
    assert len(touches) == 3  # one touch each time one was due, none in between
    await m.tick()
    assert len(touches) == 3
    assert len(outage_log.named("redis_unavailable")) == 1


async def test_the_hold_loop_logs_an_outage_once(monkeypatch: pytest.MonkeyPatch,
                                                 outage_log: Recorder) -> None:
    from warmloop.activities import holds as holds_module

    holds_log = Recorder()
    monkeypatch.setattr(holds_module, "log", holds_log)
    m, _ = holds_without_redis([])
    loop = asyncio.ensure_future(m.run(tick_s=0.01))
    await asyncio.sleep(0.5)
    loop.cancel()
    assert not holds_log.named("hold_tick_failed")  # an outage is not a failing tick
    assert len(outage_log.named("redis_unavailable")) == 1


async def test_pause_statistics_are_best_effort() -> None:
    stats = PauseStats(nowhere_redis())
    await stats.record("ticket-triage", "tool:search_kb", 2.0)  # raised before
    dist = await stats.distribution(get_profile("ticket-triage"), "tool:search_kb")
    assert dist.samples == () and dist.prior_median_s == 1.0  # the profile's prior


# ---- generate -----------------------------------------------------------------------------


async def test_a_step_returns_its_result_while_redis_is_away() -> None:
    inf, holds = redis_backed_inference(nowhere_redis())
    req = step_request(hold_policy="always_hold")
    started = time.monotonic()
    result = await generate(inf, req)
    assert [c.function.name for c in result.tool_calls] == ["search_kb"]
    assert result.prompt_tokens == 300 and result.cached_tokens == 256
    assert "j1" in holds.holds  # the hold is kept in memory, touched without Redis
    assert time.monotonic() - started < 3.0
    holds.resume("j1")
    result = await generate(inf, step_request(step=2))  # holds.resume, step_done: best effort
    assert result.completion_tokens == 12


async def test_a_step_returns_in_time_while_redis_hangs(server: RedisServer,
                                                       client: aioredis.Redis) -> None:
    inf, _ = redis_backed_inference(client)
    await generate(inf)  # connections made
    server.stop()
    try:
        started = time.monotonic()
        result = await generate(inf, step_request(step=2), timeout_s=30.0, drain=False)
        took = time.monotonic() - started
    finally:
        server.cont()
    assert await inf.drain() == 0  # its bookkeeping finishes once Redis is back
    assert result.completion_tokens == 12
    assert took < 5.0, f"a hung Redis held the step for {took:.1f} s"


async def test_steps_finished_while_redis_was_away_leave_the_in_flight_set(
        server: RedisServer, client: aioredis.Redis) -> None:
    registry = EngineRegistry(client, ttl_s=5)
    inf, _ = redis_backed_inference(client)
    await registry.step_routed("e0", "j1:1|ticket-triage")
    server.kill()
    await generate(inf)
    server.start()
    await registry.step_routed("e0", "j1:1|ticket-triage")  # the restarted server: empty
    async def probe_due() -> bool:  # past the pause before Redis is tried again
        return bool(inf._outage.should_try())

    await eventually(probe_due)
    await generate(inf, step_request(step=2))
    assert await client.zrange(INFLIGHT_KEY.format("e0"), 0, -1) == []


# ---- route_step ---------------------------------------------------------------------------


def route(step: int, job: str = "j1", last: str | None = None, **kw: Any) -> RouteRequest:
    return RouteRequest(job_id=job, step=step, profile="ticket-triage", last_engine=last, **kw)


async def run_route(acts: RoutingActivities, req: RouteRequest) -> Any:
    return await asyncio.wait_for(ActivityEnvironment().run(acts.route_step, req), 30)


async def test_route_step_uses_the_last_known_engines_while_redis_is_away(
        server: RedisServer, client: aioredis.Redis) -> None:
    registry = EngineRegistry(client, ttl_s=5)
    await registry.heartbeat(hb("e0", running=3))
    await registry.heartbeat(hb("e1", running=0))
    acts = RoutingActivities(registry, client)
    first = await run_route(acts, route(1))
    server.kill()
    started = time.monotonic()
    again = await run_route(acts, route(2, last=first.engine_id))
    assert again.engine_id == first.engine_id and again.reason == "sticky"
    new = await run_route(acts, route(1, job="j2"))  # the least loaded, as last known
    assert new.engine_id == "e1"
    moved = await run_route(acts, route(2, last="e1", exclude=["e1"]))
    assert moved.engine_id == "e0" and moved.reason == "failover"
    assert time.monotonic() - started < 4.0


async def test_route_step_answers_in_time_while_redis_hangs(server: RedisServer,
                                                           client: aioredis.Redis) -> None:
    registry = EngineRegistry(client, ttl_s=5)
    await registry.heartbeat(hb("e0"))
    acts = RoutingActivities(registry, client)
    await run_route(acts, route(1))
    server.stop()
    try:
        started = time.monotonic()
        decision = await run_route(acts, route(2, last="e0"))
        took = time.monotonic() - started
    finally:
        server.cont()
    assert decision.engine_id == "e0"
    assert took < 3.0, f"route_step took {took:.1f} s (its local activity times out at 5 s)"


async def test_route_step_without_any_snapshot_asks_to_be_retried() -> None:
    redis = nowhere_redis()
    acts = RoutingActivities(EngineRegistry(redis, ttl_s=5), redis)
    with pytest.raises(ApplicationError) as err:
        await run_route(acts, route(1))
    assert err.value.type == REDIS_UNAVAILABLE and not err.value.non_retryable
