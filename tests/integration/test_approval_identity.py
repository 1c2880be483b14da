"""Verified approvals on the real stack: every unverified or rule-breaking decision is
refused by the job's validator before any history event, over the real Temporal
server and the real agent worker (which holds only the stack's public key); the CLI
decides through the approvals service with a token."""

from __future__ import annotations

import json
import re
import uuid
from datetime import UTC, datetime, timedelta

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowHandle

from tests.integration.cli import warmloop
from tests.polling import eventually
from warmloop.infra.stack import Stack
from warmloop.workers.approvals import ApprovalRefused, decide, decide_as
from warmloop.workers.identity import AssertionSigner, Identity, dev_token, signer_from_settings
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    Decision,
    FunctionCall,
    JobInput,
    JobResult,
    PendingApproval,
    ReplayScript,
    ReplayStep,
    ToolCall,
)

pytestmark = pytest.mark.integration

BOB = Identity("bob", frozenset({"finance-lead"}))
CAROL = Identity("carol", frozenset({"cfo", "finance-lead"}))
ALICE = Identity("alice", frozenset({"team-lead", "support-manager"}))


def _call(name: str, args: dict[str, object], n: int) -> ToolCall:
    return ToolCall(id=f"call-{n}", function=FunctionCall(name=name, arguments=json.dumps(args)))


async def _payment_job(client: Client, amount: float, submitted_by: str
                       ) -> tuple[WorkflowHandle[AgentJob, JobResult], PendingApproval]:
    """An invoice job (recorded calls, generated on the real engines) whose payment waits."""
    task = {"invoice_id": "INV7301", "vendor_id": "V101", "po_number": "PO7301"}
    script = ReplayScript(ask_approvals=True, steps=[
        ReplayStep(call=_call("approve_payment", {"invoice_id": "INV7301", "amount": amount}, 1),
                   result="payment scheduled", output_tokens=8),
        ReplayStep(call=_call("finish", {"outcome": "paid"}, 2), result="done", output_tokens=8),
    ])
    handle = await client.start_workflow(
        AgentJob.run, JobInput(profile="invoice-reconciliation", task=task, replay=script,
                               hold_policy="never", submitted_by=submitted_by),
        id=f"verified-{uuid.uuid4().hex[:8]}", task_queue=AGENT_TASK_QUEUE)

    async def waiting() -> PendingApproval | None:
        pending = await handle.query(AgentJob.pending_approvals)
        return pending[0] if pending else None

    return handle, await eventually(waiting, attempts=1200)


async def _events(handle: WorkflowHandle[AgentJob, JobResult]) -> list[int]:
    return [e.event_type for e in (await handle.fetch_history()).events]


async def test_unverified_and_rule_breaking_decisions_are_refused_before_history(
    stack: Stack, client: Client, settings: Settings,
) -> None:
    signer = signer_from_settings(settings)
    handle, p = await _payment_job(client, 60_000, submitted_by="bob")
    assert (p.approvals_needed, p.amount) == (2, 60_000)
    job, aid = handle.id, p.approval_id

    def signed(who: Identity, *, approval_id: str = aid, signer: AssertionSigner = signer,
               now: datetime | None = None) -> Decision:
        return Decision(approval_id=approval_id, approve=True, assertion=signer.sign_decision(
            who, job_id=job, approval_id=approval_id, approve=True, comment="", now=now))

    forged = AssertionSigner(Ed25519PrivateKey.generate())
    genuine = signed(CAROL).assertion.split(".")
    other_key_same_kid = ".".join([*genuine[:3], forged.sign_decision(
        CAROL, job_id=job, approval_id=aid, approve=True, comment="").split(".")[3]])
    cases = [
        (Decision(approval_id=aid, approve=True, approver="cfo"), "no valid signed assertion"),
        (Decision(approval_id=aid, approve=True, assertion=other_key_same_kid),
         "signature does not verify"),
        (signed(CAROL, signer=forged), "unknown key"),
        (signed(CAROL, now=datetime.now(UTC) - timedelta(minutes=10)), "expired"),
        (signed(CAROL, approval_id="large_payment-9"), "unknown approval"),
        (signed(ALICE), "alice (roles: support-manager, team-lead) may not decide"),
        (signed(BOB), "bob submitted this job"),
    ]
    before = await _events(handle)
    for bad, message in cases:
        with pytest.raises(ApprovalRefused, match=re.escape(message)):
            await decide(client, job, bad)
    # the real server keeps no trace of a refused Update: not even a workflow task
    assert await _events(handle) == before

    first = await decide(client, job, signed(CAROL))
    assert first.approved_by == ["carol"]
    before = await _events(handle)
    with pytest.raises(ApprovalRefused, match="carol already approved this"):
        await decide(client, job, signed(CAROL))
    assert await _events(handle) == before
    assert EventType.EVENT_TYPE_WORKFLOW_EXECUTION_UPDATE_ACCEPTED in before  # carol's

    # a second, different finance approver completes the two-person rule
    await decide_as(client, Identity("demo-bot", frozenset({"finance-lead"})), signer,
                    job_id=job, approval_id=aid, approve=True)
    res = await handle.result()
    assert [(a.outcome, a.decided_by) for a in res.approvals] == [
        ("approved", "carol, demo-bot")]


async def test_the_cli_decides_through_the_approvals_service_with_a_token(
    stack: Stack, client: Client, settings: Settings,
) -> None:
    handle, p = await _payment_job(client, 9_000, submitted_by="erin")
    no_token = warmloop("approve", handle.id, p.approval_id, token="")
    assert no_token.returncode == 1 and "no token" in no_token.stderr
    bad = warmloop("approve", handle.id, p.approval_id, token="wl_dev_nobody")
    assert bad.returncode == 1 and "not signed in" in bad.stderr
    alice = warmloop("approve", handle.id, p.approval_id, token=dev_token(settings, "alice"))
    assert alice.returncode == 1 and "refused" in alice.stderr
    listed = warmloop("approvals", token=dev_token(settings, "bob"))
    assert listed.returncode == 0 and p.approval_id in listed.stdout and handle.id in listed.stdout
    ok = warmloop("approve", handle.id, p.approval_id, "--comment", "matches the PO",
                  token=dev_token(settings, "bob"))
    assert ok.returncode == 0, ok.stderr
    res = await handle.result()
    [rec] = res.approvals
    assert (rec.outcome, rec.decided_by, rec.comment) == ("approved", "bob", "matches the PO")
