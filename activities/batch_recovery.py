"""What a batch that ended without a result (terminated, failed, timed out) left done.

A batch writes a page's outcomes once the page's jobs have all ended, and says where it
stopped in its result; a batch terminated in the middle of a page does neither. What it
did is still Temporal's: its last run's history holds the page it read (the
``read_records`` result, whose records carry their byte offsets), the jobs it started
and those that ended before it stopped, and its parent-close policy asked the jobs still
running to cancel, so each ends CANCELLED on its own, its result Temporal's.
``stopped_page`` reads that back: the page's outcomes as the batch would have written
them, the jobs its stop cut short and the records it never started.
``warmloop batch resume`` goes on from there, and the new batch's first act writes those
outcomes as the old batch's page (``BatchActivities.write_recovered_page``), so no
finished job runs twice and none of their outcomes is lost.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field

from temporalio.api.common.v1 import Payloads
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import Client, WorkflowFailureError
from temporalio.exceptions import CancelledError, TerminatedError
from temporalio.service import RPCError, RPCStatusCode

from warmloop.workflows.batch_run import (
    BatchCarry,
    BatchChildResult,
    BatchInput,
    ReadPageResult,
    RecordOutcome,
    TaskRecord,
    WritePageRequest,
    failed_outcome,
    in_use_outcome,
    job_outcome,
)
from warmloop.workflows.contracts import JobState

STOPPING_WAIT_S = 60.0
"""How long to wait, in all, for the jobs a stopped batch asked to cancel to end (a job
cancelled while it waits for a human or a tool ends within seconds)."""


RECOVER_ACTIVITY = "write_recovered_page"


class JobGone(Exception):
    """A job the stopped batch started is not known to Temporal any more (past the
    namespace's retention): the page's outcomes cannot all be read back."""


class JobsStillStopping(Exception):
    """A job of the stopped page had not ended within the wait: its outcome is unknown
    yet (try again once it has ended, or cancel it)."""


@dataclass
class StoppedPage:
    """Where a batch without a result stopped, read back from Temporal: the new batch
    starts from ``stopped`` and ``unstarted`` (the first by line), skipping the lines
    that have ``outcomes``."""

    inp: BatchInput
    """The last run's input (its ``carry`` says where the page began)."""
    page: int
    """The page's number in the old batch (its pages written so far, plus one)."""
    read: ReadPageResult | None
    """The page as the run read it, less its ``skip_lines``; None: the run stopped before
    its page was read (nothing of it ran)."""
    written: bool = False
    """The run wrote the page's outcomes before it stopped (nothing to recover)."""
    outcomes: list[RecordOutcome] = field(default_factory=list)
    """The page's lines that have an outcome, in line order: the ended jobs (those the
    stop cut short too, CANCELLED, as a cancelled batch writes them) and the bad lines
    before the first record not started."""
    stopped: list[TaskRecord] = field(default_factory=list)
    """Records whose jobs were running when the batch stopped and ended CANCELLED (the
    stop's doing: a resume runs them again, as it runs a cancelled batch's)."""
    unstarted: list[TaskRecord] = field(default_factory=list)
    """Records of the page whose jobs never started."""
    recovery_written: bool = False
    """The run wrote the page its own input asked it to recover (``BatchInput.recover``):
    a resume of this batch need not pass that page on."""

    def start(self, *, rerun_stopped: bool = True) -> tuple[int, int]:
        """The line and byte offset the page's unfinished part begins at: the first of
        the records not started and (``rerun_stopped``) of those the stop cut short;
        past the page when everything in it ended."""
        first = min([*(self.stopped if rerun_stopped else []), *self.unstarted],
                    key=lambda r: r.line, default=None)
        if first is not None:
            return first.line, first.offset
        if self.read is None:
            c = self.inp.carry or BatchCarry(next_line=self.inp.start_line,
                                             next_offset=self.inp.start_offset)
            return c.next_line, c.next_offset
        return self.read.next_line, self.read.next_offset


def completed_activities(events: Sequence[HistoryEvent]
                         ) -> Iterator[tuple[str, Payloads, Payloads]]:
    """A run's completed activities, in order: (activity type, input, result)."""
    scheduled: dict[int, tuple[str, Payloads]] = {}
    for ev in events:
        if ev.HasField("activity_task_scheduled_event_attributes"):
            a = ev.activity_task_scheduled_event_attributes
            scheduled[ev.event_id] = (a.activity_type.name, a.input)
        elif ev.HasField("activity_task_completed_event_attributes"):
            done = ev.activity_task_completed_event_attributes
            name, given = scheduled.get(done.scheduled_event_id, ("", Payloads()))
            yield name, given, done.result


def recovery_written(events: Sequence[HistoryEvent]) -> bool:
    """Whether a batch run's history (``events``) shows the page its input asked it to
    recover (``BatchInput.recover``) written."""
    return any(name == RECOVER_ACTIVITY for name, _, _ in completed_activities(events))


async def run_input(client: Client, events: Sequence[HistoryEvent]) -> BatchInput:
    """A batch run's input, from its history's first event (a run that continued as
    new from another carries its ``carry``)."""
    started = events[0].workflow_execution_started_event_attributes
    [inp] = await client.data_converter.decode(started.input.payloads, [BatchInput])
    return inp


async def stopped_page(client: Client, batch_id: str, *,
                       wait_s: float = STOPPING_WAIT_S) -> StoppedPage:
    """Read back the page ``batch_id`` (its workflow id) was on when it stopped.

    Waits up to ``wait_s`` in all for the page's jobs still running (asked to cancel by
    the stop) to end; raises ``JobsStillStopping`` past it, and ``JobGone`` for a job
    the batch started that Temporal no longer knows. Reads the last run's history (a
    page's worth of events) and the results of the jobs that ended after the stop."""
    events = list((await client.get_workflow_handle(batch_id).fetch_history()).events)
    decode = client.data_converter.decode
    inp = await run_input(client, events)
    read: ReadPageResult | None = None
    written: WritePageRequest | None = None
    for name, given, result in completed_activities(events):
        if name == "read_records":
            [read] = await decode(result.payloads, [ReadPageResult])
        elif name == "write_batch_results":
            [written] = await decode(given.payloads, [WritePageRequest])
    initiated: set[str] = set()
    began: set[str] = set()
    in_use: set[str] = set()
    cancel_asked: int | None = None
    ended_before: dict[str, tuple[int, RecordOutcome | BatchChildResult, bool]] = {}
    """Jobs whose end reached the batch before it stopped: the event's id, the job's
    result (or, failed as a workflow, its outcome), and whether it was stopped (ended
    CANCELLED, or cancelled or terminated as a workflow). Final, a stopped one too (a
    person cancelled that job alone), unless it ended after the batch was asked to
    cancel (the cancel's doing: run again, as a cancelled batch names it)."""
    for ev in events:
        if ev.HasField("workflow_execution_cancel_requested_event_attributes"):
            cancel_asked = cancel_asked or ev.event_id
        elif ev.HasField("start_child_workflow_execution_initiated_event_attributes"):
            initiated.add(ev.start_child_workflow_execution_initiated_event_attributes
                          .workflow_id)
        elif ev.HasField("child_workflow_execution_started_event_attributes"):
            began.add(ev.child_workflow_execution_started_event_attributes
                      .workflow_execution.workflow_id)
        elif ev.HasField("start_child_workflow_execution_failed_event_attributes"):
            in_use.add(ev.start_child_workflow_execution_failed_event_attributes.workflow_id)
        elif ev.HasField("child_workflow_execution_completed_event_attributes"):
            c = ev.child_workflow_execution_completed_event_attributes
            [res] = await decode(c.result.payloads, [BatchChildResult])
            ended_before[c.workflow_execution.workflow_id] = (
                ev.event_id, res, res.state == JobState.CANCELLED)
        else:
            for kind in ("failed", "canceled", "terminated", "timed_out"):
                attr = f"child_workflow_execution_{kind}_event_attributes"
                if ev.HasField(attr):  # type: ignore[arg-type]
                    a = getattr(ev, attr)
                    why = a.failure.message if kind == "failed" else kind.replace("_", " ")
                    wid = a.workflow_execution.workflow_id
                    ended_before[wid] = (ev.event_id, failed_outcome(0, wid, Exception(why)),
                                         kind in ("canceled", "terminated"))
    found = StoppedPage(inp=inp, page=inp.pages_done + 1, read=None,
                        recovery_written=recovery_written(events))
    if read is None:
        return found
    read = found.read = read.without_lines(inp.skip_lines)  # as the run filtered its page
    if written is not None:
        found.written = True
        found.outcomes = sorted(written.outcomes, key=lambda o: o.line)
        have = {o.line for o in written.outcomes}
        found.unstarted = [r for r in read.records if r.line not in have]
        return found
    deadline = time.monotonic() + wait_s
    outcomes: list[RecordOutcome] = []
    for rec in read.records:
        job_id = f"{batch_id}-L{rec.line}"
        if job_id in in_use:
            outcomes.append(in_use_outcome(rec.line, job_id))
            continue
        if job_id in ended_before:
            at, res, stopped = ended_before[job_id]
            outcome = (job_outcome(rec.line, job_id, res) if isinstance(res, BatchChildResult)
                       else res.model_copy(update={"line": rec.line}))
            cut_short = stopped and cancel_asked is not None and at > cancel_asked
        elif job_id not in initiated:
            found.unstarted.append(rec)
            continue
        else:
            try:
                outcome, cut_short = await _ended_job(client, rec.line, job_id, deadline)
            except RPCError as e:
                if e.status != RPCStatusCode.NOT_FOUND:
                    raise
                if job_id not in began:  # asked for, never started: the batch stopped first
                    found.unstarted.append(rec)
                    continue
                raise JobGone(f"job {job_id} of batch {batch_id} is not known to Temporal "
                              "any more (past its retention?): its outcome cannot be "
                              "read back") from None
        outcomes.append(outcome)
        if cut_short:
            found.stopped.append(rec)
    # bad lines after a record that never started are the next batch's to report
    first_unstarted = min((r.line for r in found.unstarted), default=None)
    outcomes += [b for b in read.bad if first_unstarted is None or b.line < first_unstarted]
    found.outcomes = sorted(outcomes, key=lambda o: o.line)
    return found


async def _ended_job(client: Client, line: int, job_id: str, deadline: float
                     ) -> tuple[RecordOutcome, bool]:
    """The outcome of a started job once it has ended (until ``deadline``), and whether
    the batch's stop cut it short (it ended CANCELLED, or cancelled or terminated as a
    workflow: a batch from before its jobs were asked to cancel terminated them)."""
    job = client.get_workflow_handle(job_id, result_type=BatchChildResult)
    try:
        # an ended job answers at once: a floor, so one past the deadline is still read
        res = await asyncio.wait_for(job.result(), max(2.0, deadline - time.monotonic()))
    except WorkflowFailureError as e:  # failed, terminated or timed out as a workflow
        return (failed_outcome(line, job_id, e),
                isinstance(e.cause, TerminatedError | CancelledError))
    except TimeoutError:
        raise JobsStillStopping(f"job {job_id} has not ended yet (its batch asked it to "
                                "cancel when it stopped); try again once it has, or "
                                "cancel it") from None
    return job_outcome(line, job_id, res), res.state == JobState.CANCELLED
