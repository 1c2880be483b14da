"""An engine's batch slots shared through Redis by every process that admits batch calls
to it (``SharedBatchSlots``): N processes run at most K, a dead holder's slots come back
when their leases end, and a Redis that is away leaves each process its own K."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from tests.polling import eventually
from tests.unit.engine_fakes import RedisServer
from warmloop.activities.admission import BATCH_SLOTS_KEY, BatchAdmission, SharedBatchSlots
from warmloop.activities.registry import EngineHeartbeat, EngineRegistry
from warmloop.workers.inference_worker import _publish
from warmloop.workflows.lanes import AdmissionConfig

# K fixed at 2 (no growth while idle within a test)
CONFIG = AdmissionConfig(k_start=2, k_min=2, k_max=2, idle_grow_s=3600)


def process(redis: aioredis.Redis, holder: str, *, lease_s: float = 30.0,
            config: AdmissionConfig = CONFIG, local_after_s: float = 5.0) -> BatchAdmission:
    return BatchAdmission(config, shared=SharedBatchSlots(
        redis, "e0", holder=holder, lease_s=lease_s, local_after_s=local_after_s))


async def test_two_processes_run_at_most_k_together(redis: aioredis.Redis) -> None:
    worker, gateway = process(redis, "worker"), process(redis, "gateway")
    await worker.acquire("job-1")
    await gateway.acquire("job-2")
    assert worker.shared is not None and await worker.shared.in_use() == 2
    # Each process has room of its own (1 of 2), the engine has none.
    third = asyncio.ensure_future(worker.acquire("job-3"))
    fourth = asyncio.ensure_future(gateway.acquire("job-4"))
    await eventually(lambda: _true(worker.fleet_waiting == 1 and gateway.fleet_waiting == 1))
    assert not third.done() and not fourth.done()
    assert await worker.shared.in_use() == 2

    await gateway.release()  # one slot frees: one of the two waiting calls takes it
    done, pending = await asyncio.wait({third, fourth}, return_when=asyncio.FIRST_COMPLETED)
    assert len(done) == 1 and len(pending) == 1
    assert await worker.shared.in_use() == 2
    await (worker if third in done else gateway).release()
    await asyncio.wait_for(pending.pop(), 5)
    assert await worker.shared.in_use() == 2
    for p in (worker, gateway):
        while p.active:
            await p.release()
    assert await worker.shared.in_use() == 0
    assert await redis.zcard(BATCH_SLOTS_KEY.format("e0")) == 0


async def test_a_dead_holders_slots_come_back_when_their_leases_end(
        redis: aioredis.Redis) -> None:
    dead = process(redis, "dead", lease_s=0.5)
    await dead.acquire("a")
    await dead.acquire("b")  # and then it dies: no release, no renewal
    alive = process(redis, "alive")
    started = asyncio.get_running_loop().time()
    await asyncio.wait_for(alive.acquire("c"), 5)
    assert asyncio.get_running_loop().time() - started >= 0.3  # it waited for the lease
    assert alive.shared is not None and await alive.shared.in_use() == 1


async def test_a_renewed_lease_keeps_its_slot_past_its_first_term(
        redis: aioredis.Redis) -> None:
    config = CONFIG.model_copy(update={"k_start": 1, "k_min": 1, "k_max": 1})
    holder = process(redis, "holder", lease_s=0.6, config=config)
    await holder.acquire("long-call")
    other = process(redis, "other", config=config)
    assert other.shared is not None and holder.shared is not None
    loop = asyncio.get_running_loop()
    until = loop.time() + 1.5  # 2.5 leases
    while loop.time() < until:
        await holder.shared.renew_if_due()  # the holder's heartbeat
        assert not await other.shared.take(1, other.shared.new_token())
        await asyncio.sleep(0.05)
    await holder.release()
    assert await other.shared.take(1, other.shared.new_token())


async def test_the_worker_renews_its_leases_while_its_engine_fails_its_health_check(
        redis: aioredis.Redis) -> None:
    # An engine too busy to answer /health in time is when batch calls run longest.
    config = CONFIG.model_copy(update={"k_start": 1, "k_min": 1, "k_max": 1})
    worker = process(redis, "worker-e0", lease_s=0.6, config=config)
    await worker.acquire("long-step")
    unhealthy = EngineHeartbeat(engine_id="e0", task_queue="engine.e0", model="tiny",
                                url="http://e0", healthy=False, at=0.0)
    registry = EngineRegistry(redis, ttl_s=60)
    other = process(redis, "gateway", config=config)
    assert other.shared is not None
    loop = asyncio.get_running_loop()
    until = loop.time() + 1.5
    while loop.time() < until:
        await _publish(registry, unhealthy, "e0", worker)  # a beat
        assert not await other.shared.take(1, other.shared.new_token())
        await asyncio.sleep(0.05)


async def test_a_take_asked_again_finds_the_slot_it_took(redis: aioredis.Redis) -> None:
    # its first answer lost (a timeout after Redis ran it): the retry, same token, gets
    # the slot, not a refusal from a set it fills itself
    one = SharedBatchSlots(redis, "e0", holder="one")
    token = one.new_token()
    assert await one.take(1, token)
    one.tokens.clear()  # as if the answer never came
    assert await one.take(1, token)
    assert one.tokens == [token] and await one.in_use() == 1
    assert not await one.take(1, one.new_token())


async def test_the_engines_k_is_the_smallest_sharers(redis: aioredis.Redis) -> None:
    # The gateway's K follows the worker's (its ceiling, the heartbeat's batch_limit):
    # with K 1 there and 4 here, the engine runs one batch call, not four.
    worker_k: list[int | None] = [1]
    gateway = BatchAdmission(CONFIG.model_copy(update={"k_start": 4, "k_max": 4, "k_min": 1}),
                             shared=SharedBatchSlots(redis, "e0", holder="gw"),
                             ceiling=lambda: worker_k[0])
    assert gateway.effective_limit == 1
    await gateway.acquire("a")
    second = asyncio.ensure_future(gateway.acquire("b"))
    await eventually(lambda: _true(gateway.waiting == 1))
    assert gateway.shared is not None and await gateway.shared.in_use() == 1
    worker_k[0] = None  # no worker admits on this engine: the gateway's own K
    await gateway.release()
    await asyncio.wait_for(second, 5)
    assert gateway.effective_limit == 4


async def test_a_call_cancelled_waiting_for_the_fleet_gives_its_place_back(
        redis: aioredis.Redis) -> None:
    config = CONFIG.model_copy(update={"k_start": 1, "k_min": 1, "k_max": 1})
    first, second = process(redis, "a", config=config), process(redis, "b", config=config)
    await first.acquire("j1")
    waiting = asyncio.ensure_future(second.acquire("j2"))
    await eventually(lambda: _true(second.fleet_waiting == 1))
    waiting.cancel()
    await asyncio.gather(waiting, return_exceptions=True)
    assert second.active == 0 and second.waiting == 0 and second.fleet_waiting == 0
    assert second.shared is not None and second.shared.tokens == []
    assert "j2" not in second._started  # it never began: no continuing job's place later
    await first.release()
    await asyncio.wait_for(second.acquire("j3"), 5)
    assert await second.shared.in_use() == 1


async def test_with_redis_away_a_while_each_process_admits_its_own_k(
        server: RedisServer, client: aioredis.Redis) -> None:
    one, two = process(client, "one"), process(client, "two", local_after_s=2.0)
    await one.acquire("a")
    await one.acquire("b")
    server.stop()  # hung, not refused: each call waits out its timeout
    try:
        loop = asyncio.get_running_loop()
        started = loop.time()
        await asyncio.wait_for(two.acquire("c"), 15)
        # not at the first failure: a blip does not let the waiting calls in
        assert loop.time() - started >= 2.0
        await asyncio.wait_for(two.acquire("d"), 15)
        assert two.active == 2 and two.shared is not None and len(two.shared.tokens) == 2
        third = asyncio.ensure_future(two.acquire("e"))  # its own K still holds
        await eventually(lambda: _true(two.waiting == 1))
        assert not third.done()
        await asyncio.wait_for(two.release(), 10)
        await asyncio.wait_for(third, 10)
    finally:
        server.cont()
    await one.release()
    await one.release()
    assert one.shared is not None and await one.shared.in_use() == 0


async def _true(value: bool) -> bool:
    return value


async def test_a_slot_given_back_during_a_renewal_stays_given_back(
        redis: aioredis.Redis) -> None:
    one = SharedBatchSlots(redis, "e0", holder="one", lease_s=3.0)
    token = one.new_token()
    assert await one.take(4, token)
    one._renewed_at -= 10  # a renewal is due
    renew = one._renew

    async def slow_renew(**kwargs: Any) -> Any:
        await one.give_back()  # the call ends while the renewal is on its way
        return await renew(**kwargs)  # and it puts the token back

    one._renew = slow_renew  # type: ignore[assignment]
    await one.renew_if_due()
    assert one.tokens == [] and await one.in_use() == 0


async def test_a_restarted_worker_gives_back_what_its_predecessor_left(
        redis: aioredis.Redis) -> None:
    crashed = SharedBatchSlots(redis, "e0", holder="worker-e0")
    gateway = SharedBatchSlots(redis, "e0", holder="gw")
    for slots in (crashed, crashed, gateway):
        assert await slots.take(4, slots.new_token())
    restarted = SharedBatchSlots(redis, "e0", holder="worker-e0")
    assert await restarted.take(4, restarted.new_token())
    assert await restarted.forget_predecessors() == 2
    # its own slot and the gateway's stay
    assert await restarted.in_use() == 2 and await gateway.in_use() == 2
    assert await restarted.forget_predecessors() == 0
