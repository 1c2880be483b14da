"""An approval's decision warms the prompt beside the approved tool, not ahead of it.

The decision's pre-warm prefills the whole prompt on the engine the next step will use.
Awaited before the tool (as before ``PATCH_DECISION_BESIDE_TOOL``), that prefill and the
pause statistics' two local activities sat between the human's decision and the tool's
start; now they run while the tool does, and the next model step waits for them, so it
still finds the prompt warm. Where no step follows the decision (it ends the job, or the
job ends after the approved call), nothing is pre-warmed (``PATCH_NO_PREWARM_AT_END``)."""

from __future__ import annotations

import asyncio
import dataclasses
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import WorkflowHistory
from temporalio.testing import WorkflowEnvironment

from tests.approvers import Approvers
from tests.polling import eventually
from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import TICKET, workers
from tests.workflow.test_replay import _record, _replayer
from tests.workflow.test_route_ahead import _patches
from warmloop.workflows.agent_job import (
    PATCH_DECISION_BESIDE_TOOL,
    PATCH_NO_PREWARM_AT_END,
    AgentJob,
)
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    ApprovalViewed,
    FunctionCall,
    GenerateRequest,
    GenerateResult,
    JobInput,
    JobResult,
    JobState,
    ReplayScript,
    ReplayStep,
    ToolCall,
    ToolRequest,
    ToolResult,
)
from warmloop.workflows.profiles.registry import REGISTRY, get_profile

WAIT_S = 5.0
"""How long the decision's pre-warm waits for the tool to have run: awaited before the
tool (the old order), it gives up after this and the order below is wrong."""


class _Ordered(FakeActivities):
    """Logs the order of the tool, the decision's pre-warm and the steps; the pre-warm
    finishes only once the tool has (so it provably ran beside it)."""

    def __init__(self) -> None:
        script = iter([reply("set_priority", '{"priority": "urgent"}'),
                       reply("finish", '{"resolution": "escalated", "priority": "urgent"}')])
        super().__init__(lambda req: next(script))
        self.events: list[str] = []
        self.tool_done = asyncio.Event()

    @activity.defn(name="prewarm")
    async def prewarm(self, req: GenerateRequest) -> GenerateResult:
        self.prewarms.append(req)
        try:
            await asyncio.wait_for(self.tool_done.wait(), WAIT_S)
        except TimeoutError:
            self.events.append("prewarm gave up waiting for the tool")
        await asyncio.sleep(0.2)  # a step sent without waiting for it would come first
        self.events.append("prewarm done")
        return reply(None)

    @activity.defn(name="run_tool")
    async def run_tool(self, req: ToolRequest) -> ToolResult:
        self.events.append(f"tool {req.name}")
        self.tool_done.set()
        return ToolResult(ok=True, output=f"{req.name} ok")

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.events.append(f"step {req.step}")
        return await super().generate(req)


async def _decided(env: WorkflowEnvironment, approvers: Approvers, fakes: FakeActivities,
                   job_id: str, job: JobInput, *, view: bool = False, approve: bool = True,
                   comment: str = "", opening_warms: bool = False
                   ) -> tuple[JobResult, WorkflowHistory]:
    """Run ``job`` and decide its first approval (``urgent_priority-1``) as alice (first
    opening it, with ``view``, and waiting for the opening's pre-warm, with
    ``opening_warms``): its result and history. ``approve=False`` rejects it."""
    async with workers(env, fakes) as client:
        handle = await client.start_workflow(AgentJob.run, job, id=job_id,
                                             task_queue=AGENT_TASK_QUEUE)

        async def asked() -> bool | None:
            return True if await handle.query(AgentJob.pending_approvals) else None

        await eventually(asked)
        if view:
            await handle.signal(AgentJob.viewed, ApprovalViewed(approval_id="urgent_priority-1"))
        if opening_warms:

            async def opened() -> bool:
                return len(fakes.prewarms) == 1  # the opening's (a step might have followed)

            await eventually(opened)
        approvers.now = await env.get_current_time()
        await handle.execute_update(AgentJob.decide, approvers.decision(
            "alice", ("team-lead",), job_id=handle.id, approval_id="urgent_priority-1",
            approve=approve, comment=comment))
        return await handle.result(), await handle.fetch_history()


async def test_the_decision_warms_beside_the_tool_and_the_next_step_waits_for_it(
    time_skipping_env: WorkflowEnvironment, approvers: Approvers,
) -> None:
    fakes = _Ordered()
    res, history = await _decided(time_skipping_env, approvers, fakes, "decision-beside-tool",
                                  JobInput(profile="ticket-triage", task=TICKET, max_steps=4))
    assert res.state == JobState.FINISHED, res.reason
    assert fakes.events == ["step 1", "tool set_priority", "prewarm done", "step 2"]
    # the statistics are recorded as before: the human's wait, before the job ended
    assert [p.kind for p in fakes.pauses] == ["approval:urgent_priority"]
    assert PATCH_DECISION_BESIDE_TOOL in _patches(history)
    await _replayer().replay_workflow(history)


async def test_a_job_that_ends_at_its_approved_call_records_the_wait_and_warms_nothing(
    time_skipping_env: WorkflowEnvironment, approvers: Approvers,
) -> None:
    """A replayed job whose last recorded call needs an approval ends the moment it is
    approved: the decision's records, started beside the (recorded) tool, are waited for
    at the end, not dropped with it; no step follows, so nothing is pre-warmed."""
    fakes = _SlowPrewarm(lambda req: reply("noop"))
    res, history = await _decided(time_skipping_env, approvers, fakes, "ends-at-approval",
                                  JobInput(profile="ticket-triage", task=TICKET,
                                           replay=_LAST_CALL_APPROVED))
    assert res.state == JobState.FINISHED, res.reason
    assert [p.kind for p in fakes.pauses] == ["approval:urgent_priority"]
    assert fakes.prewarms == []
    assert PATCH_NO_PREWARM_AT_END in _patches(history)
    await _replayer().replay_workflow(history)
    _record("agent_job_ends_at_approved_call.json", history)


async def test_a_job_the_step_cap_ends_after_its_approved_call_warms_nothing(
    time_skipping_env: WorkflowEnvironment, approvers: Approvers,
) -> None:
    fakes = _SlowPrewarm(lambda req: reply("set_priority", '{"priority": "urgent"}'))
    res, history = await _decided(time_skipping_env, approvers, fakes, "capped-at-approval",
                                  JobInput(profile="ticket-triage", task=TICKET, max_steps=1),
                                  view=True)
    assert res.state == JobState.LOOP_CAP, res.reason
    assert [t.name for t in fakes.tool_requests] == ["set_priority"]  # the approved call ran
    # the wait and the wait from the opening are recorded; neither warms anything
    assert [p.kind for p in fakes.pauses] == ["approval:urgent_priority",
                                              "approval:urgent_priority:viewed"]
    assert fakes.prewarms == []
    assert PATCH_NO_PREWARM_AT_END in _patches(history)
    await _replayer().replay_workflow(history)
    # before the patch: agent_job_capped_at_approval_before_patch.json (two pre-warms)
    _record("agent_job_capped_at_approval.json", history)


_LAST_CALL_APPROVED = ReplayScript(ask_approvals=True, steps=[ReplayStep(
    call=ToolCall(id="c1", function=FunctionCall(name="set_priority",
                                                 arguments='{"priority": "urgent"}')),
    result="priority set", output_tokens=4)])
"""One recorded step, whose call (an urgent priority) asks for an approval."""


class _SlowPrewarm(FakeActivities):
    prewarmed = 0

    @activity.defn(name="prewarm")
    async def prewarm(self, req: GenerateRequest) -> GenerateResult:
        self.prewarms.append(req)
        await asyncio.sleep(1.0)
        self.prewarmed += 1
        return reply(None)


ENDS_ON_REJECT = "ticket-triage-ends-on-reject"


@pytest.fixture
def ends_on_reject() -> Iterator[str]:
    """ticket-triage, but a rejected urgent priority ends the job REJECTED."""
    base = get_profile("ticket-triage")
    rules = tuple(dataclasses.replace(r, on_reject="end") for r in base.approvals)
    REGISTRY.add(dataclasses.replace(base, name=ENDS_ON_REJECT, approvals=rules),
                 source="test")
    try:
        yield ENDS_ON_REJECT
    finally:
        REGISTRY.remove(ENDS_ON_REJECT)


async def _rejected(env: WorkflowEnvironment, approvers: Approvers, fakes: FakeActivities,
                    profile: str) -> tuple[JobResult, WorkflowHistory]:
    """Run a job of ``profile`` that asks for an urgent priority; alice opens the
    approval, then rejects it."""
    return await _decided(env, approvers, fakes, "rejected-ends",
                          JobInput(profile=profile, task=TICKET, max_steps=4), view=True,
                          approve=False, comment="not urgent", opening_warms=True)


async def test_a_rejection_that_ends_the_job_records_the_wait_and_warms_nothing(
    time_skipping_env: WorkflowEnvironment, approvers: Approvers, ends_on_reject: str,
) -> None:
    """No model step follows a decision that ends the job, so its pre-warm would prefill
    the whole prompt for nothing, and the job's end would wait for it."""
    fakes = _SlowPrewarm(lambda req: reply("set_priority", '{"priority": "urgent"}'))
    res, history = await _rejected(time_skipping_env, approvers, fakes, ends_on_reject)
    assert res.state == JobState.REJECTED, res.reason
    assert "rejected by alice" in (res.reason or "")
    # the opening's pre-warm only; the decision's none, nor did the job's end wait for one
    assert len(fakes.prewarms) == 1 and fakes.prewarms[0].pause_kind
    assert [p.kind for p in fakes.pauses] == ["approval:urgent_priority",
                                              "approval:urgent_priority:viewed"]
    assert PATCH_NO_PREWARM_AT_END in _patches(history)
    await _replayer().replay_workflow(history)
    if os.environ.get("WARMLOOP_RECORD_HISTORIES"):
        (REJECTED_HISTORIES / "agent_job_rejected_ends.json").write_text(history.to_json())


REJECTED_HISTORIES = Path(__file__).parent / "histories" / "ends_on_reject"
"""Histories of jobs of the ``ends_on_reject`` profile, which only these tests register
(so the replay of every history in ``histories/`` leaves them out)."""


@pytest.mark.parametrize("name", ["agent_job_rejected_ends_before_patch.json",
                                  "agent_job_rejected_ends.json"])
async def test_recorded_rejections_that_end_the_job_replay(name: str,
                                                           ends_on_reject: str) -> None:
    # before PATCH_NO_PREWARM_AT_END the rejection pre-warmed: that history still replays
    history = WorkflowHistory.from_json("rejected-ends",
                                        (REJECTED_HISTORIES / name).read_text())
    assert (PATCH_NO_PREWARM_AT_END in _patches(history)) == ("before" not in name)
    await _replayer().replay_workflow(history)
