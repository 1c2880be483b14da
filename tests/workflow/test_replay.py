"""Replay: AgentJob's code must reproduce the commands of recorded histories.

A change that breaks determinism (reordered activities, a new timer, a non-pure
call) fails here. Recorded histories live in histories/; after an intended,
versioned change, re-record with WARMLOOP_RECORD_HISTORIES=1.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from tests.approvers import Approvers
from tests.polling import eventually
from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import TICKET, run_job, workers
from tests.workflow.test_batch_run import (
    ONE_SLOT,
    MemoryS3,
    SlotGate,
    batch_workers,
    hanging_fakes,
    run_batch,
    start_until_two_hang,
    write_records,
)
from warmloop.workers.identity import install_verify_keys
from warmloop.workers.temporal_plugin import sandbox_runner
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.batch_run import BatchInput, BatchRun
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    ApprovalViewed,
    GenerateRequest,
    GenerateResult,
    JobInput,
)
from warmloop.workflows.timer_probe import TimerProbe

HISTORIES = Path(__file__).parent / "histories"
RECORDED_IDS = {"batch_run_with_bad_line": "replay-batch",
                "batch_run_fleet_window": "replay-batch-window",
                "agent_job_tenant_quota_wait": "acme/quota-replay",
                "batch_run_tenant": "acme/replay-batch-tenant",
                "batch_run_outside_tenant": "acme/replay-batch-outside",
                "batch_run_cancelled": "replay-batch-cancelled",
                "batch_run_cancelled_before_patch": "replay-batch-cancelled-old",
                "batch_run_job_slots": "acme/replay-batch-slots",
                "batch_run_resumed_skipping": "replay-batch-resumed",
                "batch_run_cancelled_all_started": "replay-batch-cancelled-all",
                "batch_run_cancelled_rerun": "replay-batch-cancelled-rerun",
                "batch_run_recovering_page": "replay-batch-terminated-from-L1"}
"""Workflow ids of recorded histories whose commands depend on the id (child job ids)."""


INVOICE = {"invoice_id": "INV1001", "vendor_id": "V001", "po_number": "PO1001"}


def _script(req: GenerateRequest) -> GenerateResult:
    # valid call, invalid call (repair path), tool call, finish
    return {
        1: reply("lookup_customer", '{"customer_id": "C100"}'),
        2: reply("search_kb", '{"topic": "nope"}'),
        3: reply("search_kb", '{"topic": "crash"}'),
    }.get(req.step, reply("finish", '{"resolution": "resolved", "priority": "high"}'))


def _replayer() -> Replayer:
    return Replayer(workflows=[AgentJob, BatchRun, TimerProbe],
                    data_converter=pydantic_data_converter, workflow_runner=sandbox_runner())


def _record(name: str, history: WorkflowHistory) -> None:
    if os.environ.get("WARMLOOP_RECORD_HISTORIES"):
        HISTORIES.mkdir(exist_ok=True)
        (HISTORIES / name).write_text(history.to_json())


async def test_a_fresh_history_replays(time_skipping_env: WorkflowEnvironment) -> None:
    fakes = FakeActivities(_script)
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=6)
        history = await client.get_workflow_handle(res.job_id).fetch_history()
    assert len(res.steps) == 4
    await _replayer().replay_workflow(history)
    _record("agent_job_routed_with_repair.json", history)


async def test_a_fresh_history_with_an_approval_and_prewarm_replays(
    time_skipping_env: WorkflowEnvironment, approvers: Approvers,
) -> None:
    script = iter([reply("set_priority", '{"priority": "urgent"}'),
                   reply("finish", '{"resolution": "escalated", "priority": "urgent"}')])
    fakes = FakeActivities(lambda req: next(script))
    async with workers(time_skipping_env, fakes) as client:
        handle = await client.start_workflow(
            AgentJob.run, JobInput(profile="ticket-triage", task=TICKET, max_steps=4),
            id="replay-approval", task_queue=AGENT_TASK_QUEUE)
        for _ in range(200):
            if await handle.query(AgentJob.pending_approvals):
                break
            await asyncio.sleep(0.05)
        await handle.signal(AgentJob.viewed, ApprovalViewed(approval_id="urgent_priority-1"))
        approvers.now = await time_skipping_env.get_current_time()
        await handle.execute_update(AgentJob.decide, approvers.decision(
            "alice", ("team-lead",), job_id=handle.id, approval_id="urgent_priority-1"))
        await handle.result()
        history = await handle.fetch_history()
    # viewed, then decided: a prewarm for each (one if both land in one workflow task),
    # and the human's pause was recorded, and the wait from the opening to the decision
    assert 1 <= len(fakes.prewarms) <= 2 and [p.kind for p in fakes.pauses] == [
        "approval:urgent_priority", "approval:urgent_priority:viewed"]
    viewed = [p for p in fakes.prewarms if p.pause_kind]
    # the opening's pre-warm goes under the job's own policy, through the wait from
    # opening to decision, priced at the last step's prompt; the decision's holds nothing
    assert all(p.pause_kind == "approval:urgent_priority:viewed"
               and p.hold_policy == "cost_model" and p.prompt_tokens_hint == 1000
               for p in viewed)
    assert all(p.hold_policy == "never" and p.prompt_tokens_hint is None
               for p in fakes.prewarms if not p.pause_kind)
    await _replayer().replay_workflow(history)
    # the decision's records and pre-warm beside the approved tool; before that patch:
    # agent_job_approval_prewarm.json
    _record("agent_job_approval_prewarm_beside_tool.json", history)


async def test_a_fresh_two_person_approval_history_replays(
    time_skipping_env: WorkflowEnvironment, approvers: Approvers,
) -> None:
    """Two signed approvals of one payment (the first leaves it waiting), then a
    signed rejection of the next: the history replays without the validator (which
    Temporal does not run on replay) and without the worker's keys."""
    script = iter([reply("approve_payment", '{"invoice_id": "INV1001", "amount": 60000}'),
                   reply("approve_payment", '{"invoice_id": "INV1001", "amount": 7000}'),
                   reply("finish", '{"outcome": "needs_review", "summary": "split"}')])
    fakes = FakeActivities(lambda req: next(script))
    async with workers(time_skipping_env, fakes) as client:
        handle = await client.start_workflow(
            AgentJob.run, JobInput(profile="invoice-reconciliation", task=INVOICE,
                                   submitted_by="erin"),
            id="replay-two-person", task_queue=AGENT_TASK_QUEUE)
        for person in ["bob", "carol"]:
            await eventually(lambda: _pending(handle, "large_payment-1"))
            approvers.now = await time_skipping_env.get_current_time()
            await handle.execute_update(AgentJob.decide, approvers.decision(
                person, ("finance-lead",), job_id=handle.id, approval_id="large_payment-1"))
        await eventually(lambda: _pending(handle, "large_payment-2"))
        approvers.now = await time_skipping_env.get_current_time()
        await handle.execute_update(AgentJob.decide, approvers.decision(
            "bob", ("finance-lead",), job_id=handle.id, approval_id="large_payment-2",
            approve=False, comment="split it <please>"))
        res = await handle.result()
        history = await handle.fetch_history()
    assert [(a.outcome, a.decided_by) for a in res.approvals] == [
        ("approved", "bob, carol"), ("rejected", "bob")]
    install_verify_keys([])  # replay must not need them
    await _replayer().replay_workflow(history)
    _record("agent_job_two_person_approval.json", history)


async def _pending(handle: Any, approval_id: str) -> bool | None:
    ids = [p.approval_id for p in await handle.query(AgentJob.pending_approvals)]
    return True if approval_id in ids else None


async def test_a_fresh_batch_history_replays(time_skipping_env: WorkflowEnvironment,
                                             tmp_path: Path) -> None:
    src = tmp_path / "tickets.jsonl"
    write_records(src, 4, {3: "{not json"})
    kept: list[WorkflowHistory] = []
    res, _, _ = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=2, page_size=10),
        keep_history=kept, batch_id=RECORDED_IDS["batch_run_with_bad_line"])
    assert res.records == 5
    await _replayer().replay_workflow(kept[0])
    _record("batch_run_with_bad_line.json", kept[0])


async def test_a_fresh_batch_history_that_asked_the_fleet_replays(
        time_skipping_env: WorkflowEnvironment, tmp_path: Path) -> None:
    src = tmp_path / "tickets.jsonl"
    write_records(src, 4, {})
    kept: list[WorkflowHistory] = []
    res, _, fakes = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), page_size=10),
        keep_history=kept, batch_id=RECORDED_IDS["batch_run_fleet_window"])
    assert res.records == 4 and len(fakes.window_asks) == 1
    await _replayer().replay_workflow(kept[0])
    _record("batch_run_fleet_window.json", kept[0])


@pytest.mark.parametrize(("name", "tenant", "state"), [
    ("batch_run_tenant", "acme", "COMPLETED"),
    ("batch_run_outside_tenant", "globex", "INVALID_INPUT")])
async def test_a_fresh_tenant_batch_history_replays(
        time_skipping_env: WorkflowEnvironment, tmp_path: Path, name: str, tenant: str,
        state: str) -> None:
    """A tenant's batch (its jobs the tenant's, tagged), and one whose id is another
    tenant's (ended before it reads anything: the ``batch-tenants`` patch)."""
    src = tmp_path / "tickets.jsonl"
    write_records(src, 2, {})
    kept: list[WorkflowHistory] = []
    res, _, _ = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=2, page_size=10, tenant=tenant),
        keep_history=kept, batch_id=RECORDED_IDS[name])
    assert res.state == state
    await _replayer().replay_workflow(kept[0])
    _record(f"{name}.json", kept[0])


async def test_a_fresh_batch_history_that_waited_for_job_slots_replays(
        time_skipping_env: WorkflowEnvironment, tmp_path: Path) -> None:
    """A batch whose tenant has a quota on the workers: a claim before each job, the
    first refused twice (the ``batch-job-slots`` patch)."""
    src = tmp_path / "tickets.jsonl"
    write_records(src, 2, {})
    kept: list[WorkflowHistory] = []
    res, _, _ = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=2, page_size=10, tenant="acme"),
        keep_history=kept, batch_id=RECORDED_IDS["batch_run_job_slots"],
        slots=SlotGate(refuse=2), quotas=ONE_SLOT)
    assert (res.state, res.done) == ("COMPLETED", 2)
    await _replayer().replay_workflow(kept[0])
    _record("batch_run_job_slots.json", kept[0])


async def test_a_fresh_resumed_batch_history_replays(
        time_skipping_env: WorkflowEnvironment, tmp_path: Path) -> None:
    """A resumed batch that skips lines with outcomes (``skip_lines``, as ``resume``
    sets them between the stopped jobs' lines)."""
    src = tmp_path / "tickets.jsonl"
    write_records(src, 4, {})
    kept: list[WorkflowHistory] = []
    res, _, fakes = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=2, page_size=10, skip_lines=[2, 3]),
        keep_history=kept, batch_id=RECORDED_IDS["batch_run_resumed_skipping"])
    assert (res.state, res.done) == ("COMPLETED", 2)
    assert {r.job_id for r in fakes.generate_requests} == {
        "replay-batch-resumed-L1", "replay-batch-resumed-L4"}
    await _replayer().replay_workflow(kept[0])
    _record("batch_run_resumed_skipping.json", kept[0])


@pytest.mark.parametrize(("name", "records"), [("batch_run_cancelled_rerun", 4),
                                               ("batch_run_cancelled_all_started", 2)])
async def test_a_fresh_cancelled_batch_history_replays(
        dev_server_env: WorkflowEnvironment, tmp_path: Path, name: str, records: int) -> None:
    """Cancelled with two jobs running: they are cancelled and waited for, the page's
    outcomes written, the batch ends CANCELLED naming them to run again (the
    ``batch-cancel`` patch), also when every record had started (2 records: the jobs
    awaited without a gather the cancel would reach first, ``batch-rerun-stopped``).
    ``batch_run_cancelled.json`` is the first case recorded before that patch."""
    src = tmp_path / "tickets.jsonl"
    write_records(src, records, {})
    fakes = hanging_fakes()
    bid = RECORDED_IDS[name]
    async with batch_workers(dev_server_env, fakes, MemoryS3()) as client:
        handle = await start_until_two_hang(client, fakes, src, bid)
        await handle.cancel()
        res = await handle.result()
        assert (res.state, res.rerun_lines) == ("CANCELLED", [1, 2])
        history = await handle.fetch_history()
    await _replayer().replay_workflow(history)
    _record(f"{name}.json", history)


async def test_a_fresh_batch_history_that_recovers_a_page_replays(
        dev_server_env: WorkflowEnvironment, tmp_path: Path) -> None:
    """A batch resuming a terminated one: it writes the page the old batch never wrote
    (``write_recovered_page``, the ``batch-recover-page`` patch), then runs the jobs the
    termination stopped."""
    from warmloop.workers.jobs import resumed_batch

    src = tmp_path / "tickets.jsonl"
    write_records(src, 2, {})
    fakes = hanging_fakes()
    old = "replay-batch-terminated"
    fakes.only = f"{old}-L"
    async with batch_workers(dev_server_env, fakes, MemoryS3()) as client:
        stopped = await start_until_two_hang(client, fakes, src, old)
        await stopped.terminate("operator stopped it")
        inp, _, new = await resumed_batch(client, old)
        assert inp.recover is not None and new == RECORDED_IDS["batch_run_recovering_page"]
        handle = await client.start_workflow(BatchRun.run, inp, id=new,
                                             task_queue=AGENT_TASK_QUEUE)
        res = await handle.result()
        history = await handle.fetch_history()
    assert (res.state, res.done) == ("COMPLETED", 2)
    await _replayer().replay_workflow(history)
    _record("batch_run_recovering_page.json", history)


async def test_a_fresh_replayed_trace_history_replays(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    from tests.workflow.test_trace_replay import triage_job

    fakes = FakeActivities(lambda req: reply("search_kb", '{"topic": "crash"}'))
    async with workers(time_skipping_env, fakes) as client:
        # short pauses: a skip past a still-waiting workflow's deadline stalls the shared
        # test server (see test_trace_replay)
        handle = await client.start_workflow(AgentJob.run, triage_job(pauses=(2, 5)),
                                             id="replay-trace",
                                             task_queue=AGENT_TASK_QUEUE)
        res = await handle.result()
        history = await handle.fetch_history()
    assert res.state.value == "FINISHED" and len(res.steps) == 3
    # the recorded pauses are recorded as pause statistics too (a local activity beside
    # each timer); agent_job_replayed_trace.json is a replay from before they were
    assert [(p.kind, p.seconds) for p in fakes.pauses] == [
        ("tool:lookup_customer", 2.0), ("approval:urgent_priority", 5.0)]
    await _replayer().replay_workflow(history)
    _record("agent_job_replayed_trace_pauses.json", history)


@pytest.mark.parametrize("path", sorted(HISTORIES.glob("*.json")), ids=lambda p: p.stem)
async def test_recorded_histories_replay(path: Path) -> None:
    history = WorkflowHistory.from_json(RECORDED_IDS.get(path.stem, "recorded"),
                                        await asyncio.to_thread(path.read_text))
    await _replayer().replay_workflow(history)


def test_there_are_recorded_histories() -> None:
    assert list(HISTORIES.glob("*.json")), "record one with WARMLOOP_RECORD_HISTORIES=1"


# ---- the paths a fault takes (issue 14): each recorded, so a change to a profile, a
# price or a retry policy that alters their commands fails here unless patched ----------


class _GapOnce(FakeActivities):
    """The transcript store loses the job's messages once (an in-memory S3 restarted)."""

    lost = False

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if not self.lost and req.base_len > 0:
            self.lost = True
            self.transcripts[req.job_id] = []
            raise ApplicationError("messages lost", type="TranscriptGap", non_retryable=True)
        return await super().generate(req)


SECTION_TIMEOUT_S = 120.0
"""One fault path below takes about a second; one still waiting after this has hung (a CI
run once sat nine minutes in this test with no output): fail at the await it hung on."""


async def test_fresh_fault_path_histories_replay(time_skipping_env: WorkflowEnvironment,
                                                 dev_server_env: WorkflowEnvironment) -> None:
    search = reply("search_kb", '{"topic": "crash"}')
    recorded: dict[str, WorkflowHistory] = {}

    # failover: the routed engine has no worker and no heartbeat
    fakes = FakeActivities(lambda req: search, engines=["fake0", "fake1"])
    fakes.forced_routes = ["fake0"]
    async with (asyncio.timeout(SECTION_TIMEOUT_S),
                workers(time_skipping_env, fakes, serving=["fake1"]) as client):
        res = await run_job(client, max_steps=2, step_pickup_timeout_s=2)
        recorded["agent_job_failover.json"] = await client.get_workflow_handle(
            res.job_id).fetch_history()
    assert fakes.served_by == ["fake1", "fake1"] and fakes.alive_asked == ["fake0"]

    # transcript gap: the whole transcript is sent again
    gap = _GapOnce(lambda req: search)
    async with (asyncio.timeout(SECTION_TIMEOUT_S),
                workers(time_skipping_env, gap) as client):
        res = await run_job(client, max_steps=3)
        recorded["agent_job_transcript_gap.json"] = await client.get_workflow_handle(
            res.job_id).fetch_history()
    assert gap.lost and len(res.steps) == 3

    # continue-as-new: the last run, which resumed from the carry
    can = FakeActivities(lambda req: search)
    async with (asyncio.timeout(SECTION_TIMEOUT_S),
                workers(time_skipping_env, can) as client):
        res = await run_job(client, max_steps=5, continue_as_new_after_steps=2)
        recorded["agent_job_continue_as_new.json"] = await client.get_workflow_handle(
            res.job_id).fetch_history()
    assert res.runs == 3

    # escalation: no decision by the deadline, escalated, then auto-rejected
    urgent = iter([reply("set_priority", '{"priority": "urgent"}')])
    esc = FakeActivities(lambda req: next(urgent, reply(
        "finish", '{"resolution": "escalated", "priority": "high"}')))
    async with (asyncio.timeout(SECTION_TIMEOUT_S),
                workers(time_skipping_env, esc) as client):
        res = await run_job(client, max_steps=4)
        recorded["agent_job_escalation.json"] = await client.get_workflow_handle(
            res.job_id).fetch_history()
    assert res.approvals and res.approvals[0].approval.escalated

    # cancel during a model step (a real server: see test_cancel_during_step)
    cancel = FakeActivities(lambda req: search)
    cancel.hang["generate"] = 2
    async with (asyncio.timeout(SECTION_TIMEOUT_S),
                workers(dev_server_env, cancel) as client):
        handle = await client.start_workflow(
            AgentJob.run, JobInput(profile="ticket-triage", task=TICKET, max_steps=4),
            id=f"replay-cancel-{uuid.uuid4().hex[:6]}", task_queue=AGENT_TASK_QUEUE)
        await asyncio.wait_for(cancel.hanging.wait(), timeout=30)
        await handle.cancel()
        res = await handle.result()
        recorded["agent_job_cancel_during_step.json"] = await handle.fetch_history()
    assert res.state.value == "CANCELLED"

    for name, history in recorded.items():
        await _replayer().replay_workflow(history)
        _record(name, history)
