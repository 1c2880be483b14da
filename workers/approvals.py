"""Human-in-the-loop approvals from the service side: find them, and decide them as a
verified person.

Every decision carries an assertion signed by the approvals service for one verified
identity (``warmloop.workers.identity``); the workflow's ``decide`` validator checks
it, the approval kind's rules (roles, not the submitter, two different people above a
threshold) and refuses anything else before it reaches history.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from warmloop.workers.identity import (
    AssertionSigner,
    Identity,
    signer_from_settings,
    verifier_from_settings,
)
from warmloop.workflows.agent_job import SA_PENDING, AgentJob
from warmloop.workflows.contracts import ApprovalViewed, Decision, JobStatus, PendingApproval
from warmloop.workflows.tenants import split_job_id

if TYPE_CHECKING:
    from warmloop.workers.settings import Settings

PENDING_QUERY = (f"WorkflowType = 'AgentJob' AND ExecutionStatus = 'Running' "
                 f"AND {SA_PENDING.name} IS NOT NULL")


class ApprovalRefused(Exception):
    """The job refused the decision (the message says why and is safe to show)."""


async def list_pending(client: Client) -> list[PendingApproval]:
    """Pending approvals across all jobs: the search attribute finds the jobs, the
    query gives the details (visibility may lag a moment behind the workflow)."""
    out: list[PendingApproval] = []
    async for wf in client.list_workflows(PENDING_QUERY):
        handle = client.get_workflow_handle_for(AgentJob.run, wf.id)
        try:
            out += await handle.query(AgentJob.pending_approvals)
        except RPCError:  # the job ended between the listing and the query
            continue
    return sorted(out, key=lambda p: p.requested_at)


def may_decide(who: Identity, p: PendingApproval) -> bool:
    """Whether the person's tenants and roles let them decide this approval (the job
    re-checks, with the rules only it knows: submitter, two-person)."""
    tenant, _ = split_job_id(p.job_id)
    if who.tenants is not None and tenant not in who.tenants:
        return False
    return bool(who.roles & set(p.approvers)) and who.subject not in p.approved_by


async def list_pending_for(client: Client, who: Identity) -> list[PendingApproval]:
    return [p for p in await list_pending(client) if may_decide(who, p)]


async def decide(client: Client, job_id: str, decision: Decision) -> PendingApproval:
    """Send a decision that already carries its assertion. Raises ApprovalRefused when
    the job's validator refuses it (nothing reaches the job's history then)."""
    handle = client.get_workflow_handle_for(AgentJob.run, job_id)
    try:
        return await handle.execute_update(AgentJob.decide, decision)
    except WorkflowUpdateFailedError as e:
        cause = e.cause
        raise ApprovalRefused(getattr(cause, "message", None) or str(cause)) from None


async def decide_as(client: Client, who: Identity, signer: AssertionSigner, *, job_id: str,
                    approval_id: str, approve: bool, comment: str = "") -> PendingApproval:
    """Decide as a verified person: sign the assertion for exactly this decision."""
    assertion = signer.sign_decision(who, job_id=job_id, approval_id=approval_id,
                                     approve=approve, comment=comment)
    return await decide(client, job_id, Decision(approval_id=approval_id, approve=approve,
                                                 assertion=assertion, comment=comment))


async def mark_viewed(client: Client, who: Identity, *, job_id: str, approval_id: str) -> None:
    """Tell the job an approver opened the approval: it warms its prefix again."""
    handle = client.get_workflow_handle_for(AgentJob.run, job_id)
    await handle.signal(AgentJob.viewed, ApprovalViewed(approval_id=approval_id,
                                                        viewer=who.subject))


async def job_status(client: Client, job_id: str) -> JobStatus:
    return await client.get_workflow_handle_for(AgentJob.run, job_id).query(AgentJob.status)


@dataclass(frozen=True)
class Approver:
    """A verified person with the service's signer: what the demo, benchmarks and the
    CLI's service side use to decide. Built once; ``from_token`` verifies the token."""

    who: Identity
    signer: AssertionSigner

    @classmethod
    def from_token(cls, settings: Settings, token: str) -> Approver:
        return cls(verifier_from_settings(settings).verify(token), signer_from_settings(settings))

    async def decide(self, client: Client, job_id: str, approval_id: str, *, approve: bool,
                     comment: str = "") -> PendingApproval:
        return await decide_as(client, self.who, self.signer, job_id=job_id,
                               approval_id=approval_id, approve=approve, comment=comment)


def dev_approver(settings: Settings, subject: str = "demo-bot") -> Approver:
    """One of the embedded stack's dev users (``warmloop dev up`` creates them): the
    demo's and the benchmarks' stand-in approver."""
    from warmloop.workers.identity import dev_token

    return Approver.from_token(settings, dev_token(settings, subject))
