"""``JobClient``: submit agent jobs and read their results from Python.

The CLI's ``submit``/``status``/``result``/``cancel`` as a typed API, for a team's own
services and scripts. Input is validated against the profile before anything starts.

A job belongs to a tenant (``warmloop.workflows.tenants``; "default" unless given): a
tenant's job runs as workflow ``<tenant>/<job id>``, tagged with the ``WarmloopTenant``
search attribute, and is refused at submit when the tenant is at its quota
(``WARMLOOP_TENANTS``: jobs in flight, tokens this hour).
"""

from __future__ import annotations

import contextlib
import re
import uuid
from collections.abc import Mapping
from datetime import datetime
from typing import Any

import structlog
from pydantic import BaseModel, ValidationError
from temporalio.client import (
    Client,
    WorkflowExecutionStatus,
    WorkflowHandle,
)
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode

from warmloop.activities.batch_recovery import (
    JobGone,
    JobsStillStopping,
    recovery_written,
    run_input,
    stopped_page,
)
from warmloop.activities.registry import REDIS_ERRORS, TenantUsage
from warmloop.activities.tenant_slots import claim_slot, spent_hour
from warmloop.workers.clients import build_redis, connect
from warmloop.workers.fleet import check_fleet_serves
from warmloop.workers.plugins import load_plugins
from warmloop.workers.settings import Settings
from warmloop.workflows.batch_run import (
    BatchInput,
    BatchProgress,
    BatchResult,
    BatchRun,
    RecoverPageRequest,
)
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    JobInput,
    JobResult,
    JobStatus,
    Lane,
    id_problem,
)
from warmloop.workflows.profiles import UnknownProfileError, get_profile
from warmloop.workflows.tenants import (
    DEFAULT_TENANT,
    TenantQuota,
    job_workflow_id,
    over_jobs,
    split_job_id,
    tenant_problem,
)

log = structlog.get_logger(__name__)


class InvalidJobError(ValueError):
    """The job's input does not validate; nothing was started."""


class UnservableJobError(InvalidJobError):
    """No engine of the fleet can serve the job (its profile's model, or a price for its
    cost cap); the message says what to change. Nothing was started."""


class QuotaExceededError(RuntimeError):
    """The job's tenant is at its quota (the message names it); nothing was started."""


async def _claim_job_slot(client: Client, tenant: str, quota: TenantQuota, workflow_id: str,
                          usage: TenantUsage | None) -> bool:
    """Raise QuotaExceededError when the tenant's jobs in flight are at its
    ``max_jobs_in_flight``, else record ``workflow_id``'s start: True when this submit
    recorded it (its to drop if the start fails), False when there is nowhere to record
    it or the id had a recent start already (a repeated submit). Counted as
    ``tenant_slots.claim_slot`` counts (visibility and the recorded starts; Redis away:
    visibility alone, logged)."""
    claim = await claim_slot(client, tenant, quota.max_jobs_in_flight or 0, workflow_id, usage)
    if not claim.admitted:
        raise QuotaExceededError(over_jobs(tenant, quota, claim.in_flight) or "")
    return claim.recorded


async def _check_tokens(tenant: str, quota: TenantQuota, usage: TenantUsage | None) -> None:
    """Raise QuotaExceededError when ``tenant`` has spent its tokens this hour (read
    through ``usage``; none, or Redis away: not refused, logged)."""
    if (refused := await spent_hour(tenant, quota, usage)) is not None:
        raise QuotaExceededError(refused[0])


async def check_tenant_quota(client: Client, tenant: str, quota: TenantQuota | None, *,
                             usage: TenantUsage | None = None,
                             workflow_id: str | None = None) -> bool:
    """Raise QuotaExceededError when ``tenant`` may start no job now: its tokens this
    hour are at ``tokens_per_hour`` (read from Redis through ``usage``; Redis away: not
    refused, logged), or its jobs in flight at ``max_jobs_in_flight``. With
    ``workflow_id`` and ``usage``, a job slot passed is recorded as that job's
    (``_claim_job_slot``: True), so a submit racing this one counts it; the caller
    drops the record if the start then fails. Without them, the running jobs are
    visibility's alone, which lags the starts a little."""
    if quota is None:
        return False
    await _check_tokens(tenant, quota, usage)
    if quota.max_jobs_in_flight is None:
        return False
    return await _claim_job_slot(client, tenant, quota, workflow_id or "",
                                 usage if workflow_id else None)


async def start_job(client: Client, job: JobInput, job_id: str, *,
                    quota: TenantQuota | None = None,
                    usage: TenantUsage | None = None) -> WorkflowHandle[Any, JobResult]:
    """Start ``job`` as ``job_id`` of its tenant (workflow ``<tenant>/<job id>``; the
    bare id for the default tenant) after its tenant's quota check, tagged with its
    tenant. A job id names one job for good (Temporal's WorkflowAlreadyStartedError).
    With ``usage`` (Redis), a ``max_jobs_in_flight`` quota holds against submits racing
    this one, not only against the jobs visibility shows."""
    from warmloop.workflows.agent_job import SA_TENANT, AgentJob

    wid = job_workflow_id(job.tenant, job_id)
    claimed = await check_tenant_quota(client, job.tenant, quota, usage=usage, workflow_id=wid)
    try:
        return await client.start_workflow(
            AgentJob.run, job, id=wid,
            task_queue=AGENT_TASK_QUEUE, id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
            search_attributes=TypedSearchAttributes([SearchAttributePair(SA_TENANT, job.tenant)]))
    except WorkflowAlreadyStartedError:
        raise  # the id's job exists: its record (if any) stands for it
    except BaseException:
        # Hazard: a start that succeeded but whose answer was lost lands here too; its
        # record goes, and until visibility shows the job its slot looks free.
        if claimed and usage is not None:
            with contextlib.suppress(*REDIS_ERRORS):
                await usage.drop_start(job.tenant, wid)
        raise


async def submit_job(client: Client, job: JobInput, job_id: str,
                     settings: Settings) -> WorkflowHandle[Any, JobResult]:
    """``start_job`` with the tenant's quota from ``settings`` (the CLI's submit): a
    Redis client only when the tenant has a quota (its tokens, its recent starts)."""
    quota = settings.tenants.get(job.tenant)
    if quota is None or not quota.counts_in_redis:
        return await start_job(client, job, job_id, quota=quota)
    redis = build_redis(settings)
    try:
        return await start_job(client, job, job_id, quota=quota, usage=TenantUsage(redis))
    finally:
        await redis.aclose()


def fit_batch_to_quota(batch: BatchInput, quota: TenantQuota | None) -> BatchInput:
    """``batch`` with its windows within its tenant's ``max_jobs_in_flight`` (its
    ``max_window`` cut to it). Raises InvalidJobError when the batch's own ``window``
    asks for more. The slots themselves are claimed by each job as it starts, against
    the agent workers' quotas (``ReadPageResult.ask_quota``), with the tenant's other
    jobs and batches counted."""
    limit = quota.max_jobs_in_flight if quota is not None else None
    if limit is None:
        return batch
    if batch.window is not None and batch.window > limit:
        raise InvalidJobError(
            f"window {batch.window} is over tenant {batch.tenant}'s max_jobs_in_flight "
            f"{limit}: give a window of {limit} or less")
    if batch.max_window <= limit:
        return batch
    return batch.model_copy(update={"max_window": limit})


async def start_batch(client: Client, batch: BatchInput, batch_id: str, *,
                      quota: TenantQuota | None = None, usage: TenantUsage | None = None,
                      ) -> WorkflowHandle[Any, BatchResult]:
    """Start ``batch`` as ``batch_id`` of its tenant (workflow ``<tenant>/<batch id>``;
    the bare id for the default tenant), tagged with its tenant, after its tenant's
    token check (the hour's tokens spent: QuotaExceededError) and with its windows
    within the tenant's jobs in flight (``fit_batch_to_quota``). A batch id names one
    batch for good (Temporal's WorkflowAlreadyStartedError)."""
    from warmloop.workflows.agent_job import SA_TENANT

    batch = fit_batch_to_quota(batch, quota)
    if quota is not None:
        await _check_tokens(batch.tenant, quota, usage)
    return await client.start_workflow(
        BatchRun.run, batch, id=job_workflow_id(batch.tenant, batch_id),
        task_queue=AGENT_TASK_QUEUE, id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
        search_attributes=TypedSearchAttributes([SearchAttributePair(SA_TENANT, batch.tenant)]))


async def resumed_batch(client: Client, batch_id: str, new_batch_id: str | None = None, *,
                        rerun_cancelled: bool = True) -> tuple[BatchInput, str, str]:
    """The input of a batch that goes on where ``batch_id`` stopped (the same source,
    profile, tenant and options), how the old batch ended (one line), and the new
    batch's bare id (``new_batch_id``, else ``<old id>-from-L<line>``, the line it starts
    from).

    It starts from the result's ``next_line``, the first line without an outcome, or,
    with ``rerun_cancelled`` and jobs the old batch's cancel stopped, from the first of
    those (``rerun_lines``), skipping the lines between that have an outcome already
    (``BatchInput.skip_lines``: a job that finished is not run twice). A batch that
    ended without a result (terminated, failed, timed out) is read back from Temporal
    (``batch_recovery.stopped_page``: waiting up to a minute for the jobs its stop asked
    to cancel): the new batch first writes the page it never wrote (``recover``), then
    runs the page's records that never started and the jobs the stop cut short. Raises
    InvalidJobError for a batch that is unknown, still running (or its jobs still
    stopping), or left nothing to run (every line has an outcome, and none is a stopped
    job's to run again), and for a bad new id."""
    handle = client.get_workflow_handle(batch_id, result_type=BatchResult)
    try:
        desc = await handle.describe()
    except RPCError as e:
        if e.status == RPCStatusCode.NOT_FOUND:
            raise InvalidJobError(f"unknown batch {batch_id}") from None
        raise
    if desc.workflow_type != BatchRun.__name__:
        raise InvalidJobError(f"{batch_id} is a {desc.workflow_type} workflow, not a batch")
    if desc.status == WorkflowExecutionStatus.RUNNING:
        raise InvalidJobError(f"batch {batch_id} is still running: cancel it first "
                              "(warmloop batch cancel) or let it end")
    if desc.status != WorkflowExecutionStatus.COMPLETED:
        return await _resumed_stopped_batch(client, desc.id, desc.status, new_batch_id,
                                            rerun_cancelled=rerun_cancelled)
    res = await handle.result()
    rerun = res.rerun_lines if rerun_cancelled else []
    if res.source_done and not rerun:
        raise InvalidJobError(f"batch {batch_id} ended {res.state}: every line of its "
                              "source has an outcome"
                              + (" (its stopped jobs' lines not rerun, as asked)"
                                 if res.rerun_lines else ""))
    if res.state == "INVALID_INPUT":
        raise InvalidJobError(f"batch {batch_id} ran nothing ({res.reason}); start a batch "
                              "with a valid id instead")
    if res.next_line is None or res.next_offset is None:
        raise InvalidJobError(f"batch {batch_id} ended before batches said where they "
                              "stopped; its pages' outcomes in S3 tell, or run it again")
    start, offset, skip = res.next_line, res.next_offset, set[int]()
    if rerun and res.rerun_offset is not None:
        start, offset = rerun[0], res.rerun_offset
        skip = set(range(start, res.next_line)) - set(rerun)
    events = list((await handle.fetch_history()).events)
    new_inp, new = _resuming(await run_input(client, events), batch_id, new_batch_id, start,
                             offset, skip, set(rerun),
                             recovery_written=recovery_written(events))
    return new_inp, f"ended {res.state}: {res.reason}".rstrip(": "), new


def stopped_how(status: WorkflowExecutionStatus | None, *, unknown: str = "unknown") -> str:
    """How a workflow that ended without a result ended, in words (``terminated``, ``timed
    out``, ``failed``; ``unknown`` when Temporal did not say)."""
    return status.name.lower().replace("_", " ") if status is not None else unknown


async def _resumed_stopped_batch(client: Client, batch_id: str,
                                 status: WorkflowExecutionStatus | None,
                                 new_batch_id: str | None, *, rerun_cancelled: bool
                                 ) -> tuple[BatchInput, str, str]:
    """``resumed_batch`` of a batch that ended without a result."""
    how = stopped_how(status)
    try:
        found = await stopped_page(client, batch_id)
    except (JobsStillStopping, JobGone) as e:
        raise InvalidJobError(f"batch {batch_id} was {how}, and {e}") from None
    rerun = {r.line for r in found.stopped} if rerun_cancelled else set()
    start, offset = found.start(rerun_stopped=rerun_cancelled)
    recover = (RecoverPageRequest(batch_id=batch_id, page=found.page)
               if found.read is not None and not found.written and found.outcomes else None)
    if (recover is None and found.read is not None and found.read.exhausted
            and not rerun and not found.unstarted):
        raise InvalidJobError(f"batch {batch_id} was {how} after every line of its source "
                              "had an outcome" + (" (its stopped jobs' lines not rerun, as "
                                                  "asked)" if found.stopped else ""))
    skip = {o.line for o in found.outcomes if o.line >= start}
    inp, new = _resuming(found.inp, batch_id, new_batch_id, start, offset, skip, rerun,
                         recovery_written=found.recovery_written)
    why = f"was {how} on its page {found.page}"
    if recover is not None:
        inp = inp.model_copy(update={"recover": recover})
        why += (f"; the page's {len(found.outcomes)} outcome(s), read back from its jobs, "
                "are written first")
    if found.stopped:
        why += (f"; the stop cut short the jobs of lines "
                f"{', '.join(str(r.line) for r in found.stopped)}"
                + ("" if rerun_cancelled else " (not run again, as asked)"))
    return inp, why, new


def _resuming(inp: BatchInput, batch_id: str, new_batch_id: str | None, start: int,
              offset: int, skip: set[int], rerun: set[int], *,
              recovery_written: bool) -> tuple[BatchInput, str]:
    """The resumed batch's input (from ``start`` at byte ``offset``, skipping ``skip``,
    running ``rerun`` again) and its bare id. ``recovery_written``: the old batch's last
    run wrote the page its input asked it to recover."""
    new = new_batch_id or f"{split_job_id(batch_id)[1]}-from-L{start}"
    if (bad := id_problem("batch", new)) is not None:
        raise InvalidJobError(bad)
    # the old batch's own skipped lines (it resumed another) still have their outcomes
    # elsewhere: a batch stopped before it reached them must not run them
    skip |= {line for line in inp.skip_lines if line >= start}
    skip -= rerun
    # a deadline was the old batch's (past it, the new one would widen to max_window at
    # once); whoever resumes starts it (approval rules read submitted_by). A page the
    # old batch was to recover and did not write goes on to the new one.
    return inp.model_copy(update={"carry": None, "start_line": start, "start_offset": offset,
                                  "skip_lines": sorted(skip), "deadline": None,
                                  "submitted_by": None,
                                  "recover": None if recovery_written else inp.recover}), new


async def submit_batch(client: Client, batch: BatchInput, batch_id: str,
                       settings: Settings) -> WorkflowHandle[Any, BatchResult]:
    """``start_batch`` with the tenant's quota from ``settings`` (the CLI's ``batch
    run``): a Redis client only when the tenant has a token quota."""
    quota = settings.tenants.get(batch.tenant)
    if quota is None or quota.tokens_per_hour is None:
        return await start_batch(client, batch, batch_id, quota=quota)
    redis = build_redis(settings)
    try:
        return await start_batch(client, batch, batch_id, quota=quota,
                                 usage=TenantUsage(redis))
    finally:
        await redis.aclose()


def _refuse_before_start(kind: str, given_id: str | None, tenant: str,
                         options: Mapping[str, Any]) -> None:
    """InvalidJobError for a job's or a batch's id, tenant or carry that must not start."""
    if given_id is not None and (bad := id_problem(kind, given_id)):
        raise InvalidJobError(bad)
    if (bad := tenant_problem(tenant)) is not None:
        raise InvalidJobError(bad)
    if options.get("carry") is not None:
        raise InvalidJobError("carry is set by continue-as-new only; start without it")


class JobListing(BaseModel):
    """One job as Temporal's visibility lists it: what a listing can say without asking
    each job (``JobClient.status`` asks a running one where it is)."""

    job_id: str
    """Its workflow id (``<tenant>/<id>``; a bare id for the default tenant)."""
    tenant: str
    profile: str | None
    """None until the job's first workflow task has run (or for a job from before the
    search attribute)."""
    state: str | None
    """``RUNNING`` while it runs, then its terminal state (``FINISHED``, ``LOOP_CAP``,
    ...); None as ``profile``."""
    status: str
    """Temporal's: RUNNING, COMPLETED, FAILED, CANCELED, TERMINATED, TIMED_OUT."""
    started_at: datetime
    """When its latest run started (a job that continued as new is listed once)."""
    closed_at: datetime | None = None


class BatchListing(BaseModel):
    """One batch as Temporal's visibility lists it (``batch_progress`` asks a running
    one how far it is, ``batch_result`` an ended one how it ended)."""

    batch_id: str
    tenant: str
    status: str
    """Temporal's, as ``JobListing.status``."""
    started_at: datetime
    """When its current page's run started (a batch continues as new each page)."""
    closed_at: datetime | None = None


MAX_LISTED = 1_000
"""The most jobs or batches one listing returns."""


def jobs_query(*, tenant: str | None = None, profile: str | None = None,
               running: bool = False, workflow: str = "AgentJob") -> str:
    """Temporal visibility query of the jobs (``workflow``: or the batches,
    ``BatchRun``, without a profile): of ``tenant`` and ``profile`` when given, only
    those running with ``running``, and one entry a workflow (not the runs it continued
    as new from). Raises InvalidJobError for a tenant or profile name that could not be
    one (they go into the query: nothing to escape)."""
    parts = [f"WorkflowType = '{workflow}'", "ExecutionStatus != 'ContinuedAsNew'"]
    if tenant is not None:
        if (bad := tenant_problem(tenant)) is not None:
            raise InvalidJobError(bad)
        parts.append(f"WarmloopTenant = '{tenant}'")
    if profile is not None:
        if not _PROFILE_NAME.fullmatch(profile):
            raise InvalidJobError(f"profile name {profile!r}: letters, digits, '.', '_', '-' "
                                  "and ':' only")
        parts.append(f"WarmloopProfile = '{profile}'")
    if running:
        parts.append("ExecutionStatus = 'Running'")
    return " AND ".join(parts)


_PROFILE_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,200}")


async def _listed(client: Client, query: str, limit: int) -> list[Any]:
    """Visibility's entries for ``query``, in its order, at most ``limit``."""
    if not 1 <= limit <= MAX_LISTED:
        raise InvalidJobError(f"limit must be 1..{MAX_LISTED}, got {limit}")
    out: list[Any] = []
    async for wf in client.list_workflows(query, page_size=min(limit, 100)):
        out.append(wf)
        if len(out) >= limit:
            break
    return out


def _status(wf: Any) -> str:
    return wf.status.name if wf.status is not None else "UNKNOWN"


def _tenant_of(wf: Any) -> str:
    """A listed workflow's tenant: its search attribute, else its id's namespace (a
    workflow whose attributes visibility does not show yet)."""
    from warmloop.workflows.agent_job import SA_TENANT

    return wf.typed_search_attributes.get(SA_TENANT) or split_job_id(wf.id)[0]


async def list_jobs(client: Client, *, tenant: str | None = None, profile: str | None = None,
                    running: bool = False, limit: int = 50) -> list[JobListing]:
    """The jobs in visibility's order (running ones first, newest first, then the most
    recently ended), at most ``limit`` (1..``MAX_LISTED``): see ``jobs_query``.
    Visibility lags the jobs by a moment."""
    from warmloop.workflows.agent_job import SA_PROFILE, SA_STATE

    query = jobs_query(tenant=tenant, profile=profile, running=running)
    return [JobListing(job_id=wf.id, tenant=_tenant_of(wf),
                       profile=wf.typed_search_attributes.get(SA_PROFILE),
                       state=wf.typed_search_attributes.get(SA_STATE), status=_status(wf),
                       started_at=wf.start_time, closed_at=wf.close_time)
            for wf in await _listed(client, query, limit)]


async def list_batches(client: Client, *, tenant: str | None = None, running: bool = False,
                       limit: int = 50) -> list[BatchListing]:
    """The batches in visibility's order (as ``list_jobs``), at most ``limit``: of
    ``tenant`` when given, only the running ones with ``running`` (scheduled runs among
    them)."""
    query = jobs_query(tenant=tenant, running=running, workflow="BatchRun")
    return [BatchListing(batch_id=wf.id, tenant=_tenant_of(wf), status=_status(wf),
                         started_at=wf.start_time, closed_at=wf.close_time)
            for wf in await _listed(client, query, limit)]


class JobClient:
    """Submits ``AgentJob`` workflows and reads them back.

    Build it with ``await JobClient.connect()`` (settings from ``WARMLOOP_*``), or
    around a Temporal client of your own that uses the pydantic data converter
    (``temporalio.contrib.pydantic.pydantic_data_converter``): warmloop's payloads are
    pydantic models, and the default converter cannot read them back.
    """

    def __init__(self, client: Client, *, tenants: Mapping[str, TenantQuota] | None = None,
                 usage: TenantUsage | None = None, fleet: Settings | None = None) -> None:
        """``tenants``: their quotas, checked at submit (none: no quota); ``usage``: where
        their tokens per hour and their recent starts are counted (without it, tokens
        are not checked, and jobs in flight only as visibility shows them: two submits
        racing for a tenant's last slot may both pass);
        ``fleet``: the settings to read the fleet from (its registry in Redis, else
        ``WARMLOOP_ENGINES``) for submit's check that an engine can serve the job, as
        ``warmloop submit`` checks (None: no check; ``connect`` passes its settings)."""
        self.temporal = client
        self.tenants = dict(tenants or {})
        self._usage = usage
        self._fleet = fleet
        self._redis: Any = None

    @classmethod
    async def connect(cls, settings: Settings | None = None) -> JobClient:
        settings = settings or Settings()
        load_plugins(plugins=settings.plugins, profile_paths=settings.profile_paths,
                     toolsets=False)
        jobs = cls(await connect(settings), tenants=settings.tenants, fleet=settings)
        if any(q.counts_in_redis for q in settings.tenants.values()):
            jobs._redis = build_redis(settings)
            jobs._usage = TenantUsage(jobs._redis)
        return jobs

    async def aclose(self) -> None:
        """Close the Redis client ``connect`` made for tenants' token quotas, if any."""
        if self._redis is not None:
            await self._redis.aclose()
            self._redis = None

    async def submit(self, profile: str, task: dict[str, Any], *, job_id: str | None = None,
                     limits: JobLimits | None = None, max_steps: int | None = None,
                     lane: Lane | str = Lane.INTERACTIVE, tenant: str = DEFAULT_TENANT,
                     **options: Any) -> str:
        """Start a job and return its id (``<profile>-<random>`` unless given; for a
        tenant other than the default, ``<tenant>/<that>``: the id ``status``,
        ``result`` and ``cancel`` take).

        Raises ``InvalidJobError`` when the profile is unknown (in this process's
        plugins), the task does not validate or the tenant is no tenant name,
        ``UnservableJobError`` (an ``InvalidJobError``) when no engine of the fleet
        serves the profile's model or, for a cost cap, declares a price (with
        ``fleet`` settings: a Redis read per submit), ``QuotaExceededError`` when the
        tenant is at its quota, and Temporal's
        ``WorkflowAlreadyStartedError`` when ``job_id`` was ever used: a job id names
        one job for good. ``options`` are further ``JobInput`` fields (``tools``,
        ``hold_policy``, ``routing``, ...)."""
        _refuse_before_start("job", job_id, tenant, options)
        try:
            prof = get_profile(profile)
            prof.validate_task(task)
            job = JobInput(profile=profile, task=task, limits=limits, max_steps=max_steps,
                           lane=Lane(lane), tenant=tenant, **options)
        except (UnknownProfileError, ValidationError, ValueError) as e:
            raise InvalidJobError(f"invalid job for {profile}: {e}") from None
        await self._check_fleet(profile, prof.model, job.limits or prof.limits)
        jid = job_id or f"{profile}-{uuid.uuid4().hex[:10]}"
        await start_job(self.temporal, job, jid, quota=self.tenants.get(tenant),
                        usage=self._usage)
        return job_workflow_id(tenant, jid)

    async def _check_fleet(self, profile: str, model: str | None, limits: JobLimits) -> None:
        """UnservableJobError when no engine of the fleet serves ``model`` under
        ``limits`` (with ``fleet`` settings; none: no check)."""
        if self._fleet is None:
            return
        try:
            await check_fleet_serves(model, limits, self._fleet)
        except ValueError as e:
            raise UnservableJobError(f"cannot serve {profile}: {e}") from None

    def handle(self, job_id: str) -> WorkflowHandle[Any, JobResult]:
        return self.temporal.get_workflow_handle(job_id, result_type=JobResult)

    async def result(self, job_id: str) -> JobResult:
        """How the job ended (waits while it runs). Every ending is a named state with
        the transcript kept; a workflow failure here is a bug, raised as Temporal's."""
        return await self.handle(job_id).result()

    async def run(self, profile: str, task: dict[str, Any], **kw: Any) -> JobResult:
        """``submit`` then ``result``."""
        return await self.result(await self.submit(profile, task, **kw))

    async def status(self, job_id: str) -> JobStatus:
        """Where a running job is (the ``status`` query)."""
        return await self.handle(job_id).query("status", result_type=JobStatus)

    async def cancel(self, job_id: str) -> None:
        """Ask the job to stop: it ends CANCELLED with its transcript kept."""
        await self.handle(job_id).cancel()

    async def list_jobs(self, *, tenant: str | None = None, profile: str | None = None,
                        running: bool = False, limit: int = 50) -> list[JobListing]:
        """Jobs as Temporal's visibility lists them, running ones first (``list_jobs``):
        of ``tenant`` and ``profile`` when given, only running ones with ``running``.
        Raises InvalidJobError for a bad tenant, profile or limit."""
        return await list_jobs(self.temporal, tenant=tenant, profile=profile,
                               running=running, limit=limit)

    async def list_batches(self, *, tenant: str | None = None, running: bool = False,
                           limit: int = 50) -> list[BatchListing]:
        """Batches as visibility lists them, running ones first (``list_batches``)."""
        return await list_batches(self.temporal, tenant=tenant, running=running, limit=limit)

    async def start_batch(self, profile: str, source: str, *, batch_id: str | None = None,
                          tenant: str = DEFAULT_TENANT, **options: Any) -> str:
        """Start a batch: every record of ``source`` (``s3://bucket/key.jsonl``, or a
        JSONL path the agent workers can read) as a batch-lane job of ``profile``.
        Returns its id (``batch-<profile>-<random>`` unless given; for a tenant other
        than the default, ``<tenant>/<that>``: the id ``batch_result`` and
        ``batch_progress`` take). ``options`` are further ``BatchInput`` fields
        (``window``, ``max_window``, ``deadline``, ``page_size``, ``max_steps``,
        ``tools``, ``submitted_by``).

        Raises ``InvalidJobError`` for an unknown profile, a bad id, tenant or option,
        or a window over the tenant's ``max_jobs_in_flight``; ``UnservableJobError``
        when no engine serves the profile's model (with ``fleet`` settings);
        ``QuotaExceededError`` when the tenant has spent its tokens this hour; and
        Temporal's ``WorkflowAlreadyStartedError`` when ``batch_id`` was ever used."""
        _refuse_before_start("batch", batch_id, tenant, options)
        try:
            prof = get_profile(profile)
            batch = BatchInput(profile=profile, source=source, tenant=tenant, **options)
        except (UnknownProfileError, ValidationError, ValueError) as e:
            raise InvalidJobError(f"invalid batch for {profile}: {e}") from None
        await self._check_fleet(profile, prof.model, prof.limits)
        bid = batch_id or f"batch-{profile}-{uuid.uuid4().hex[:8]}"
        await start_batch(self.temporal, batch, bid, quota=self.tenants.get(tenant),
                          usage=self._usage)
        return job_workflow_id(tenant, bid)

    async def batch_result(self, batch_id: str) -> BatchResult:
        """How the batch ended (waits while it runs): every ending is a named
        ``BatchState``, the outcomes of its finished pages kept in S3."""
        return await self.temporal.get_workflow_handle(batch_id,
                                                       result_type=BatchResult).result()

    async def resume_batch(self, batch_id: str, *, new_batch_id: str | None = None,
                           submitted_by: str | None = None,
                           rerun_cancelled: bool = True) -> str:
        """Start a batch that goes on where ``batch_id`` stopped (cancelled, terminated,
        or its source unreadable for a while): the same source, profile, tenant and
        options (not its deadline), from the first line without an outcome, and first the
        lines whose jobs its cancel or its termination stopped (``rerun_cancelled=False``:
        not those); a terminated batch's last page is written first, read back from its
        jobs. Returns its id (``<old id>-from-L<line>`` unless given). Raises
        InvalidJobError when there is nothing to resume (see ``resumed_batch``), and as
        ``start_batch`` does."""
        inp, _, new = await resumed_batch(self.temporal, batch_id, new_batch_id,
                                          rerun_cancelled=rerun_cancelled)
        inp = inp.model_copy(update={"submitted_by": submitted_by})
        await start_batch(self.temporal, inp, new, quota=self.tenants.get(inp.tenant),
                          usage=self._usage)
        return job_workflow_id(inp.tenant, new)

    async def cancel_batch(self, batch_id: str) -> None:
        """Ask the batch to stop: its running jobs are cancelled (each ends CANCELLED,
        its transcript kept) and their outcomes written; it ends CANCELLED
        (``batch_result`` then says from which line the source did not run)."""
        await self.temporal.get_workflow_handle(batch_id).cancel()

    async def batch_progress(self, batch_id: str) -> BatchProgress:
        """Where a running batch is (the ``progress`` query)."""
        return await self.temporal.get_workflow_handle(batch_id).query(
            "progress", result_type=BatchProgress)
