"""A step's hold decision advises later steps, so the inference worker makes it after
the step has returned (off its path); its directory records are written before it
returns, since a step the workflow answers itself (load_tools) is routed at once. What
that must not break: the hold is still made, a hold decided late is not made for a job
that has moved on, and a worker's shutdown waits for it (real Redis, fake engine)."""

from __future__ import annotations

import asyncio
from typing import Any

import redis.asyncio as aioredis

from tests.polling import eventually
from tests.unit.engine_fakes import generate, redis_backed_inference, step_request
from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.holds import HoldManager
from warmloop.activities.registry import INFLIGHT_KEY


def wired(redis: aioredis.Redis) -> tuple[Any, PrefixDirectory, HoldManager, list[int],
                                          asyncio.Event]:
    inf, holds = redis_backed_inference(redis)
    held_after: list[int] = []  # the steps whose hold decision reached the hold manager
    decide = holds.after_step

    async def after_step(**kw: Any) -> Any:
        held_after.append(1)
        return await decide(**kw)

    holds.after_step = after_step  # type: ignore[method-assign]
    # the hold decision waits for ``gate``: it is still under way while the test looks
    gate = asyncio.Event()
    hold_or_release = inf._hold_or_release

    async def gated(*args: Any, **kw: Any) -> None:
        await gate.wait()
        await hold_or_release(*args, **kw)

    inf._hold_or_release = gated  # type: ignore[method-assign]
    assert inf._dir is not None
    return inf, inf._dir, holds, held_after, gate


async def test_a_step_returns_before_its_hold_is_decided(redis: aioredis.Redis) -> None:
    inf, directory, holds, _, gate = wired(redis)
    result = await generate(inf, step_request(job_id="jb1", hold_policy="always_hold"),
                            drain=False)
    assert result.tool_calls and result.cached_tokens == 256
    # the directory knows the prompt (a next step routed at once finds it) ...
    known = await directory.job_chain("jb1")
    assert known is not None and known[1] == "e0"
    # ... and the hold is decided after the step returned
    assert "jb1" not in holds.holds
    gate.set()
    assert await inf.drain() == 0
    assert "jb1" in holds.holds


async def test_no_hold_is_made_for_a_step_whose_job_has_moved_on(
        redis: aioredis.Redis) -> None:
    inf, _, holds, held_after, gate = wired(redis)
    await generate(inf, step_request(step=1, job_id="jb2", hold_policy="always_hold"),
                   drain=False)
    # the job's next step arrives while step 1's hold decision is still under way
    await generate(inf, step_request(step=2, job_id="jb2", hold_policy="always_hold"),
                   drain=False)
    gate.set()
    assert await inf.drain() == 0
    # one hold decision, step 2's: step 1's would hold blocks for a pause already over
    assert len(held_after) == 1
    assert "jb2" in holds.holds


async def test_a_shutdown_cancels_bookkeeping_that_outlives_its_bound(
        redis: aioredis.Redis) -> None:
    inf, _, holds, held_after, _ = wired(redis)
    await generate(inf, step_request(job_id="jb3", hold_policy="always_hold"), drain=False)
    assert await inf.drain(timeout_s=0.2) == 1  # the gate never opens: cancelled
    assert held_after == [] and "jb3" not in holds.holds
    assert await inf.drain() == 0  # nothing left behind


# ---- a step routed ahead is counted in flight by its worker -----------------------------


async def in_flight(redis: aioredis.Redis) -> list[str]:
    return [k.decode() if isinstance(k, bytes) else str(k)
            for k in await redis.zrange(INFLIGHT_KEY.format("e0"), 0, -1)]


async def test_a_step_routed_ahead_counts_as_load_while_it_runs(
        redis: aioredis.Redis) -> None:
    inf, _ = redis_backed_inference(redis)
    # the prompt's assembly waits for ``gate``: the step is under way while the test looks
    gate = asyncio.Event()
    body = inf._body

    async def gated(req: Any) -> Any:
        await gate.wait()
        return await body(req)

    inf._body = gated  # type: ignore[method-assign]
    running = asyncio.ensure_future(generate(inf, step_request(job_id="ja1",
                                                               mark_in_flight=True)))
    counted = await eventually(lambda: in_flight(redis))
    assert counted == ["ja1:1|ticket-triage"]
    gate.set()
    await running
    assert await in_flight(redis) == []


async def test_a_slow_in_flight_write_does_not_outlive_its_step(
        redis: aioredis.Redis) -> None:
    inf, _ = redis_backed_inference(redis)
    assert inf._registry is not None
    routed = inf._registry.step_routed
    release, written = asyncio.Event(), asyncio.Event()

    async def slow(*args: Any, **kw: Any) -> None:
        await release.wait()  # the write lands after the engine has answered
        await routed(*args, **kw)
        written.set()

    inf._registry.step_routed = slow  # type: ignore[method-assign]
    step_done = inf._step_done

    async def done_after_release(*args: Any, **kw: Any) -> None:
        release.set()  # the engine has answered: the step is being taken off the set
        await step_done(*args, **kw)

    inf._step_done = done_after_release  # type: ignore[method-assign]
    await generate(inf, step_request(job_id="ja2", mark_in_flight=True))
    await asyncio.wait_for(written.wait(), 5)
    # the removal waited for the write: the finished step is not left counted as load
    assert await in_flight(redis) == []


async def test_a_step_routed_at_once_is_taken_off_the_set_its_route_put_it_in(
        redis: aioredis.Redis) -> None:
    inf, _ = redis_backed_inference(redis)
    assert inf._registry is not None
    await inf._registry.step_routed("e0", "ja3:1|ticket-triage")  # route_step's record
    await generate(inf, step_request(job_id="ja3"))
    assert await in_flight(redis) == []
