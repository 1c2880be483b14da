"""Human-in-the-loop approvals from the client side: find and decide them."""

from __future__ import annotations

from temporalio.client import Client

from warmloop.workflows.agent_job import SA_PENDING, AgentJob
from warmloop.workflows.contracts import Decision, PendingApproval

PENDING_QUERY = (f"WorkflowType = 'AgentJob' AND ExecutionStatus = 'Running' "
                 f"AND {SA_PENDING.name} IS NOT NULL")


async def list_pending(client: Client) -> list[PendingApproval]:
    """Pending approvals across all jobs: the search attribute finds the jobs, the
    query gives the details (visibility may lag a moment behind the workflow)."""
    out: list[PendingApproval] = []
    async for wf in client.list_workflows(PENDING_QUERY):
        handle = client.get_workflow_handle_for(AgentJob.run, wf.id)
        out += await handle.query(AgentJob.pending_approvals)
    return sorted(out, key=lambda p: p.requested_at)


async def decide(client: Client, job_id: str, decision: Decision) -> PendingApproval:
    """Send the decision; the workflow's validator refuses unknown ids, decided ids and
    approvers not allowed for the kind (raises WorkflowUpdateFailedError)."""
    handle = client.get_workflow_handle_for(AgentJob.run, job_id)
    return await handle.execute_update(AgentJob.decide, decision)
