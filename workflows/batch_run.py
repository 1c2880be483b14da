"""``BatchRun``: a file of task records run as child ``AgentJob``s in the batch lane.

One page of records per workflow run: read the page (bad lines are reported with
their line numbers and skipped), run its records as child jobs in a sliding window,
write the page's outcomes as JSONL to S3, then continue-as-new for the next page, so
a 100,000-record batch keeps a small history. A failing record never fails the
batch: it is listed with its reason.
"""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta
from typing import Any

from pydantic import BaseModel, ConfigDict, Field
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ChildWorkflowError
from temporalio.workflow import ParentClosePolicy

from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput, JobResult, Lane
from warmloop.workflows.lanes import adapt_window, estimate_finish_s

READ_TIMEOUT = timedelta(minutes=2)


class BatchInput(BaseModel):
    """Input of one ``BatchRun``."""

    model_config = ConfigDict(extra="forbid")

    profile: str = Field(min_length=1)
    source: str = Field(min_length=1, description="s3://bucket/key.jsonl, or a JSONL path "
                        "readable by the agent workers.")
    window: int = Field(default=4, ge=1, le=1024, description="Child jobs running at once "
                        "(the start; a deadline may widen it).")
    deadline: datetime | None = Field(
        default=None, description="Finish by then: the window widens (up to max_window) "
        "when the pace so far would miss it, and narrows back when well ahead.")
    max_window: int = Field(default=64, ge=1, le=4096,
                            description="The fleet's batch capacity: the widest window.")
    tools: list[str] | None = Field(default=None, min_length=1,
                                    description="Offer only these tools to every job.")
    page_size: int = Field(default=100, ge=1, le=10_000,
                           description="Records per workflow run (continue-as-new between).")
    max_steps: int | None = Field(default=None, ge=1, le=10_000)
    carry: BatchCarry | None = None
    """Internal: counters carried across continue-as-new."""


class RecordOutcome(BaseModel):
    """One record's fate: a child job's end state, or why the record was skipped."""

    line: int
    job_id: str | None
    state: str
    """A JobState value, BAD_RECORD (invalid JSON or schema) or FAILED (the child failed)."""
    reason: str
    cost_usd: float = 0.0


class BatchCarry(BaseModel):
    next_line: int = 1
    pages: int = 0
    done: int = 0
    failed: int = 0
    bad: int = 0
    cost_usd: float = 0.0
    started_at: datetime | None = None
    result_keys: list[str] = Field(default_factory=list)
    window: int | None = None
    """The window as last adapted to the deadline."""
    by_state: dict[str, int] = Field(default_factory=dict)
    prompt_tokens: int = 0
    cached_tokens: int = 0


class ReadPageRequest(BaseModel):
    source: str
    profile: str
    first_line: int = Field(ge=1)
    limit: int = Field(ge=1)


class TaskRecord(BaseModel):
    line: int
    task: dict[str, Any]


class ReadPageResult(BaseModel):
    records: list[TaskRecord]
    bad: list[RecordOutcome]
    next_line: int
    exhausted: bool
    remaining_lines: int = 0
    """Non-blank lines after this page: with the page, what the batch has left."""


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
    window: int
    """Child jobs allowed at once now (adapted to the deadline)."""
    remaining: int
    """Records not finished yet, this page's and the source's after it."""
    estimated_finish: datetime | None = None
    """At the pace so far; None before the first record finishes."""
    deadline: datetime | None = None


class BatchResult(BaseModel):
    batch_id: str
    profile: str
    records: int
    done: int
    """Records whose job ended in a named state (FINISHED, LOOP_CAP, ...)."""
    failed: int
    """Records whose job failed as a workflow (never expected; listed with the reason)."""
    bad: int
    """Lines skipped: invalid JSON or a task that fails the profile's schema."""
    cost_usd: float
    result_keys: list[str]
    makespan_s: float
    by_state: dict[str, int] = Field(default_factory=dict)
    """Records by outcome: each JobState, BAD_RECORD and FAILED."""
    cache_hit_share: float = 0.0
    """Prompt tokens the engines served from their prefix caches, over all jobs."""



@workflow.defn
class BatchRun:
    def __init__(self) -> None:
        self._carry = BatchCarry()
        self._running = 0
        self._batch_id = ""
        self._window = 1
        self._remaining = 0
        self._deadline: datetime | None = None

    @workflow.query
    def progress(self) -> BatchProgress:
        c = self._carry
        eta = self._eta_s()
        return BatchProgress(
            batch_id=self._batch_id, done=c.done, failed=c.failed, bad=c.bad,
            running=self._running, cost_usd=c.cost_usd, pages=c.pages, window=self._window,
            remaining=self._remaining, deadline=self._deadline,
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
        new = adapt_window(self._window, base=inp.window, max_window=inp.max_window,
                           remaining=self._remaining, seconds_per_record=pace, seconds_left=left)
        if new != self._window:
            workflow.logger.info("batch window %d -> %d for the deadline", self._window, new)
            self._window = c.window = new

    @workflow.run
    async def run(self, inp: BatchInput) -> BatchResult:
        info = workflow.info()
        # The id of the first run names the batch across continue-as-new.
        self._batch_id = info.workflow_id
        self._carry = inp.carry or BatchCarry(started_at=workflow.now())
        c = self._carry
        self._deadline = inp.deadline
        self._window = c.window or min(inp.window, inp.max_window)
        page = await workflow.execute_activity(
            "read_records",
            ReadPageRequest(source=inp.source, profile=inp.profile, first_line=c.next_line,
                            limit=inp.page_size),
            start_to_close_timeout=READ_TIMEOUT, task_queue=AGENT_TASK_QUEUE,
            retry_policy=RetryPolicy(maximum_attempts=5), result_type=ReadPageResult,
        )
        self._remaining = len(page.records) + page.remaining_lines
        outcomes = list(page.bad) + await self._run_window(inp, page.records)
        outcomes.sort(key=lambda o: o.line)
        for o in outcomes:
            c.by_state[o.state] = c.by_state.get(o.state, 0) + 1
        c.pages += 1
        key = await workflow.execute_activity(
            "write_batch_results",
            WritePageRequest(batch_id=self._batch_id, page=c.pages, outcomes=outcomes),
            start_to_close_timeout=READ_TIMEOUT, task_queue=AGENT_TASK_QUEUE,
            retry_policy=RetryPolicy(maximum_attempts=5), result_type=str,
        )
        c.result_keys.append(key)
        c.bad += len(page.bad)
        c.next_line = page.next_line
        if not page.exhausted:
            workflow.continue_as_new(inp.model_copy(update={"carry": c}))
        started = c.started_at or workflow.now()
        return BatchResult(
            batch_id=self._batch_id, profile=inp.profile, records=c.done + c.failed + c.bad,
            done=c.done, failed=c.failed, bad=c.bad, cost_usd=c.cost_usd,
            result_keys=c.result_keys, makespan_s=(workflow.now() - started).total_seconds(),
            by_state=dict(sorted(c.by_state.items())),
            cache_hit_share=c.cached_tokens / c.prompt_tokens if c.prompt_tokens else 0.0,
        )

    async def _run_window(self, inp: BatchInput, records: list[TaskRecord]
                          ) -> list[RecordOutcome]:
        """Run ``records`` as child jobs, at most ``self._window`` at a time (in order)."""
        outcomes: list[RecordOutcome] = []
        tasks = []
        for rec in records:
            await workflow.wait_condition(lambda: self._running < self._window)
            self._running += 1
            tasks.append(asyncio.ensure_future(self._one(inp, rec, outcomes)))
        await asyncio.gather(*tasks)
        return outcomes

    async def _one(self, inp: BatchInput, rec: TaskRecord,
                   outcomes: list[RecordOutcome]) -> None:
        try:
            outcomes.append(await self._child(inp, rec))
        finally:
            self._running -= 1
            self._remaining -= 1
            self._adapt(inp)

    async def _child(self, inp: BatchInput, rec: TaskRecord) -> RecordOutcome:
        job_id = f"{self._batch_id}-L{rec.line}"
        job = JobInput(profile=inp.profile, task=rec.task, max_steps=inp.max_steps,
                       lane=Lane.BATCH, tools=inp.tools)
        try:
            res: JobResult = await workflow.execute_child_workflow(
                AgentJob.run, job, id=job_id, task_queue=AGENT_TASK_QUEUE,
                parent_close_policy=ParentClosePolicy.TERMINATE,
            )
        except ChildWorkflowError as e:
            self._carry.failed += 1
            return RecordOutcome(line=rec.line, job_id=job_id, state="FAILED",
                                 reason=str(e.cause or e))
        self._carry.done += 1
        self._carry.cost_usd += res.usage.cost_usd
        self._carry.prompt_tokens += res.usage.prompt_tokens
        self._carry.cached_tokens += res.usage.cached_tokens
        return RecordOutcome(line=rec.line, job_id=job_id, state=res.state.value,
                             reason=res.reason, cost_usd=res.usage.cost_usd)


BatchInput.model_rebuild()
