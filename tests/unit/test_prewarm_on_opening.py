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
from warmloop.activities.holds import HoldManager
from warmloop.activities.pauses import PauseStats, prior_for
from warmloop.activities.registry import EngineHeartbeat, RedisOutage
from warmloop.workflows.contracts import GenerateRequest, GenerateResult
from warmloop.workflows.holding import (
    PREWARM_DECLINED,
    VIEWED_PRIOR_S,
    HoldAction,
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
    warmed = await _prewarm(inf, _opening())
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
