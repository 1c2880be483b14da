"""``BatchRun``: a file of task records run as child ``AgentJob``s in the batch lane.

One page of records per workflow run: read the page from the byte offset where the
last one ended (bad lines are reported with their line numbers and skipped), run its
records as child jobs in a sliding window, write the page's outcomes as JSONL to S3,
then continue-as-new for the next page, carrying only counters and the offset, so a
100,000-record batch keeps a small history. A failing record never fails the batch: it
is listed with its reason (a bad line, a failed job, a job id already in use). A source
that cannot be read ends the batch in a named state (``BatchState``), with what was done
before it kept; a source that is only down for a while is retried, not given up on. A
cancelled batch cancels its running jobs, writes their outcomes and ends CANCELLED.

What a run's history holds is bounded: a page of at most ``MAX_PAGE_SIZE`` records and
``PAGE_BYTES`` (the reader's), the outcomes of its children, never their transcripts
(``BatchChildResult`` keeps state, reason, usage and the transcript's S3 key), and when
the children's results still fill it (Temporal suggests continue-as-new, or
``HISTORY_BYTES_PER_RUN``), the run stops starting children and the next run goes on
from the first record it did not start.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from enum import StrEnum
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator
from temporalio import workflow
from temporalio.common import RetryPolicy, SearchAttributePair, TypedSearchAttributes
from temporalio.exceptions import (
    ActivityError,
    ApplicationError,
    CancelledError,
    ChildWorkflowError,
    FailureError,
    WorkflowAlreadyStartedError,
)
from temporalio.workflow import ParentClosePolicy

from warmloop.workflows.agent_job import SA_TENANT
from warmloop.workflows.budgets import Usage
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput, Lane
from warmloop.workflows.lanes import (
    DEFAULT_BATCH_WINDOW,
    BatchWindow,
    BatchWindowRequest,
    adapt_window,
    default_batch_window,
    estimate_finish_s,
)
from warmloop.workflows.profiles import UnknownProfileError, get_profile
from warmloop.workflows.tenants import (
    DEFAULT_TENANT,
    JobSlotGranted,
    JobSlotRequest,
    TenantName,
    s3_prefix,
    split_job_id,
    tenant_id_problem,
)

READ_TIMEOUT = timedelta(minutes=2)
IO_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                       maximum_interval=timedelta(seconds=30),
                       non_retryable_error_types=["SourceRefused", "SourceMissing"])
"""S3 or a disk that is down is tried again, every 30 s at most, for ``IO_RETRY_FOR``; a
refused or missing source is not (the activity marks those non-retryable too)."""
IO_RETRY_FOR = timedelta(minutes=30)
RESULTS_RETRY_FOR = timedelta(hours=24)
"""A page's outcomes exist nowhere else: writing them is tried for longer."""
AGENT_JOB = "AgentJob"
"""The child workflow, by name: its result is read as a ``BatchChildResult``."""
MAX_PAGE_SIZE = 1_000
"""Records one run may hold. Each record costs its run up to ~10 history events (the
child's start, started, completed, and the workflow tasks they wake); 1,000 is ~10,000,
a fifth of Temporal's 51,200-event limit, with the page's bytes bounded by the reader."""
HISTORY_BYTES_PER_RUN = 8 * 1024 * 1024
"""Past this (or when Temporal suggests it) a run starts no more children: the
children's results are what grows a run's history (Temporal ends one at 50 MB)."""
RESULT_KEYS_KEPT = 1_000
"""Page keys a batch lists in its carry and result (``BatchResult.result_keys``); every
page, listed or not, is ``page_key(batch_id, n)`` under ``results_prefix``. A key a
page in a carry that continue-as-new sends again every page would pass Temporal's
2 MB payload limit at ~30,000 pages and end the batch there."""
HISTORY_BUDGET_PATCH = "batch-history-budget"
CANCEL_PATCH = "batch-cancel"
"""A cancelled batch cancels its running jobs, writes their outcomes and ends CANCELLED
(before, it ended as a cancelled workflow at once, its jobs terminated): each cancel
branch asks it first, so a run recorded before it replays as it ran."""
TENANT_PATCH = "batch-tenants"
"""A batch whose id is not its tenant's ends INVALID_INPUT at once (before, each child
job ended INVALID_INPUT); the branch is taken only by such a batch."""
QUOTA_PATCH = "batch-job-slots"
"""A page of a tenant with a quota (``ReadPageResult.ask_quota``) claims a job slot
before each job starts; a run recorded before (the flag unread) replays as it ran."""
RERUN_PATCH = "batch-rerun-stopped"
"""A batch cancelled once every record of its page had started names the jobs its
cancel stopped too (``BatchResult.rerun_lines``): it waits for its jobs without a
gather that the cancel would reach first. Before it, such a cancel named none."""
RECOVER_PATCH = "batch-recover-page"
"""A resumed batch whose input names a page the old batch never wrote
(``BatchInput.recover``) writes it before anything else; the branch is taken only by
such a batch."""
RECOVER_TIMEOUT = timedelta(minutes=3)
"""One attempt of ``write_recovered_page``: a page's job results read back (waiting up
to a minute for jobs still stopping) and one S3 write."""
RECOVER_RETRY = RetryPolicy(initial_interval=timedelta(seconds=2), backoff_coefficient=2.0,
                            maximum_interval=timedelta(seconds=30),
                            non_retryable_error_types=["PageMoved"])
WINDOW_TIMEOUT = timedelta(seconds=5)
SLOT_TIMEOUT = timedelta(seconds=30)
"""One attempt of ``claim_job_slot`` (a visibility query, a Redis script, a few
describes)."""
SLOT_RETRY = RetryPolicy(initial_interval=timedelta(seconds=1), backoff_coefficient=2.0,
                         maximum_interval=timedelta(seconds=30))
"""A claim waits as long as its tenant is at its quota (each refusal names its own
delay: ``next_retry_delay``); other failures (Temporal or Redis away) back off to 30 s.
No limit: cancel the batch to stop it waiting."""


class BatchState(StrEnum):
    """How a batch ended. Every ending keeps the outcomes of the pages it finished."""

    COMPLETED = "COMPLETED"
    """Every line of the source has an outcome."""
    SOURCE_REFUSED = "SOURCE_REFUSED"
    """The source is not in an allowed input location (``WARMLOOP_BATCH_INPUT_DIRS``),
    not a regular file, or not ``s3://bucket/key``."""
    SOURCE_MISSING = "SOURCE_MISSING"
    """No such file or S3 object."""
    SOURCE_UNAVAILABLE = "SOURCE_UNAVAILABLE"
    """The source could not be read for ``IO_RETRY_FOR``."""
    CANCELLED = "CANCELLED"
    """Cancelled (``warmloop batch cancel``): its running jobs were cancelled too (each
    ended CANCELLED with its transcript kept) and their outcomes written with the
    page's; the records after them did not run (the reason names the first)."""
    RECOVERY_FAILED = "RECOVERY_FAILED"
    """A resume of a batch that stopped without a result could not write the page that
    batch never wrote (its jobs' outcomes, read back from Temporal, or S3 failed for
    ``IO_RETRY_FOR``): nothing ran; resume the old batch again."""
    INVALID_INPUT = "INVALID_INPUT"
    """The batch's id is not in its tenant's namespace (``<tenant>/<batch id>``, a bare
    id for the default tenant): nothing was read or run."""


_SOURCE_ERRORS = {"SourceRefused": BatchState.SOURCE_REFUSED,
                  "SourceMissing": BatchState.SOURCE_MISSING}
REASON_CHARS = 300


def results_prefix(batch_id: str) -> str:
    """Where a batch's result pages are: ``batch-results/<batch id>/``, under
    ``tenants/<tenant>/`` for a tenant's batch (its id ``<tenant>/<batch id>``)."""
    tenant, bare = split_job_id(batch_id)
    return f"{s3_prefix(tenant)}batch-results/{bare}/"


def page_key(batch_id: str, page: int) -> str:
    """The S3 key of a batch's ``page``-th result page (1-based)."""
    return f"{results_prefix(batch_id)}page-{page:05d}.jsonl"


def one_line(text: str, limit: int = REASON_CHARS) -> str:
    """A reason on one line (any whitespace run is a space: a reason can quote input),
    cut to ``limit`` characters: outcomes stay small."""
    flat = " ".join(text.split())
    return flat if len(flat) <= limit else flat[:limit - 1] + "…"


class RecoverPageRequest(BaseModel):
    """A page of a batch that stopped without writing it: its number and the batch."""

    batch_id: str = Field(min_length=1)
    """The stopped batch's workflow id (``<tenant>/<id>`` for a tenant's)."""
    page: int = Field(ge=1)
    """The page's number in that batch: its pages written, plus one."""


class BatchInput(BaseModel):
    """Input of one ``BatchRun``."""

    model_config = ConfigDict(extra="forbid")

    profile: str = Field(min_length=1)
    source: str = Field(min_length=1, description="s3://bucket/key.jsonl, or a JSONL path "
                        "readable by the agent workers.")
    window: int | None = Field(
        default=None, ge=1, le=1024, description="Child jobs running at once (the start; a "
        "deadline may widen it). None: ask the fleet at each page, the jobs its engines' KV "
        "pools hold for batch work less other batches' (lanes.fleet_batch_window).")
    deadline: datetime | None = Field(
        default=None, description="Finish by then: the window widens (up to max_window) "
        "when the pace so far would miss it, and narrows back when well ahead.")
    max_window: int = Field(default=64, ge=1, le=4096,
                            description="The fleet's batch capacity: the widest window.")
    tools: list[str] | None = Field(default=None, min_length=1,
                                    description="Offer only these tools to every job.")
    page_size: int = Field(
        default=100, ge=1, le=MAX_PAGE_SIZE,
        description=f"Records per workflow run (continue-as-new between); at most "
        f"{MAX_PAGE_SIZE}, what one run's history holds.")
    max_steps: int | None = Field(default=None, ge=1, le=10_000)
    history_bytes_per_run: int | None = Field(
        default=None, ge=1, description="Start no more children in a run once its history "
        f"is this large (default {HISTORY_BYTES_PER_RUN}); tests force the boundary with it.")
    # the three below leave the payload when at their defaults, as ``tenant`` does: a
    # worker from before them (BatchInput forbids extra fields) still reads the input
    start_line: int = Field(default=1, ge=1, exclude_if=lambda v: v == 1,
                            description="Begin at this line of the source "
                            "(1-based): another batch's BatchResult.next_line, to go on "
                            "where it stopped (warmloop batch resume).")
    start_offset: int = Field(default=0, ge=0, exclude_if=lambda v: v == 0,
                              description="The byte offset of start_line "
                              "(that result's next_offset); the reader refuses one that does "
                              "not begin a line.")
    tenant: TenantName = Field(
        default=DEFAULT_TENANT, exclude_if=lambda t: t == DEFAULT_TENANT,
        description="Whose batch it is: every job is the tenant's (its engine requests "
        "carry the tenant's cache_salt, its transcripts and the batch's result pages are "
        "under tenants/<tenant>/, its token quota applies before each step, visibility "
        "counts it among the tenant's jobs). A batch of another tenant than the default "
        "one runs as workflow <tenant>/<batch id>, its jobs as <tenant>/<batch id>-L<line>.")
    submitted_by: str | None = Field(
        default=None, max_length=200, exclude_if=lambda v: v is None,
        description="The verified subject who started the batch (the CLI sets it from the "
        "user's token): each job records it, and approval rules refuse this person "
        "deciding the jobs' approvals.")
    skip_lines: list[int] = Field(
        default_factory=list, max_length=MAX_PAGE_SIZE, exclude_if=lambda v: not v,
        description="Lines from start_line on that already have an outcome in the batch "
        "this one resumes (between the jobs its cancel stopped): they are not run, and "
        "get no outcome here (warmloop batch resume sets it).")
    recover: RecoverPageRequest | None = Field(
        default=None, exclude_if=lambda v: v is None,
        description="A page the batch this one resumes never wrote (it was terminated "
        "mid-page): written first, its outcomes read back from that batch's jobs "
        "(warmloop batch resume sets it).")
    carry: BatchCarry | None = None
    """Internal: counters carried across continue-as-new."""

    @property
    def pages_done(self) -> int:
        """Pages of outcomes the batch's earlier runs wrote (its carry's; 0 on its first
        run): the run itself is on page ``pages_done + 1``."""
        return self.carry.pages if self.carry else 0

    @model_validator(mode="after")
    def _start_together(self) -> BatchInput:
        if (self.start_line > 1) != (self.start_offset > 0):
            raise ValueError("start_line and start_offset go together: give both (a batch "
                             "result's next_line and next_offset) or neither")
        return self


class RecordOutcome(BaseModel):
    """One record's fate: a child job's end state, or why the record was skipped. Small
    by design: thousands of them travel in one payload."""

    line: int
    job_id: str | None
    state: str
    """A JobState value, BAD_RECORD (not a task: invalid UTF-8 or JSON, too long, too
    deep, fails the profile's schema, unknown profile), FAILED (the child failed as a
    workflow) or JOB_ID_IN_USE (a running workflow already has the record's job id).
    CANCELLED is a JobState's too (the batch was cancelled while its job ran), or, with
    no transcript key, the batch was cancelled while its job was being started."""
    reason: str
    cost_usd: float = 0.0
    cost_unknown_steps: int = 0
    """The job's steps on engines that declare no price: ``cost_usd`` leaves them out."""
    transcript_key: str | None = None
    """S3 key of the job's transcript."""
    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0


class BatchChildResult(BaseModel):
    """What a batch keeps of a child job's ``JobResult``: never its transcript or its
    step records (the rest of the result is dropped as it is read)."""

    job_id: str = ""
    state: str
    reason: str = ""
    transcript_key: str | None = None
    usage: Usage = Field(default_factory=Usage)


def job_outcome(line: int, job_id: str, res: BatchChildResult) -> RecordOutcome:
    """The outcome of a record whose job ended in a named state (its ``JobResult``)."""
    u = res.usage
    return RecordOutcome(line=line, job_id=job_id, state=res.state,
                         reason=one_line(res.reason), cost_usd=u.cost_usd,
                         cost_unknown_steps=u.cost_unknown_steps,
                         transcript_key=res.transcript_key, steps=u.steps,
                         prompt_tokens=u.prompt_tokens, cached_tokens=u.cached_tokens,
                         completion_tokens=u.completion_tokens)


def failed_outcome(line: int, job_id: str, why: BaseException) -> RecordOutcome:
    """The outcome of a record whose job failed as a workflow (never expected)."""
    return RecordOutcome(line=line, job_id=job_id, state="FAILED",
                         reason=one_line(str(getattr(why, "cause", None) or why)))


def in_use_outcome(line: int, job_id: str) -> RecordOutcome:
    """The outcome of a record whose job id a running workflow had already."""
    return RecordOutcome(line=line, job_id=job_id, state="JOB_ID_IN_USE",
                         reason=f"job id {job_id} is in use by a running workflow; "
                         "the record did not run")


class BatchCarry(BaseModel):
    next_line: int = 1
    next_offset: int = 0
    """Byte offset of line ``next_line`` in the source."""
    pages: int = 0
    done: int = 0
    failed: int = 0
    bad: int = 0
    cost_usd: float = 0.0
    cost_unknown_steps: int = 0
    started_at: datetime | None = None
    result_keys: list[str] = Field(default_factory=list)
    """The first ``RESULT_KEYS_KEPT`` pages' keys (``page_key`` names every page)."""
    window: int | None = None
    """The window as last adapted to the deadline."""
    by_state: dict[str, int] = Field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0


class ReadPageRequest(BaseModel):
    source: str
    profile: str
    tenant: str = Field(default=DEFAULT_TENANT, exclude_if=lambda t: t == DEFAULT_TENANT)
    """Whose batch reads: in warmloop's own bucket a tenant reads only under
    ``tenants/<tenant>/`` (the default tenant: anything but ``tenants/``)."""
    first_line: int = Field(ge=1)
    """Line number of the line at ``offset``."""
    limit: int = Field(ge=1)
    """Lines (blank ones included) the page may take."""
    offset: int = Field(default=0, ge=0)
    """Byte offset to read from: the page reads nothing before it."""


class TaskRecord(BaseModel):
    line: int
    task: dict[str, Any]
    offset: int = 0
    """Byte offset of the record's line: a run that stops before it goes on from there."""


class ReadPageResult(BaseModel):
    records: list[TaskRecord]
    bad: list[RecordOutcome]
    next_line: int
    exhausted: bool
    remaining_lines: int = 0
    """Non-blank lines after this page, estimated from this page's bytes per line."""
    next_offset: int = 0
    """Byte offset of line ``next_line``."""
    ask_quota: bool = False
    """The batch's tenant has a quota on the agent workers (``WARMLOOP_TENANTS``, as the
    reader's worker has it now): each of the page's jobs claims a slot (``claim_job_slot``:
    under ``max_jobs_in_flight``, tokens left in its hour) before it starts. Read each
    page, so a quota given or taken away while a batch runs holds from its next page."""

    def without_lines(self, lines: list[int]) -> ReadPageResult:
        """The page less ``lines`` (records and bad lines): a resumed batch's
        ``skip_lines``, which have outcomes in the batch it resumes."""
        if not lines:
            return self
        skip = set(lines)
        return self.model_copy(update={"records": [r for r in self.records
                                                   if r.line not in skip],
                                       "bad": [b for b in self.bad if b.line not in skip]})


class WritePageRequest(BaseModel):
    batch_id: str
    page: int
    outcomes: list[RecordOutcome]


class BatchProgress(BaseModel):
    """Answer of the ``progress`` query."""

    batch_id: str
    done: int
    failed: int
    bad: int
    running: int
    cost_usd: float
    pages: int
    cost_unknown_steps: int = 0
    """Steps on engines that declare no price: ``cost_usd`` is then a lower bound."""
    window: int
    """Child jobs allowed at once now (adapted to the deadline)."""
    window_why: str = ""
    """Where the window came from: the input's number, or the fleet's answer and why."""
    fleet_window: BatchWindow | None = None
    """The fleet's answer for this page, engine by engine (a batch without a window)."""
    remaining: int
    """Records not finished yet, this page's and the source's after it."""
    waiting_for_quota: bool = False
    """The next job waits for its tenant's quota (a job slot, or the hour's tokens)."""
    estimated_finish: datetime | None = None
    """At the pace so far; None before the first record finishes."""
    deadline: datetime | None = None


class BatchResult(BaseModel):
    batch_id: str
    profile: str
    state: BatchState = BatchState.COMPLETED
    reason: str = ""
    """Why the batch ended before its source did (one line); empty when COMPLETED."""
    records: int
    done: int
    """Records whose job ended in a named state (FINISHED, LOOP_CAP, ...)."""
    failed: int
    """Records that ran no job to a named state: it failed as a workflow (never
    expected), or its job id was in use (JOB_ID_IN_USE); listed with the reason."""
    bad: int
    """Lines skipped (BAD_RECORD): not a task for the profile."""
    cost_usd: float
    """Dollars of the steps whose engine declares a price (see ``cost_unknown_steps``)."""
    result_keys: list[str]
    """S3 keys of the result pages, the first ``RESULT_KEYS_KEPT`` of them; every page is
    ``page-00001.jsonl``, ``page-00002.jsonl``, ... under ``results_prefix``."""
    results_prefix: str = ""
    """Where every result page is (``pages`` of them)."""
    pages: int = 0
    next_line: int | None = None
    """The first line of the source without an outcome (past the last when every line
    has one): a batch started with ``start_line`` and ``start_offset`` set to these goes
    on from there (``warmloop batch resume``). None: a result from before batches said
    where they stopped."""
    next_offset: int | None = None
    """The byte offset of ``next_line``."""
    source_done: bool = False
    """Every line of the source has an outcome (COMPLETED, or cancelled after its last
    job had started): nothing is left to resume but ``rerun_lines``."""
    rerun_lines: list[int] = Field(default_factory=list)
    """Lines whose jobs the batch's cancel stopped (each ended CANCELLED, its transcript
    kept): ``warmloop batch resume`` runs them again, reading from ``rerun_offset`` and
    skipping the lines between that have an outcome already."""
    rerun_offset: int | None = None
    """The byte offset of ``rerun_lines[0]``."""
    makespan_s: float
    by_state: dict[str, int] = Field(default_factory=dict)
    """Records by outcome: each JobState, BAD_RECORD, FAILED and JOB_ID_IN_USE."""
    cost_unknown_steps: int = 0
    """Steps of the batch's jobs served by engines that declare no price: their cost is
    unknown, so ``cost_usd`` is a lower bound whenever this is above 0."""
    cache_hit_share: float = 0.0
    """Prompt tokens the engines served from their prefix caches, over all jobs."""



@workflow.defn
class BatchRun:
    def __init__(self) -> None:
        self._carry = BatchCarry()
        self._running = 0
        self._batch_id = ""
        self._window = 1
        self._base = 1
        self._window_why = ""
        self._fleet_window: BatchWindow | None = None
        self._remaining = 0
        self._deadline: datetime | None = None
        self._cancelled = False
        """The batch was cancelled: it ends CANCELLED once this page is written."""
        self._waiting_for_quota = False
        self._rerun: list[int] = []
        self._rerun_offset: int | None = None

    @workflow.query
    def progress(self) -> BatchProgress:
        c = self._carry
        eta = self._eta_s()
        return BatchProgress(
            batch_id=self._batch_id, done=c.done, failed=c.failed, bad=c.bad,
            running=self._running, cost_usd=c.cost_usd, pages=c.pages, window=self._window,
            window_why=self._window_why, fleet_window=self._fleet_window,
            cost_unknown_steps=c.cost_unknown_steps,
            remaining=self._remaining, deadline=self._deadline,
            waiting_for_quota=self._waiting_for_quota,
            estimated_finish=None if eta is None else workflow.now() + timedelta(seconds=eta),
        )

    def _elapsed_s(self) -> float:
        started = self._carry.started_at or workflow.now()
        return (workflow.now() - started).total_seconds()

    def _eta_s(self) -> float | None:
        c = self._carry
        return estimate_finish_s(done=c.done + c.failed, remaining=self._remaining,
                                 elapsed_s=self._elapsed_s())

    def _adapt(self, inp: BatchInput) -> None:
        if inp.deadline is None:
            return
        c = self._carry
        finished = c.done + c.failed
        pace = self._elapsed_s() / finished if finished else None
        left = (inp.deadline - workflow.now()).total_seconds()
        new = adapt_window(self._window, base=self._base, max_window=inp.max_window,
                           remaining=self._remaining, seconds_per_record=pace, seconds_left=left)
        if new != self._window:
            workflow.logger.info("batch window %d -> %d for the deadline", self._window, new)
            self._window = c.window = new

    @workflow.run
    async def run(self, inp: BatchInput) -> BatchResult:
        info = workflow.info()
        # The id of the first run names the batch across continue-as-new.
        self._batch_id = info.workflow_id
        self._carry = inp.carry or BatchCarry(started_at=workflow.now(),
                                              next_line=inp.start_line,
                                              next_offset=inp.start_offset)
        bad_id = tenant_id_problem(inp.tenant, self._batch_id, what="batch")
        if bad_id is not None and workflow.patched(TENANT_PATCH):
            workflow.logger.warning("batch refused: %s", bad_id)
            return self._result(inp, BatchState.INVALID_INPUT, one_line(f"invalid batch: {bad_id}"))
        if (inp.recover is not None and inp.carry is None
                and workflow.patched(RECOVER_PATCH)):
            try:
                await workflow.execute_activity(
                    "write_recovered_page", inp.recover, start_to_close_timeout=RECOVER_TIMEOUT,
                    schedule_to_close_timeout=IO_RETRY_FOR, task_queue=AGENT_TASK_QUEUE,
                    retry_policy=RECOVER_RETRY, result_type=str)
            except (asyncio.CancelledError, ActivityError) as e:
                if _is_cancel(e):
                    return self._cancelled_result(inp, False)
                if not isinstance(e, ActivityError):
                    raise
                reason = one_line(f"page {inp.recover.page} of {inp.recover.batch_id} was not "
                                  f"written: {e.cause or e}")
                workflow.logger.warning("batch ended RECOVERY_FAILED: %s", reason)
                return self._result(inp, BatchState.RECOVERY_FAILED, reason)
        c = self._carry
        self._deadline = inp.deadline
        self._base = min(inp.window or DEFAULT_BATCH_WINDOW, inp.max_window)
        self._window_why = f"the input's window {inp.window}" if inp.window else ""
        self._window = c.window or self._base  # what progress shows while the page is read
        try:
            page = await workflow.execute_activity(
                "read_records",
                ReadPageRequest(source=inp.source, profile=inp.profile, first_line=c.next_line,
                                limit=inp.page_size, offset=c.next_offset, tenant=inp.tenant),
                start_to_close_timeout=READ_TIMEOUT, schedule_to_close_timeout=IO_RETRY_FOR,
                task_queue=AGENT_TASK_QUEUE, retry_policy=IO_RETRY, result_type=ReadPageResult,
            )
        except (asyncio.CancelledError, ActivityError) as e:
            if _is_cancel(e) and workflow.patched(CANCEL_PATCH):  # none of this page ran
                return self._cancelled_result(inp, False)
            if not isinstance(e, ActivityError):
                raise
            state, reason = _source_error(e, inp.source)
            workflow.logger.warning("batch ended %s: %s", state.value, reason)
            return self._result(inp, state, reason)
        page = page.without_lines(inp.skip_lines)  # outcomes in the batch this one resumes
        self._remaining = len(page.records) + page.remaining_lines
        if inp.window is None and page.records:
            try:
                answer = self._fleet_window = await self._ask_fleet(inp, len(page.records))
            except (asyncio.CancelledError, CancelledError):
                if not workflow.patched(CANCEL_PATCH):
                    raise
                return self._cancelled_result(inp, False)
            self._base, self._window_why = answer.window, answer.why
        self._window = c.window or self._base
        ran: list[RecordOutcome] = []
        try:
            stop = await self._run_window(inp, page.records, outcomes=ran,
                                          ask_quota=page.ask_quota)
        except _BatchCancelled as e:
            self._cancelled, stop = True, e.unstarted
            stopped = {o.line for o in ran if o.state == "CANCELLED"}
            interrupted = [r for r in e.interrupted if r.line in stopped]
            if interrupted:
                self._rerun = [r.line for r in interrupted]
                self._rerun_offset = interrupted[0].offset
        # Bad lines after a record this run did not start are the next run's to report.
        bad = [b for b in page.bad if stop is None or b.line < stop.line]
        outcomes = sorted(bad + ran, key=lambda o: o.line)
        for o in outcomes:
            c.by_state[o.state] = c.by_state.get(o.state, 0) + 1
        c.pages += 1
        key = await self._write_page(WritePageRequest(batch_id=self._batch_id, page=c.pages,
                                                      outcomes=outcomes))
        if len(c.result_keys) < RESULT_KEYS_KEPT:
            c.result_keys.append(key)
        c.bad += len(bad)
        if stop is not None:
            c.next_line, c.next_offset = stop.line, stop.offset
        else:
            c.next_line, c.next_offset = page.next_line, page.next_offset
        if self._cancelled:
            return self._cancelled_result(inp, page.exhausted and stop is None)
        if stop is not None or not page.exhausted:
            # the page to recover was written by this run: later runs' inputs leave it out
            workflow.continue_as_new(inp.model_copy(update={"carry": c, "recover": None}))
        return self._result(inp, BatchState.COMPLETED, "")

    async def _write_page(self, req: WritePageRequest) -> str:
        """Write a page's outcomes. They exist nowhere else: a cancel that lands during
        the write is noted (the batch ends CANCELLED after it) and the write made
        again."""
        for _ in range(2):
            try:
                key: str = await workflow.execute_activity(
                    "write_batch_results", req, start_to_close_timeout=READ_TIMEOUT,
                    schedule_to_close_timeout=RESULTS_RETRY_FOR, task_queue=AGENT_TASK_QUEUE,
                    retry_policy=IO_RETRY, result_type=str)
                return key
            except (asyncio.CancelledError, ActivityError) as e:
                if not _is_cancel(e) or self._cancelled or not workflow.patched(CANCEL_PATCH):
                    raise
                self._cancelled = True
        raise AssertionError("unreachable: a second cancel re-raises")

    def _cancelled_result(self, inp: BatchInput, all_ran: bool) -> BatchResult:
        c = self._carry
        reason = ("cancelled after every line had run" if all_ran else
                  f"cancelled: lines from {c.next_line} on did not run (a new batch from "
                  f"that line finishes the source)")
        if self._rerun:
            reason += (f"; the cancel stopped the jobs of lines "
                       f"{', '.join(map(str, self._rerun))} (warmloop batch resume runs "
                       "them again)")
        workflow.logger.info("batch %s", reason)
        return self._result(inp, BatchState.CANCELLED, reason, source_done=all_ran)

    def _result(self, inp: BatchInput, state: BatchState, reason: str, *,
                source_done: bool = False) -> BatchResult:
        c = self._carry
        started = c.started_at or workflow.now()
        return BatchResult(
            batch_id=self._batch_id, profile=inp.profile, state=state, reason=reason,
            records=c.done + c.failed + c.bad, done=c.done, failed=c.failed, bad=c.bad,
            cost_usd=c.cost_usd, cost_unknown_steps=c.cost_unknown_steps,
            result_keys=c.result_keys, results_prefix=results_prefix(self._batch_id),
            pages=c.pages, next_line=c.next_line, next_offset=c.next_offset,
            source_done=source_done or state == BatchState.COMPLETED,
            rerun_lines=self._rerun, rerun_offset=self._rerun_offset,
            makespan_s=(workflow.now() - started).total_seconds(),
            by_state=dict(sorted(c.by_state.items())),
            cache_hit_share=c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        )

    async def _ask_fleet(self, inp: BatchInput, records: int) -> BatchWindow:
        """The window for this page from the fleet (``batch_window``); the default when
        the activity cannot answer (it answers for a fleet that is away itself)."""
        try:
            model = get_profile(inp.profile).model
        except UnknownProfileError:
            model = None  # every record fails as BAD_RECORD; any window will do
        try:
            answer: BatchWindow = await workflow.execute_local_activity(
                "batch_window", BatchWindowRequest(batch_id=self._batch_id, model=model,
                                                   max_window=inp.max_window,
                                                   records=records),
                start_to_close_timeout=WINDOW_TIMEOUT, result_type=BatchWindow,
                retry_policy=RetryPolicy(maximum_attempts=3))
        except FailureError as e:
            # the batch cancelled while it asked: a local activity's cancel comes back as
            # an ActivityError (before the patch, read as "the fleet did not answer", and
            # the cancel was lost: the batch ran on to COMPLETED)
            if _is_cancel(e) and workflow.patched(CANCEL_PATCH):
                raise asyncio.CancelledError() from None
            # a local activity's last failure can come back unwrapped (its own error)
            if isinstance(e, CancelledError):
                raise
            cause = e.cause if isinstance(e, ActivityError) and e.cause else e
            fallback = default_batch_window(
                inp.max_window, one_line(f"the fleet did not answer ({cause})"))
            workflow.logger.warning("batch window: %s", fallback.why)
            return fallback
        workflow.logger.info("batch window %d for page %d: %s", answer.window,
                             self._carry.pages + 1, answer.why)
        return answer

    def _history_full(self, inp: BatchInput) -> bool:
        """Whether this run's history has room for no more children (both figures come
        from the history itself, so a replay decides the same)."""
        info = workflow.info()
        budget = inp.history_bytes_per_run or HISTORY_BYTES_PER_RUN
        return info.is_continue_as_new_suggested() or info.get_current_history_size() > budget

    async def _run_window(self, inp: BatchInput, records: list[TaskRecord], *,
                          outcomes: list[RecordOutcome], ask_quota: bool = False
                          ) -> TaskRecord | None:
        """Run ``records`` as child jobs, at most ``self._window`` at a time (in order),
        their outcomes into ``outcomes``; the first record not started when the history
        filled up (at least one is started per run, so every run makes progress).

        Cancelled (the batch is): the running jobs are cancelled and waited for (each
        ends CANCELLED with its transcript kept, its outcome in ``outcomes``), then
        ``_BatchCancelled`` names the first record not started."""
        tasks: list[asyncio.Future[None]] = []
        stop: TaskRecord | None = None
        try:
            for rec in records:
                await workflow.wait_condition(lambda: self._running < self._window)
                # patched: a run recorded before this check started every record it read
                if (tasks and self._history_full(inp)
                        and workflow.patched(HISTORY_BUDGET_PATCH)):
                    stop = rec
                    workflow.logger.info("batch run's history is full: going on from "
                                         "line %d in a new run", rec.line)
                    break
                if ask_quota and workflow.patched(QUOTA_PATCH):
                    await self._claim_slot(inp, rec)
                self._running += 1
                tasks.append(asyncio.ensure_future(self._one(inp, rec, outcomes)))
            if workflow.patched(RERUN_PATCH):
                # waited for, not gathered: a cancel landing here leaves the jobs as they
                # are, so the handler below sees which ones the cancel stops (a cancelled
                # gather cancels them itself and returns only once they have all ended)
                await workflow.wait_condition(lambda: all(t.done() for t in tasks))
            await asyncio.gather(*tasks)
        except asyncio.CancelledError:
            if not workflow.patched(CANCEL_PATCH):
                raise
            interrupted = [rec for rec, t in zip(records, tasks, strict=False) if not t.done()]
            for t in tasks:  # a child's await sends its job the cancel, then waits for it
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            unstarted = records[len(tasks)] if len(tasks) < len(records) else None
            raise _BatchCancelled(unstarted, interrupted) from None
        return stop

    async def _claim_slot(self, inp: BatchInput, rec: TaskRecord) -> None:
        """Wait until the tenant's quota lets the record's job start (``claim_job_slot``,
        on the agent workers: a slot under ``max_jobs_in_flight``, tokens left this
        hour). Records claim one at a time, in order, so a cancel while one waits leaves
        it and those after it unstarted (``_run_window``: the batch resumes from it)."""
        self._waiting_for_quota = True
        try:
            await workflow.execute_activity(
                "claim_job_slot",
                JobSlotRequest(tenant=inp.tenant, workflow_id=self._job_id(rec)),
                start_to_close_timeout=SLOT_TIMEOUT, retry_policy=SLOT_RETRY,
                task_queue=AGENT_TASK_QUEUE, result_type=JobSlotGranted)
        except ActivityError as e:
            if _is_cancel(e):
                raise asyncio.CancelledError from None
            raise
        finally:
            self._waiting_for_quota = False

    def _job_id(self, rec: TaskRecord) -> str:
        return f"{self._batch_id}-L{rec.line}"

    async def _one(self, inp: BatchInput, rec: TaskRecord,
                   outcomes: list[RecordOutcome]) -> None:
        try:
            outcomes.append(await self._child(inp, rec))
        finally:
            self._running -= 1
            self._remaining -= 1
            self._adapt(inp)

    async def _child(self, inp: BatchInput, rec: TaskRecord) -> RecordOutcome:
        job_id = self._job_id(rec)
        job = JobInput(profile=inp.profile, task=rec.task, max_steps=inp.max_steps,
                       lane=Lane.BATCH, tools=inp.tools, tenant=inp.tenant,
                       submitted_by=inp.submitted_by)
        try:
            handle = await self._start_child(job, job_id, inp.tenant)
        except WorkflowAlreadyStartedError:
            self._carry.failed += 1
            return in_use_outcome(rec.line, job_id)
        try:
            res: BatchChildResult = await handle
        except ChildWorkflowError as e:
            self._carry.failed += 1
            return failed_outcome(rec.line, job_id, e)
        u = res.usage
        self._carry.done += 1
        self._carry.cost_usd += u.cost_usd
        self._carry.cost_unknown_steps += u.cost_unknown_steps
        self._carry.prompt_tokens += u.prompt_tokens
        self._carry.cached_tokens += u.cached_tokens
        return job_outcome(rec.line, job_id, res)


    async def _start_child(self, job: JobInput, job_id: str, tenant: str
                           ) -> workflow.ChildWorkflowHandle[Any, BatchChildResult]:
        """Start the record's job; its handle, whose await is its result.

        The batch cancelled while the start is under way: the start goes on (the job
        may be started already, and cancelling the start would leave its outcome
        unknown), then the job is cancelled, so its outcome is its own (CANCELLED, its
        transcript kept) like every running job's."""
        start = workflow.start_child_workflow(
            AGENT_JOB, job, id=job_id, task_queue=AGENT_TASK_QUEUE,
            # a batch terminated, not cancelled: its jobs still end CANCELLED, their
            # transcripts kept (terminated, they would keep nothing)
            parent_close_policy=ParentClosePolicy.REQUEST_CANCEL,
            result_type=BatchChildResult,
            # tagged as start_job tags a submitted job: visibility counts it among its
            # tenant's jobs (the quota at submit, the inbox's lists)
            search_attributes=TypedSearchAttributes([SearchAttributePair(SA_TENANT, tenant)]),
        )
        if not workflow.patched(CANCEL_PATCH):
            return await start
        started = asyncio.ensure_future(start)
        try:
            return await asyncio.shield(started)
        except asyncio.CancelledError:
            handle = await started
            handle.cancel()
            return handle


class _BatchCancelled(Exception):
    """The batch was cancelled while its window ran: the running jobs ended (cancelled
    too), ``unstarted`` is the first record that never started (None: all did) and
    ``interrupted`` the records whose jobs were running then, in line order."""

    def __init__(self, unstarted: TaskRecord | None, interrupted: list[TaskRecord]) -> None:
        super().__init__("batch cancelled")
        self.unstarted = unstarted
        self.interrupted = interrupted


def _is_cancel(e: BaseException) -> bool:
    """Whether ``e`` is the workflow's cancellation (raised at an await, or an activity
    cancelled by it)."""
    if isinstance(e, asyncio.CancelledError | CancelledError):
        return True
    return isinstance(e, ActivityError) and isinstance(e.cause, CancelledError)


def _source_error(e: ActivityError, source: str) -> tuple[BatchState, str]:
    """The batch's ending for a read that failed for good, and its one-line reason."""
    cause: BaseException | None = e.cause
    while cause is not None and not isinstance(cause, ApplicationError):
        cause = cause.__cause__  # a timeout's cause is the last attempt's failure
    if isinstance(cause, ApplicationError):
        state = _SOURCE_ERRORS.get(cause.type or "", BatchState.SOURCE_UNAVAILABLE)
        return state, one_line(cause.message)
    return BatchState.SOURCE_UNAVAILABLE, one_line(
        f"cannot read {source}: {e.cause or e} (retried for {IO_RETRY_FOR})")


BatchInput.model_rebuild()
