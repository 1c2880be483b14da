"""A tenant's job slots (``max_jobs_in_flight``), claimed before a job starts.

A submit claims one (``warmloop.workers.jobs``), and so does each job of a batch whose
tenant has a quota (``ReadPageResult.ask_quota``), through the ``claim_job_slot``
activity: the batch waits for the slot (and for tokens left in the tenant's hour)
instead of starting a job past the quota. Both count
the same way: the running jobs Temporal's visibility shows, plus the starts recorded in
Redis that visibility does not show yet (``TenantUsage.claim_start``), less those
Temporal says have ended.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import timedelta

import structlog
from temporalio import activity
from temporalio.client import Client, WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError
from temporalio.service import RPCError, RPCStatusCode

from warmloop.activities.registry import REDIS_ERRORS, TenantUsage
from warmloop.workflows.tenants import (
    TENANT_SLOT_WAIT,
    JobSlotGranted,
    JobSlotRequest,
    TenantQuota,
    over_jobs,
    over_tokens,
)

log = structlog.get_logger(__name__)

STARTING_GRACE_S = 60.0
"""How long a recorded start that Temporal does not know yet counts as starting (its
submit is between the record and the start); older, its start failed."""
DESCRIBES_AT_ONCE = 16
"""Temporal describes a claim sends at once (near the limit, one per recorded start
visibility does not show)."""
SLOT_POLL_S = 2.0
"""How soon a batch's job asks again for a slot its tenant had none of (the activity's
next attempt): a slot frees when one of the tenant's jobs ends, which nothing signals."""


def running_jobs_query(tenant: str) -> str:
    """Temporal visibility query of the tenant's jobs in flight (tenants are checked
    names: nothing to escape)."""
    return (f"WorkflowType = 'AgentJob' AND ExecutionStatus = 'Running' "
            f"AND WarmloopTenant = '{tenant}'")


async def visible_running(client: Client, tenant: str, enough: int) -> set[str]:
    """Ids of the tenant's jobs that visibility shows running, at most ``enough``."""
    ids: set[str] = set()
    async for wf in client.list_workflows(running_jobs_query(tenant), page_size=enough):
        ids.add(wf.id)
        if len(ids) >= enough:
            break
    return ids


async def ended_starts(client: Client, starts: Mapping[str, float]) -> set[str]:
    """Of ``starts`` (workflow id: when a claim recorded it), those no longer in
    flight: closed, or unknown to Temporal past ``STARTING_GRACE_S`` (a start that
    failed without its record being dropped). A describe that fails otherwise counts
    the job in flight (the quota errs on the safe side; logged)."""
    now = time.time()
    slots = asyncio.Semaphore(DESCRIBES_AT_ONCE)

    async def ended(wid: str, at: float) -> bool:
        async with slots:
            try:
                desc = await client.get_workflow_handle(wid).describe()
            except RPCError as e:
                if e.status == RPCStatusCode.NOT_FOUND:
                    return now - at > STARTING_GRACE_S
                log.warning("tenant_start_undescribed", workflow_id=wid, error=str(e)[:200])
                return False
        return desc.status != WorkflowExecutionStatus.RUNNING

    done = await asyncio.gather(*(ended(w, at) for w, at in starts.items()))
    return {w for w, gone in zip(starts, done, strict=True) if gone}


@dataclass(frozen=True)
class SlotClaim:
    """Whether a job may start under its tenant's ``max_jobs_in_flight``, on what count,
    and whether this claim wrote the start's record (the caller's to drop if the start
    then fails)."""

    admitted: bool
    in_flight: int
    """The tenant's jobs counted in flight, the claimed one not included."""
    recorded: bool


async def claim_slot(client: Client, tenant: str, limit: int, workflow_id: str,
                     usage: TenantUsage | None) -> SlotClaim:
    """Claim a job slot of ``tenant`` (``limit`` jobs in flight) for ``workflow_id``.

    In flight: the running jobs visibility shows, and the starts recorded lately
    (``TenantUsage.claim_start``) that visibility does not show yet, less those Temporal
    says have ended (asked only when the count reaches the limit; they are dropped from
    the record). Visibility alone lags the starts, so two claims racing for the last
    slot would both pass; the record, counted and written in one step on the server,
    lets one. Without ``usage``, or Redis away: visibility alone (logged)."""
    running = await visible_running(client, tenant, limit)
    if len(running) >= limit:
        return SlotClaim(admitted=False, in_flight=len(running), recorded=False)
    if usage is None:
        return SlotClaim(admitted=True, in_flight=len(running), recorded=False)
    try:
        starts = {w: at for w, at in (await usage.recent_starts(tenant)).items()
                  if w not in running and w != workflow_id}
        gone = (await ended_starts(client, starts)
                if len(running) + len(starts) >= limit else set())
        claim = await usage.claim_start(tenant, workflow_id, limit=limit, running=running,
                                        ended=gone)
    except REDIS_ERRORS as e:
        log.warning("tenant_starts_unknown", tenant=tenant, error=str(e) or type(e).__name__)
        return SlotClaim(admitted=True, in_flight=len(running), recorded=False)
    return SlotClaim(admitted=claim.admitted, in_flight=claim.in_flight,
                     recorded=claim.admitted and not claim.recorded_before)


async def spent_hour(tenant: str, quota: TenantQuota, usage: TenantUsage | None
                     ) -> tuple[str, float] | None:
    """Why ``tenant`` may start nothing this hour and the seconds until its window
    resets (``over_tokens``), when its ``tokens_per_hour`` is spent; None while it is
    not, and when it cannot be known (no ``usage``, or Redis away: let through, logged),
    as a submit and a batch's claims both treat it."""
    if quota.tokens_per_hour is None or usage is None:
        return None
    now = time.time()
    try:
        used = await usage.used(tenant, now)
    except REDIS_ERRORS as e:
        log.warning("tenant_usage_unknown", tenant=tenant, error=str(e) or type(e).__name__)
        return None
    return over_tokens(tenant, quota, used, now)


def _count_wait(tenant: str, quota: str) -> None:
    """Count a batch job's refused claim: operators see whose batches wait, and on what."""
    activity.metric_meter().create_counter(
        "warmloop_tenant_slot_waits",
        "Refused job-slot claims of tenants' batch jobs (each is retried), by quota.",
    ).add(1, {"tenant": tenant, "quota": quota})


class TenantSlotActivities:
    """``claim_job_slot``: a batch's job waits here for its tenant's quota.

    The quotas are the worker's (``WARMLOOP_TENANTS``, read at its start), as the router's
    token check's are: an operator's limit, not the starter's. The Temporal client is the
    worker's own (``activity.client()``): the plugin builds its activities before it
    meets the worker's client."""

    def __init__(self, usage: TenantUsage | None, quotas: Mapping[str, TenantQuota], *,
                 poll_s: float = SLOT_POLL_S) -> None:
        if poll_s <= 0:
            raise ValueError(f"TenantSlotActivities: poll_s must be > 0, got {poll_s}")
        self._usage = usage
        self._quotas = dict(quotas)
        self._poll_s = poll_s

    @activity.defn(name="claim_job_slot")
    async def claim_job_slot(self, req: JobSlotRequest) -> JobSlotGranted:
        """Grant the job ``req.workflow_id`` a slot of its tenant, or fail this attempt
        (``TENANT_SLOT_WAIT``, retried after ``next_retry_delay``) while the tenant's
        hour's tokens are spent (until the hour's window resets) or its jobs in flight
        are at ``max_jobs_in_flight`` (``SLOT_POLL_S``). Waiting between attempts adds
        nothing to the batch's history. A tenant without a quota here is granted at once;
        Redis away: the tokens are not checked and the slots are visibility's alone
        (logged), as at a submit."""
        quota = self._quotas.get(req.tenant)
        if quota is None:
            return JobSlotGranted()
        if (refused := await spent_hour(req.tenant, quota, self._usage)) is not None:
            why, wait = refused
            _count_wait(req.tenant, "tokens_per_hour")
            raise ApplicationError(f"{why}; the batch's next job waits for it",
                                   {"retry_after_s": wait}, type=TENANT_SLOT_WAIT,
                                   next_retry_delay=timedelta(seconds=wait))
        if quota.max_jobs_in_flight is None:
            return JobSlotGranted()
        claim = await claim_slot(activity.client(), req.tenant, quota.max_jobs_in_flight,
                                 req.workflow_id, self._usage)
        if not claim.admitted:
            _count_wait(req.tenant, "max_jobs_in_flight")
            why = over_jobs(req.tenant, quota, claim.in_flight) or ""
            raise ApplicationError(f"{why.partition(';')[0]}; the batch's next job waits for "
                                   "one to end", {"retry_after_s": self._poll_s},
                                   type=TENANT_SLOT_WAIT,
                                   next_retry_delay=timedelta(seconds=self._poll_s))
        return JobSlotGranted(in_flight=claim.in_flight)
