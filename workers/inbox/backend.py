"""What the inbox reads and changes, behind one seam (``InboxBackend``): pending
approvals, a job's status and transcript, decisions, and the history of decisions.

The web app only talks to this protocol, so its tests run on a fake; ``TemporalBackend``
is the real one, over ``warmloop.workers.approvals`` (the same calls the CLI makes).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

from temporalio.client import Client, WorkflowExecution, WorkflowExecutionStatus
from temporalio.service import RPCError, RPCStatusCode

from warmloop.activities.transcripts import TranscriptStore
from warmloop.workers import approvals
from warmloop.workers.identity import AssertionSigner, Identity
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import (
    ApprovalRecord,
    ChatMessage,
    JobResult,
    JobStatus,
    PendingApproval,
)

log = logging.getLogger(__name__)

HISTORY_JOBS = 100
"""How many of the most recent jobs the history page looks into."""
HISTORY_CONCURRENCY = 8
"""Jobs asked at once for their decisions (each is one query or one result fetch)."""
TRANSCRIPT_MAX_MESSAGES = 400
"""The detail page shows at most the last this many messages of a transcript."""


class TranscriptUnavailable(Exception):
    """The transcript store could not be read (the message is safe to show)."""


class InboxBackend(Protocol):
    """Everything the inbox needs from Temporal and S3."""

    async def pending(self) -> list[PendingApproval]:
        """All pending approvals, oldest first (the app filters by person)."""
        ...

    async def job(self, job_id: str) -> JobStatus | None:
        """The job's status (its pending approvals, decisions, submitter); None when
        there is no such job. An ended job answers with no pending approvals."""
        ...

    async def decide(self, who: Identity, *, job_id: str, approval_id: str, approve: bool,
                     comment: str) -> PendingApproval:
        """Decide as ``who``; raises ``approvals.ApprovalRefused`` when the job refuses."""
        ...

    async def viewed(self, who: Identity, *, job_id: str, approval_id: str) -> None:
        """Tell the job an approver opened the approval (it pre-warms its prefix)."""
        ...

    async def transcript(self, job_id: str) -> list[ChatMessage]:
        """The job's stored transcript so far; raises TranscriptUnavailable."""
        ...

    async def history(self) -> list[ApprovalRecord]:
        """Decisions of recent jobs, newest first (the app filters by person)."""
        ...


class TemporalBackend:
    """The real backend. The Temporal client is made on first use, in the server's own
    event loop (a client is bound to the loop it was made in), so the inbox starts,
    and answers /healthz, even while Temporal is still coming up."""

    def __init__(self, client_factory: Callable[[], Awaitable[Client]],
                 signer: AssertionSigner, s3: Any, bucket: str) -> None:
        self._factory = client_factory
        self._client: Client | None = None
        self._lock = asyncio.Lock()
        self._signer = signer
        self._s3 = s3
        self._bucket = bucket

    async def client(self) -> Client:
        async with self._lock:
            if self._client is None:
                self._client = await self._factory()
            return self._client

    async def pending(self) -> list[PendingApproval]:
        return await approvals.list_pending(await self.client())

    async def job(self, job_id: str) -> JobStatus | None:
        try:
            status = await approvals.job_status(await self.client(), job_id)
        except RPCError as e:
            if e.status in (RPCStatusCode.NOT_FOUND, RPCStatusCode.FAILED_PRECONDITION):
                return None
            raise
        return status

    async def decide(self, who: Identity, *, job_id: str, approval_id: str, approve: bool,
                     comment: str) -> PendingApproval:
        return await approvals.decide_as(await self.client(), who, self._signer,
                                         job_id=job_id, approval_id=approval_id,
                                         approve=approve, comment=comment)

    async def viewed(self, who: Identity, *, job_id: str, approval_id: str) -> None:
        await approvals.mark_viewed(await self.client(), who, job_id=job_id,
                                    approval_id=approval_id)

    async def transcript(self, job_id: str) -> list[ChatMessage]:
        return await asyncio.to_thread(load_transcript, self._s3, self._bucket, job_id)

    async def history(self) -> list[ApprovalRecord]:
        client = await self.client()
        jobs = [wf async for wf in client.list_workflows("WorkflowType = 'AgentJob'",
                                                         limit=HISTORY_JOBS)]
        gate = asyncio.Semaphore(HISTORY_CONCURRENCY)

        async def one(wf: WorkflowExecution) -> list[ApprovalRecord]:
            async with gate:
                return await _decisions_of(client, wf)

        found = await asyncio.gather(*(one(wf) for wf in jobs))
        records = [r for rs in found for r in rs]
        return sorted(records, key=lambda r: r.decided_at, reverse=True)


async def _decisions_of(client: Client, wf: WorkflowExecution) -> list[ApprovalRecord]:
    """A job's decisions: a running job's from its status query, a finished job's from
    its result. Runs that continued as new are skipped (the next run carries their
    decisions); failed, cancelled or unreachable jobs show none rather than failing
    the whole page."""
    handle = client.get_workflow_handle_for(AgentJob.run, wf.id, run_id=wf.run_id)
    try:
        if wf.status == WorkflowExecutionStatus.RUNNING:
            status: JobStatus = await handle.query(AgentJob.status)
            return list(status.approvals)
        if wf.status == WorkflowExecutionStatus.COMPLETED:
            result: JobResult = await handle.result(follow_runs=False)
            return list(result.approvals)
    except Exception as e:  # one broken job must not hide everyone else's history
        log.warning("history: cannot read decisions of %s: %s", wf.id, e)
    return []


def load_transcript(s3: Any, bucket: str, job_id: str) -> list[ChatMessage]:
    """The job's messages from its message store in S3 (written by the inference
    workers as steps run: everything before the step that proposed the pending call).
    Blocking (boto3): call it in a thread. Only the last TRANSCRIPT_MAX_MESSAGES are
    read, so a long job cannot make the page (or the server's memory) unbounded."""
    from botocore.exceptions import BotoCoreError, ClientError

    prefix = TranscriptStore.key(job_id, 0).rsplit("/", 1)[0] + "/"
    try:
        keys: list[str] = []
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
            keys += [o["Key"] for o in page.get("Contents", [])]
        keys = sorted(keys)[-TRANSCRIPT_MAX_MESSAGES:]
        return [ChatMessage.model_validate_json(s3.get_object(Bucket=bucket, Key=k)["Body"].read())
                for k in keys]
    except (BotoCoreError, ClientError) as e:
        raise TranscriptUnavailable(f"the transcript store cannot be read ({e})") from None
