"""Hold or release and pre-warming on the real stack: holds appear in Redis and are
kept by real 1-token touches; an approver opening a pending approval re-prefills the
job's prompt on a real engine; pauses are recorded and shown by `warmloop pauses`."""

from __future__ import annotations

import asyncio
import json
import random
import uuid
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from temporalio.client import Client

from tests.integration.cli import warmloop
from tests.polling import eventually
from warmloop.activities.holds import HOLDS_KEY, hold_stats
from warmloop.activities.registry import EngineRegistry
from warmloop.infra.stack import Stack
from warmloop.workers.approvals import dev_approver
from warmloop.workers.engine_metrics import reset_caches
from warmloop.workers.identity import dev_token
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    JobInput,
    JobState,
    PendingApproval,
)

pytestmark = pytest.mark.integration



def case(n: int) -> dict[str, str]:
    return {"case_id": f"S{n:04d}", "text": "a short synthetic case for the hold tests"}


async def start_held_review(client: Client, settings: Settings, redis: aioredis.Redis,
                            task: dict[str, str]) -> tuple[Any, str, dict[str, int]]:
    """A 4-step review job offered only `escalate`, holding always, started and waited
    for until an engine holds its prompt: (its handle, that engine, the engine's hold
    statistics before the job)."""
    engines = [e.id for e in settings.engine_endpoints]
    before = {e: await hold_stats(redis, e) for e in engines}
    job_id = f"hold-{uuid.uuid4().hex[:6]}"
    handle = await client.start_workflow(
        AgentJob.run,
        JobInput(profile="synthetic-review", task=task, max_steps=4, tools=["escalate"],
                 hold_policy="always_hold"),
        id=job_id, task_queue=AGENT_TASK_QUEUE)

    async def held() -> str | None:
        for e in engines:
            if await redis.hget(HOLDS_KEY.format(e), job_id) is not None:
                return e
        return None

    engine = await eventually(held, attempts=1200)
    return handle, engine, before[engine]


async def test_a_held_prefix_is_touched_while_the_job_waits_and_released_on_resume(
    stack: Stack, client: Client, settings: Settings, redis: aioredis.Redis,
) -> None:
    # A review job offered only `escalate` waits for a reviewer after each step whose call
    # is valid: with always_hold its prefix is held, and touched, for as long as the test
    # waits. The random model's invalid calls are repaired at once (no pause, no hold),
    # and the step cap's own step asks for no hold: four steps leave three that can.
    handle, engine, before = await start_held_review(client, settings, redis, case(1))
    job_id = handle.id

    async def touched() -> dict[str, int] | None:
        now = await hold_stats(redis, engine)
        grew = {k: now.get(k, 0) - before.get(k, 0) for k in now}
        return grew if grew.get("touches", 0) >= 1 else None

    # the first touch comes one churn interval after the step (at most
    # max_touch_interval_s: 3 s in the test session's settings, tests/conftest.py)
    grew = await eventually(touched, attempts=900)
    # a touch finds the prefix cached and computes its one extra token and one output
    assert grew["touch_computed_tokens"] <= 2 * grew["touches"], grew
    raw = await redis.hget(HOLDS_KEY.format(engine), job_id)
    assert raw is not None, "the hold ended while the job was still waiting"
    hold = json.loads(raw)
    assert hold["kind"] == "approval:escalation" and hold["tokens"] > 1024

    async def pending() -> list[PendingApproval] | None:
        return await handle.query(AgentJob.pending_approvals) or None

    p = (await eventually(pending, attempts=1200))[0]
    await dev_approver(settings, "erin").decide(client, job_id, p.approval_id, approve=True)
    # Later steps ask again when the random model's call is valid: approve whatever they
    # ask until the step cap ends the job.
    finished = asyncio.ensure_future(handle.result())

    async def approve_until_done() -> bool:
        if finished.done():
            return True
        for q in await handle.query(AgentJob.pending_approvals):
            await dev_approver(settings, "erin").decide(client, job_id, q.approval_id, approve=True)
        return False

    await eventually(approve_until_done, attempts=2400)
    res = finished.result()
    assert res.state == JobState.LOOP_CAP and len(res.steps) == 4

    # The worker counts a resume at its next tick, off the step's path (after any touches
    # due then): when the resumed step is the job's last, the job can end first.
    async def released_on_resume() -> int:
        after = await hold_stats(redis, engine)
        return after.get("released_on_resume", 0) - before.get("released_on_resume", 0)

    await eventually(released_on_resume, attempts=600)
    # the step after the held wait found its prefix warm (steps count from 1)
    assert res.steps[p.step - 1].valid and res.steps[p.step].cached_tokens >= 1024


async def test_a_hold_whose_job_is_cancelled_while_it_waits_ends_with_the_job(
    stack: Stack, client: Client, settings: Settings, redis: aioredis.Redis,
) -> None:
    # A review job waits for a reviewer with its prompt held (always_hold: 10 minutes).
    # Cancelled while it waits, it sends no step to resume the hold: the engine's worker
    # asks Temporal (every job_check_s, 5 s) and lets the hold go when the job has ended.
    handle, engine, before = await start_held_review(client, settings, redis, case(3))
    job_id = handle.id

    async def pending() -> list[PendingApproval] | None:
        return await handle.query(AgentJob.pending_approvals) or None

    await eventually(pending, attempts=1200)
    await handle.cancel()
    res = await handle.result()
    assert res.state == JobState.CANCELLED, res.reason

    async def let_go() -> bool:
        return await redis.hget(HOLDS_KEY.format(engine), job_id) is None

    # job_check_s (5 s) and a tick: well inside 30 s; the TTL is 600 s
    await eventually(let_go, attempts=600)

    # the check's task counts the release after it drops the hold, and a tick may
    # publish the table between the two
    async def counted() -> int:
        after = await hold_stats(redis, engine)
        return after.get("released_job_over", 0) - before.get("released_job_over", 0)

    await eventually(counted, attempts=200)


async def test_opening_a_pending_approval_prewarms_the_prompt_on_an_engine(
    stack: Stack, client: Client, settings: Settings, redis: aioredis.Redis,
) -> None:
    # Offered only `escalate`, a review job asks a reviewer at every step whose call is
    # valid (the random model's invalid calls are repaired without asking).
    job_id = f"prewarm-{uuid.uuid4().hex[:6]}"
    handle = await client.start_workflow(
        AgentJob.run,
        JobInput(profile="synthetic-review", task=case(2), max_steps=6, tools=["escalate"],
                 hold_policy="never"),
        id=job_id, task_queue=AGENT_TASK_QUEUE)

    async def pending() -> list[PendingApproval] | None:
        p = await handle.query(AgentJob.pending_approvals)
        if not p:
            desc = await handle.describe()
            assert desc.status is not None and desc.status.name == "RUNNING", \
                "the job ended before it asked for approval"
        return p or None

    approval = (await eventually(pending, attempts=2400))[0]
    assert approval.step < 6  # so a step after the decision will find the prompt warm
    # Flush every engine's cache: without a prewarm the next step would start cold. And
    # wait for the directory to know it (reset_caches): routed on a directory that still
    # listed the other engine's blocks from before the flush, the step went there and
    # found nothing (a CI run).
    async with httpx.AsyncClient() as http:
        await reset_caches(http, [e.url for e in settings.engine_endpoints], redis,
                           [e.id for e in settings.engine_endpoints])

    async def no_queue() -> bool:
        out = warmloop("engines", "--json")
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        return bool(rows) and all(row["waiting"] == 0 for row in rows)

    # A prewarm goes only to an engine that reports no queue (holding.prewarm_worthwhile):
    # let other tests' leftover requests drain first.
    await eventually(no_queue, attempts=120)
    out = warmloop("view", job_id, token=dev_token(settings, "erin"))
    assert out.returncode == 0, out.stderr
    assert approval.approval_id in out.stdout

    async def prewarmed() -> bool:
        h = await client.get_workflow_handle(job_id).fetch_history()
        return any(e.activity_task_completed_event_attributes.result.payloads
                   for e in h.events if e.HasField("activity_task_completed_event_attributes")
                   and _scheduled_type(h, e) == "prewarm")

    await eventually(prewarmed, attempts=600)
    await dev_approver(settings, "erin").decide(client, job_id, approval.approval_id, approve=True)
    # later steps escalate again: approve whatever the job asks until its step cap
    finished = asyncio.ensure_future(handle.result())

    async def approve_until_done() -> bool:
        if finished.done():
            return True
        for p in await handle.query(AgentJob.pending_approvals):
            await dev_approver(settings, "erin").decide(client, job_id, p.approval_id, approve=True)
        return False

    await eventually(approve_until_done, attempts=2400)
    res = finished.result()
    after = next(s for s in res.steps if s.step == approval.step + 1)
    # the step after the decision found the prefix the prewarm computed
    assert after.cached_tokens >= 1024, after
    rec = next(a for a in res.approvals if a.approval.approval_id == approval.approval_id)
    assert rec.outcome == "approved"
    out = warmloop("pauses")
    assert out.returncode == 0, out.stderr
    assert "synthetic-review" in out.stdout and "approval:escalation" in out.stdout
    assert "tool:escalate" in out.stdout
    # the decision's pre-warm ran beside the approved tool (scheduled before the pre-warm
    # was done), and the next step waited for it (PATCH_DECISION_BESIDE_TOOL)
    orders = _after_decisions(await handle.fetch_history())
    # ... but not after a decision on the step cap's step: no step follows it
    # (PATCH_NO_PREWARM_AT_END)
    capped = res.approvals[-1].approval.step >= 6
    warmed = orders[:-1] if capped else orders
    assert warmed and all(o[:2] == ["run_tool", "prewarm done"] for o in warmed), orders
    assert all(o[2:] in ([], ["generate"]) for o in warmed), orders
    assert not capped or orders[-1] == ["run_tool"], orders


async def test_an_opening_prewarms_under_the_jobs_policy_and_its_wait_is_recorded(
    stack: Stack, client: Client, settings: Settings, redis: aioredis.Redis,
) -> None:
    """Under the cost model an approval's opening pre-warms the prompt and holds it
    through the wait from opening to decision (``approval:<kind>:viewed``), priced by the
    hold model rather than held as always_hold; the decision records that wait. (On an
    idle fleet holding is nearly free, so it holds; where it does not pay the pre-warm
    is not sent: ``tests/unit/test_prewarm_on_opening.py``.)"""
    job_id = f"opened-{uuid.uuid4().hex[:6]}"
    handle = await client.start_workflow(
        AgentJob.run,
        JobInput(profile="synthetic-review", task=case(4), max_steps=4, tools=["escalate"]),
        id=job_id, task_queue=AGENT_TASK_QUEUE)

    async def pending() -> list[PendingApproval] | None:
        return await handle.query(AgentJob.pending_approvals) or None

    approval = (await eventually(pending, attempts=2400))[0]
    engines = [e.id for e in settings.engine_endpoints]

    async def no_queue() -> bool:
        out = warmloop("engines", "--json")
        rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
        return bool(rows) and all(row["waiting"] == 0 for row in rows)

    await eventually(no_queue, attempts=120)  # a prewarm goes only to an idle engine
    out = warmloop("view", job_id, token=dev_token(settings, "erin"))
    assert out.returncode == 0, out.stderr

    async def held_to_decision() -> dict[str, Any] | None:
        for e in engines:
            raw = await redis.hget(HOLDS_KEY.format(e), job_id)
            if raw is not None and json.loads(raw)["kind"] == "approval:escalation:viewed":
                return dict(json.loads(raw))
        return None

    hold = await eventually(held_to_decision, attempts=600)
    assert hold["tokens"] > 1024  # the review prompt, pre-warmed and held
    await dev_approver(settings, "erin").decide(client, job_id, approval.approval_id,
                                                approve=True)

    async def wait_recorded() -> bool:
        out = warmloop("pauses")
        return "approval:escalation:viewed" in out.stdout

    await eventually(wait_recorded, attempts=600)
    await handle.cancel()
    res = await handle.result()
    assert res.state in (JobState.CANCELLED, JobState.LOOP_CAP), res.reason


def _after_decisions(history: Any) -> list[list[str]]:
    """After each approval's decision (its update completed): the order in which the
    approved tool was scheduled, the decision's pre-warm finished and the next step was
    scheduled (what of those came before the next decision)."""
    orders: list[list[str]] = []
    names: dict[int, str] = {}
    for e in history.events:
        if e.HasField("workflow_execution_update_completed_event_attributes"):
            orders.append([])
        elif e.HasField("activity_task_scheduled_event_attributes"):
            name = str(e.activity_task_scheduled_event_attributes.activity_type.name)
            names[e.event_id] = name
            if orders and name in ("run_tool", "generate") and name not in orders[-1]:
                orders[-1].append(name)
        elif e.HasField("activity_task_completed_event_attributes") and orders:
            done = names.get(e.activity_task_completed_event_attributes.scheduled_event_id)
            if done == "prewarm" and "prewarm done" not in orders[-1]:
                orders[-1].append("prewarm done")
    return orders


def _scheduled_type(history: Any, completed: Any) -> str:
    sched_id = completed.activity_task_completed_event_attributes.scheduled_event_id
    for e in history.events:
        if e.event_id == sched_id:
            return str(e.activity_task_scheduled_event_attributes.activity_type.name)
    return ""


async def test_engines_report_batch_admission_and_holds(stack: Stack) -> None:
    out = warmloop("engines", "--json")
    assert out.returncode == 0, out.stderr
    rows = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    assert rows and all(r["batch_limit"] >= 1 for r in rows)
    assert all("held_tokens" in r and "holds" in r for r in rows)


async def test_a_block_the_engine_evicts_and_computes_again_is_counted_as_regret(
    stack: Stack, settings: Settings, redis: aioredis.Redis,
) -> None:
    # The hold model's rent is what room is worth: blocks the engine evicted and then
    # computed again, read from its real KV events by the inference worker. A prompt,
    # then fresh prompts enough to turn the whole pool over, then the prompt again: its
    # blocks come back as regret in the engine's hold statistics.
    hb = next(h for h in await EngineRegistry(redis, ttl_s=settings.engine_ttl_s).live()
              if h.engine_id == settings.engine_endpoints[0].id)
    engine = next(e for e in settings.engine_endpoints if e.id == hb.engine_id)
    assert engine.kv_events, "the test stack's engines publish KV events"
    rng = random.Random(7)
    # pieces of 2,048 tokens: turning the pool over costs the same tokens in any size,
    # and a CPU engine's attention makes 8,192-token prompts ~3x dearer a token (73 s
    # against 27 s for this test)
    piece = min(2_048, settings.engine_max_model_len // 2) // hb.block_size * hb.block_size

    def fresh() -> list[int]:
        # ids every model here has (the embedded tiny model's vocabulary is 3,737)
        return [rng.randrange(100, 3_000) for _ in range(piece)]

    url = engine.url.rstrip("/") + "/v1/completions"
    before = (await hold_stats(redis, engine.id)).get("regretted_blocks", 0)
    prompt = fresh()
    async with httpx.AsyncClient(timeout=120.0) as http:
        async def send(tokens: list[int]) -> None:
            r = await http.post(url, json={"model": engine.model, "prompt": tokens,
                                           "max_tokens": 1})
            assert r.status_code == 200, r.text
        await send(prompt)
        for _ in range(hb.kv_capacity_tokens // piece + 2):
            await send(fresh())
        await send(prompt)

    async def regretted() -> int | None:
        got = (await hold_stats(redis, engine.id)).get("regretted_blocks", 0) - before
        return got if got >= piece // hb.block_size // 2 else None

    # most of the prompt's blocks (its first ones may outlive the churn elsewhere)
    assert await eventually(regretted, attempts=300, interval_s=0.1)
