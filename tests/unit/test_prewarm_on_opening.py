"""An approval's opening pre-warms only where holding the prompt to the decision pays.

Opened and left for long, a pre-warmed prompt is let go before the decision under load,
and the decision's own pre-warm computes it a second time; the simulator's agentic fleet
lost 1.8 % of its jobs to it against cache-aware routing (``bench.fleet``, 6 seeds). The
worker asks its hold model, over the wait from opening to decision the workflow records
(``holding.viewed_kind``), before it sends anything."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest
import redis.asyncio as aioredis
from temporalio.testing import ActivityEnvironment

from tests.unit.engine_fakes import engine, inference, step_request
from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.holds import Hold, HoldManager
from warmloop.activities.pauses import PauseStats, prior_for
from warmloop.activities.registry import EngineHeartbeat, RedisOutage
from warmloop.workflows.contracts import GenerateRequest, GenerateResult
from warmloop.workflows.holding import (
    PREWARM_DECLINED,
    VIEWED_PRIOR_S,
    HoldAction,
    PauseDistribution,
    cap_turnover_s,
    hold_lasts_the_wait,
    viewed_kind,
)
from warmloop.workflows.profiles import get_profile

KIND = viewed_kind("approval:urgent_priority")
PROFILE = "ticket-triage"


def _worker(redis: aioredis.Redis, sent: list[httpx.Request]
            ) -> tuple[object, HoldManager]:
    # a busy pool (95 % in use): the contention model's rent is dear
    info = EngineHeartbeat(engine_id="e0", task_queue="engine.e0", model="tiny",
                           url="http://e0", healthy=True, kv_capacity_tokens=16384,
                           kv_usage=0.95, block_size=16, at=time.time())
    outage = RedisOutage()
    transport = engine(requests=sent)
    directory = PrefixDirectory(redis)
    holds = HoldManager(engine_id="e0", base_url="http://engine", model="tiny",
                        http=httpx.AsyncClient(transport=transport), redis=redis,
                        pauses=PauseStats(redis, outage=outage), engine_info=lambda: info,
                        directory=directory, outage=outage)
    return inference(transport, engine_info=lambda: info, holds=holds, outage=outage,
                     directory=directory), holds


def _opening(**kw: object) -> GenerateRequest:
    return step_request(2).model_copy(update={
        "max_tokens": 1, "tail": "", "pause_kind": KIND, "hold_policy": "cost_model",
        "prompt_tokens_hint": 8000, **kw})


async def _prewarm(inf: object, req: GenerateRequest) -> GenerateResult:
    result: GenerateResult = await asyncio.wait_for(
        ActivityEnvironment().run(inf.prewarm, req), 10)  # type: ignore[attr-defined]
    return result


def _sent(requests: list[httpx.Request]) -> int:
    return sum(r.url.path == "/v1/chat/completions" for r in requests)


async def test_an_opening_decided_long_after_is_not_prewarmed(redis: aioredis.Redis) -> None:
    sent: list[httpx.Request] = []
    inf, holds = _worker(redis, sent)
    stats = PauseStats(redis, outage=RedisOutage())
    for _ in range(30):  # openings decided an hour later
        await stats.record(PROFILE, KIND, 3600.0)
    choice = await holds.decide(profile=get_profile(PROFILE), kind=KIND, prefix_tokens=8000,
                                policy="cost_model", interactive=True)
    assert choice is not None and choice.action == HoldAction.RELEASE
    declined = await _prewarm(inf, _opening())
    assert declined.finish_reason == PREWARM_DECLINED and _sent(sent) == 0
    # the same opening under always_hold, or without the prompt's size, goes as before
    for req in (_opening(hold_policy="always_hold"), _opening(prompt_tokens_hint=None)):
        assert (await _prewarm(inf, req)).finish_reason != PREWARM_DECLINED
    assert _sent(sent) == 2


async def test_an_opening_decided_soon_is_prewarmed_and_held(redis: aioredis.Redis) -> None:
    sent: list[httpx.Request] = []
    inf, holds = _worker(redis, sent)
    stats = PauseStats(redis, outage=RedisOutage())
    for _ in range(30):  # decided a fraction of a second after it was opened
        await stats.record(PROFILE, KIND, 0.2)
    warmed = await _prewarm(inf, _opening(prompt_tokens_hint=2000))  # under the cap
    assert warmed.finish_reason != PREWARM_DECLINED and _sent(sent) == 1
    assert await inf.drain(10) == 0  # type: ignore[attr-defined]
    held = holds.holds.get("j1")
    assert held is not None and held.kind == KIND  # held through the wait to the decision


async def test_a_fresh_stack_prices_an_opening_by_its_own_prior(redis: aioredis.Redis) -> None:
    """Until the wait from opening to decision has samples, its prior is a minute or two,
    not the whole approval's (which would decline every opening's pre-warm)."""
    profile = get_profile(PROFILE)
    assert prior_for(profile, KIND) == VIEWED_PRIOR_S
    assert prior_for(profile, "approval:urgent_priority") != VIEWED_PRIOR_S
    dist = await PauseStats(redis, outage=RedisOutage()).distribution(profile, KIND)
    assert dist.prior_median_s == VIEWED_PRIOR_S[0]


async def test_a_failed_decision_sends_the_prewarm(redis: aioredis.Redis,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    sent: list[httpx.Request] = []
    inf, holds = _worker(redis, sent)

    async def fail(*_: object, **__: object) -> None:
        raise ValueError("garbage in the pause statistics")

    monkeypatch.setattr(holds, "decide", fail)
    assert (await _prewarm(inf, _opening())).finish_reason != PREWARM_DECLINED
    assert _sent(sent) == 1


async def test_an_opening_reads_its_pause_statistics_once(
        redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    """The hold model and the cap's check weigh the same wait: one Redis read serves
    both (each is a round trip on the pre-warm's path)."""
    sent: list[httpx.Request] = []
    inf, holds = _worker(redis, sent)
    stats = PauseStats(redis, outage=RedisOutage())
    for _ in range(30):
        await stats.record(PROFILE, KIND, 1.0)
    reads: list[str] = []
    histogram = PauseStats.histogram

    async def counted(self: PauseStats, profile: str, kind: str) -> dict[int, int]:
        reads.append(kind)
        return await histogram(self, profile, kind)

    monkeypatch.setattr(PauseStats, "histogram", counted)
    _held(holds, "other", 4000, age_s=60.0)  # over the cap: both checks are asked
    warmed = await _prewarm(inf, _opening(prompt_tokens_hint=2000))
    assert warmed.finish_reason != PREWARM_DECLINED and _sent(sent) == 1
    # one for the opening's two checks, one for the hold made once the prompt is computed
    assert reads == [KIND, KIND]


def _held(holds: HoldManager, job_id: str, tokens: int, age_s: float) -> None:
    """Another job's hold of ``tokens`` made ``age_s`` ago (no chain: counted whole)."""
    now = time.time()  # the hold manager's clock
    holds.holds[job_id] = Hold(job_id=job_id, kind="tool:lookup", tokens=[1] * tokens,
                               until=now + 600, next_touch=now + 600, created=now - age_s)


async def test_an_opening_whose_hold_the_cap_would_let_go_first_is_not_prewarmed(
        redis: aioredis.Redis) -> None:
    """At a full cap the holds go oldest first, so a new one lasts about as long as the
    oldest has: an opening decided 1 s later, beside a hold made 0.2 s ago, would be let go
    before its decision and computed twice. Beside one made 60 s ago, it goes."""
    sent: list[httpx.Request] = []
    inf, holds = _worker(redis, sent)
    stats = PauseStats(redis, outage=RedisOutage())
    for _ in range(30):
        await stats.record(PROFILE, KIND, 1.0)
    choice = await holds.decide(profile=get_profile(PROFILE), kind=KIND, prefix_tokens=2000,
                                policy="cost_model", interactive=True)
    assert choice is not None and choice.action == HoldAction.HOLD  # the model alone holds
    _held(holds, "other", 4000, age_s=0.2)  # 4,000 + 2,000 over 30 % of 16,384
    declined = await _prewarm(inf, _opening(prompt_tokens_hint=2000))
    assert declined.finish_reason == PREWARM_DECLINED and _sent(sent) == 0
    # room under the cap, or a cap that turns over slower than the wait: it goes
    assert (await _prewarm(inf, _opening(prompt_tokens_hint=900))).finish_reason \
        != PREWARM_DECLINED
    holds.holds.pop("j1", None)
    _held(holds, "other", 4000, age_s=60.0)
    assert (await _prewarm(inf, _opening(prompt_tokens_hint=2000))).finish_reason \
        != PREWARM_DECLINED
    assert _sent(sent) == 2


async def test_a_job_that_holds_already_keeps_its_place(redis: aioredis.Redis) -> None:
    sent: list[httpx.Request] = []
    _, holds = _worker(redis, sent)
    stats = PauseStats(redis, outage=RedisOutage())
    for _ in range(30):
        await stats.record(PROFILE, KIND, 20.0)
    _held(holds, "j1", 4000, age_s=1.0)
    assert await holds.lasts_the_wait(job_id="j1", profile=get_profile(PROFILE), kind=KIND,
                                      prompt_tokens=4000)
    assert not await holds.lasts_the_wait(job_id="j2", profile=get_profile(PROFILE),
                                          kind=KIND, prompt_tokens=4000)


def test_whether_a_hold_lasts_the_wait() -> None:
    learned = PauseDistribution(samples=(10.0,) * 30, prior_median_s=30, prior_p90_s=120)
    prior = PauseDistribution(prior_median_s=30, prior_p90_s=120)

    def lasts(held: float, prompt: int, *, oldest: float | None = 5.0,
              turnover: float | None = None, wait: PauseDistribution = learned,
              capacity: float = 10_000) -> bool:
        return hold_lasts_the_wait(held, prompt, capacity, 0.3, oldest_age_s=oldest,
                                   turnover_s=turnover, wait=wait)

    assert lasts(1_000, 2_000)  # under the cap (3,000), nothing let go: its TTL ends it
    assert not lasts(1_000, 2_000, turnover=5.0)  # holds go for room at 5 s old
    assert lasts(1_000, 2_000, turnover=12.0)
    assert not lasts(2_000, 2_000)  # over it, beside holds 5 s old: the wait is 10 s
    assert lasts(2_000, 2_000, oldest=10.0)  # the cap turns over no faster than the wait
    assert not lasts(2_000, 2_000, oldest=30.0, turnover=5.0)  # the shorter counts
    assert lasts(2_000, 2_000, wait=prior, turnover=1.0)  # a prior decides nothing
    assert not lasts(0, 4_000, oldest=None)  # over the cap alone: let go at once
    assert lasts(9e9, 2_000, capacity=0)  # an unknown pool
    # the cap's pace: the last hold let go for room, within one such age of it
    assert cap_turnover_s(100.0, 5.0, 104.0) == 5.0 and cap_turnover_s(100.0, 5.0, 106.0) is None


async def test_the_cap_s_turnover_is_the_age_of_the_last_hold_let_go_for_room(
        redis: aioredis.Redis) -> None:
    """Under the cap now, but holds were let go for room at 0.2 s old a moment ago: a
    new hold would go as soon, before a wait of 1 s. Once a turnover's time has passed
    with none let go, the cap no longer counts."""
    sent: list[httpx.Request] = []
    _, holds = _worker(redis, sent)
    clock = [time.time()]
    holds._clock = lambda: clock[0]
    stats = PauseStats(redis, outage=RedisOutage())
    for _ in range(30):
        await stats.record(PROFILE, KIND, 1.0)
    profile = get_profile(PROFILE)
    assert await holds.lasts_the_wait(job_id="j2", profile=profile, kind=KIND,
                                      prompt_tokens=1000)
    _held(holds, "old", 4000, age_s=0.0)
    holds.holds["old"].created = clock[0] - 0.2
    _held(holds, "new", 1000, age_s=0.0)
    holds.holds["new"].created = clock[0]
    await holds._make_room()  # 5,000 over the cap (4,915): the older goes, at 0.2 s
    assert set(holds.holds) == {"new"}
    assert not await holds.lasts_the_wait(job_id="j2", profile=profile, kind=KIND,
                                          prompt_tokens=1000)
    clock[0] += 0.5  # a turnover's time (0.2 s) with none let go since
    assert await holds.lasts_the_wait(job_id="j2", profile=profile, kind=KIND,
                                      prompt_tokens=1000)
