"""A batch without a window asks the fleet: the jobs its engines' KV pools hold for batch
work, less other batches' jobs under way (``lanes.fleet_batch_window``, the
``batch_window`` activity over a real redis-server, the engines' published KV fit)."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
from temporalio.testing import ActivityEnvironment

from tests.unit.engine_fakes import RedisServer
from warmloop.activities.admission import BatchAdmission
from warmloop.activities.registry import (
    BATCH_CLAIM_S,
    BATCH_CLAIMS_KEY,
    BatchClaim,
    EngineHeartbeat,
    EngineRegistry,
)
from warmloop.activities.routing import RoutingActivities
from warmloop.workflows.lanes import (
    DEFAULT_BATCH_WINDOW,
    AdmissionConfig,
    BatchWindow,
    BatchWindowRequest,
    EngineBatchRoom,
    batch_of,
    fleet_batch_window,
)


def room(engine_id: str, kv_fit: int | None = None, batch_limit: int | None = None
         ) -> EngineBatchRoom:
    return EngineBatchRoom(engine_id=engine_id, kv_fit=kv_fit, batch_limit=batch_limit)


# ---- the policy ---------------------------------------------------------------------------


def test_the_window_is_the_jobs_the_pools_hold_less_other_batches() -> None:
    w = fleet_batch_window([room("e0", kv_fit=9, batch_limit=4),
                            room("e1", kv_fit=7, batch_limit=4)], max_window=64,
                           others={"weekly": 3})
    assert (w.window, w.fit, w.others) == (13, 16, {"weekly": 3})
    assert "e0 9" in w.why and "e1 7" in w.why and "less 3 for 1 other batch" in w.why


def test_a_batch_beside_others_that_took_the_fit_still_gets_an_equal_share() -> None:
    w = fleet_batch_window([room("e0", kv_fit=30)], max_window=64,
                           others={"a": 30, "b": 10, "gone": 0})
    assert w.window == 10 and "an equal share, 10" in w.why  # 30 // (2 others + this one)
    assert w.others == {"a": 30, "b": 10}


def test_an_engine_that_has_not_served_a_batch_step_counts_its_admission_limit() -> None:
    w = fleet_batch_window([room("e0", kv_fit=9, batch_limit=4), room("e1", batch_limit=5)],
                           max_window=64)
    assert (w.window, w.fit) == (14, 14)
    assert w.engines == {"e0": 9, "e1": 5} and w.by_k == ["e1"] and "e1 5 (K)" in w.why


def test_engines_without_batch_admission_say_nothing_and_the_default_holds() -> None:
    w = fleet_batch_window([room("e0"), room("e1")], max_window=64)
    assert (w.window, w.fit) == (DEFAULT_BATCH_WINDOW, None)
    assert "no batch admission" in w.why
    assert fleet_batch_window([room("e0")], max_window=2).window == 2
    # only the engines that say anything count
    assert fleet_batch_window([room("e0"), room("e1", kv_fit=6)], max_window=64).window == 6


def test_the_window_stays_within_one_and_max_window() -> None:
    assert fleet_batch_window([room("e0", kv_fit=1)], max_window=64,
                              others={"a": 8}).window == 1
    capped = fleet_batch_window([room("e0", kv_fit=300)], max_window=64)
    assert capped.window == 64 and "capped at max_window 64" in capped.why


def test_an_engine_publishes_its_kv_fit_once_it_has_served_batch_steps() -> None:
    pool = beat("e0")
    pool.kv_capacity_tokens, pool.block_size = 12_288, 1
    adm = BatchAdmission(AdmissionConfig(kv_share=0.5), kv_pool=lambda: pool)
    assert adm.kv_fit is None  # no batch step seen: no job size to divide by
    for prompt in (1_700, 1_800, 1_900):
        adm.observe_batch(prompt, shared_tokens=1_400)
    # (0.5 * 12,288 - 1,400) // mean(300, 400, 500) = 4,744 // 400
    assert adm.kv_fit == 11
    assert BatchAdmission(kv_pool=lambda: None).kv_fit is None  # no heartbeat yet
    pool.kv_capacity_tokens = 0
    assert adm.kv_fit is None  # the pool unknown


# ---- the activity, over a real redis-server -----------------------------------------------


def beat(engine_id: str, *, model: str = "tiny", kv_fit: int | None = None,
         batch_limit: int | None = None) -> EngineHeartbeat:
    return EngineHeartbeat(engine_id=engine_id, task_queue=f"engine.{engine_id}", model=model,
                           url=f"http://{engine_id}", healthy=True, batch_kv_fit=kv_fit,
                           batch_limit=batch_limit, at=time.time())


async def ask(acts: RoutingActivities, batch_id: str = "nightly", model: str | None = "tiny",
              max_window: int = 64) -> BatchWindow:
    req = BatchWindowRequest(batch_id=batch_id, model=model, max_window=max_window)
    return await asyncio.wait_for(ActivityEnvironment().run(acts.batch_window, req), 30)


async def test_the_activity_adds_the_engines_of_the_model_and_leaves_out_its_own_jobs(
        redis: aioredis.Redis) -> None:
    registry = EngineRegistry(redis, ttl_s=5)
    await registry.heartbeat(beat("e0", kv_fit=9, batch_limit=4))
    await registry.heartbeat(beat("e1", batch_limit=3))
    await registry.heartbeat(beat("big", model="other", kv_fit=100))
    # jobs under way: two of another batch on e0, and this batch's own on e0 and e1
    for engine, job in (("e0", "weekly-L3"), ("e0", "weekly-L4"), ("e0", "nightly-L1"),
                        ("e1", "nightly-L2")):
        await registry.batch_job_routed(engine, job)
    acts = RoutingActivities(registry, redis)
    w = await ask(acts)
    assert (w.window, w.fit, w.others) == (10, 12, {"weekly": 2})
    assert "big" not in w.why
    # a batch whose profile names no model counts every engine
    assert (await ask(acts, model=None)).fit == 112
    # nothing serves the model: the default, and why
    none = await ask(acts, model="absent")
    assert none.window == DEFAULT_BATCH_WINDOW and "no live engine serving model absent" \
        in none.why


async def test_batches_that_ask_together_share_the_fit_by_their_claims(
        redis: aioredis.Redis) -> None:
    registry = EngineRegistry(redis, ttl_s=5)
    await registry.heartbeat(beat("e0", kv_fit=20))
    await registry.heartbeat(beat("e1", kv_fit=10))
    acts = RoutingActivities(registry, redis)
    # neither has a job under way yet: the second sees the first's claim
    first = await ask(acts, batch_id="tickets")
    second = await ask(acts, batch_id="invoices")
    assert (first.window, second.window) == (30, 15)  # 30 claimed: an equal share, 30 // 2
    assert second.others == {"tickets": 30}
    # the first's next page: the second's claim, and its own claim is not another's
    again = await ask(acts, batch_id="tickets")
    assert again.others == {"invoices": 15} and again.window == 15
    # once under way, a batch counts its jobs there, or its claim if more
    for i in range(1, 21):
        await registry.batch_job_routed("e0", f"invoices-L{i}")
    assert (await ask(acts, batch_id="tickets")).others == {"invoices": 20}
    # a lone batch-lane job is a batch of its own; another model's claims do not count
    await registry.batch_job_routed("e1", "job-abc")
    await registry.claim_batch_window("gpu-batch", lambda _: (BatchClaim(
        window=50, model="big", at=time.time()), None))
    assert (await ask(acts, batch_id="tickets")).others == {"invoices": 20, "job-abc": 1}
    # claims older than BATCH_CLAIM_S are forgotten (and dropped from Redis)
    await registry.claim_batch_window("old", lambda _: (BatchClaim(
        window=9, at=time.time() - BATCH_CLAIM_S - 1), None))
    # and so is an entry this version cannot read (garbage, another version's claim)
    await redis.hset(BATCH_CLAIMS_KEY, "garbled", b"{not json")
    assert not {"old", "garbled"} & set((await ask(acts, batch_id="tickets")).others)
    assert not await redis.hexists(BATCH_CLAIMS_KEY, "old")
    assert not await redis.hexists(BATCH_CLAIMS_KEY, "garbled")
    assert batch_of("nightly-L12") == "nightly" and batch_of("nightly-Lx") == "nightly-Lx"


async def test_batches_asking_at_the_same_moment_see_each_others_claims(
        redis: aioredis.Redis) -> None:
    """The claims are read and written as one transaction: of batches that ask at once,
    each but the first decides on the claims of those before it, and none claims more
    of the page than it will run."""
    registry = EngineRegistry(redis, ttl_s=5)
    await registry.heartbeat(beat("e0", kv_fit=24))
    acts = RoutingActivities(registry, redis)
    answers = await asyncio.gather(*(ask(acts, batch_id=f"b{i}") for i in range(4)))
    first = [a for a in answers if not a.others]
    assert len(first) == 1 and first[0].window == 24  # only one saw no other batch
    assert sorted(len(a.others) for a in answers) == [0, 1, 2, 3]
    # a page of 5 records claims 5 of the fit, not the whole of it
    await redis.delete(BATCH_CLAIMS_KEY)
    small = await asyncio.wait_for(ActivityEnvironment().run(
        acts.batch_window, BatchWindowRequest(batch_id="small", model="tiny", max_window=64,
                                              records=5)), 30)
    assert small.window == 24 and (await ask(acts, batch_id="big")).others == {"small": 5}


async def test_a_crowd_of_batches_asking_at_once_never_decides_on_a_stale_read(
        redis: aioredis.Redis) -> None:
    """Thirty batches at once: each claim is written only on the read it decided on
    (never unguarded after its retries), so the batches that got an answer from the
    fleet each saw a different number of others; one that ran out of retries gets the
    default, and says so."""
    registry = EngineRegistry(redis, ttl_s=5)
    await registry.heartbeat(beat("e0", kv_fit=240))
    acts = RoutingActivities(registry, redis)
    answers = await asyncio.gather(*(ask(acts, batch_id=f"c{i}") for i in range(30)))
    decided = [a for a in answers if a.fit is not None]
    crowded = [a for a in answers if a.fit is None]
    assert all("too many batches asking at once" in a.why for a in crowded)
    seen = sorted(len(a.others) for a in decided)
    assert seen == list(range(len(decided))), seen  # one after another
    assert len(decided) >= 2


async def test_the_activity_answers_the_default_while_redis_is_away(
        server: RedisServer, client: aioredis.Redis) -> None:
    registry = EngineRegistry(client, ttl_s=5)
    await registry.heartbeat(beat("e0", kv_fit=9))
    acts = RoutingActivities(registry, client)
    assert (await ask(acts)).window == 9
    server.kill()
    w = await ask(acts, max_window=3)
    assert (w.window, w.fit) == (3, None) and "registry unreadable" in w.why


async def test_the_activity_answers_in_time_while_redis_hangs(
        server: RedisServer, client: aioredis.Redis) -> None:
    registry = EngineRegistry(client, ttl_s=5)
    await registry.heartbeat(beat("e0", kv_fit=9))
    acts = RoutingActivities(registry, client)
    server.stop()
    try:
        started = time.monotonic()
        w = await ask(acts)
        took = time.monotonic() - started
    finally:
        server.cont()
    assert w.window == DEFAULT_BATCH_WINDOW and "registry unreadable" in w.why
    assert took < 4.0, f"batch_window took {took:.1f} s (its local activity times out at 5 s)"
