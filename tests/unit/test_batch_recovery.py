"""``batch_recovery``: where a batch without a result goes on from, and a job that has
not ended yet (the whole read-back runs against Temporal in
``tests/workflow/test_batch_run.py`` and ``tests/integration/test_batch.py``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest
from temporalio.api.common.v1 import ActivityType, Payloads, WorkflowExecution
from temporalio.api.history import v1 as h
from temporalio.api.history.v1 import HistoryEvent
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.service import RPCError, RPCStatusCode

from warmloop.activities.batch_recovery import (
    JobGone,
    JobsStillStopping,
    StoppedPage,
    _ended_job,
    recovery_written,
    stopped_page,
)
from warmloop.workflows.batch_run import (
    BatchCarry,
    BatchChildResult,
    BatchInput,
    ReadPageResult,
    RecoverPageRequest,
    TaskRecord,
)


def _rec(line: int) -> TaskRecord:
    return TaskRecord(line=line, task={}, offset=line * 100)


def _page(**kw: Any) -> StoppedPage:
    read = ReadPageResult(records=[_rec(n) for n in (4, 5, 6, 7)], bad=[], next_line=8,
                          exhausted=False, next_offset=800)
    inp = BatchInput(profile="ticket-triage", source="s.jsonl",
                     carry=BatchCarry(next_line=4, next_offset=400, pages=2))
    return StoppedPage(inp=inp, page=3, read=read, **kw)


def test_a_run_is_on_the_page_after_those_its_carry_says_were_written() -> None:
    assert BatchInput(profile="ticket-triage", source="s.jsonl").pages_done == 0
    assert _page().inp.pages_done == 2  # so the stopped run was on page 3


def test_it_goes_on_from_the_first_stopped_or_unstarted_record() -> None:
    page = _page(stopped=[_rec(6)], unstarted=[_rec(7)])
    assert page.start() == (6, 600)
    assert page.start(rerun_stopped=False) == (7, 700)  # the stopped job keeps CANCELLED


def test_a_page_whose_jobs_all_ended_goes_on_after_it() -> None:
    assert _page().start() == (8, 800)


def test_a_page_never_read_goes_on_from_where_it_began() -> None:
    page = _page()
    page.read = None
    assert page.start() == (4, 400)


class _Hangs:
    """A job handle whose result never comes (a job that does not end)."""

    def get_workflow_handle(self, job_id: str, **_: Any) -> _Hangs:
        return self

    async def result(self) -> None:
        await asyncio.Event().wait()


async def test_a_job_that_has_not_ended_by_the_deadline_is_named() -> None:
    with pytest.raises(JobsStillStopping, match="job b-L3 has not ended yet"):
        await _ended_job(_Hangs(), 3, "b-L3", time.monotonic() - 1)  # type: ignore[arg-type]


# A stopped batch's last run as history events, read back through a fake client: the
# orders of events that a real server makes too rarely on cue for a test to wait for.

def _payloads(value: Any) -> Payloads:
    return Payloads(payloads=pydantic_data_converter.payload_converter.to_payloads([value]))


class _History:
    """Events of one batch run, numbered as they are added."""

    def __init__(self, inp: BatchInput) -> None:
        self.events: list[HistoryEvent] = []
        self.add(workflow_execution_started_event_attributes=(
            h.WorkflowExecutionStartedEventAttributes(input=_payloads(inp))))

    def add(self, **attrs: Any) -> int:
        self.events.append(HistoryEvent(event_id=len(self.events) + 1, **attrs))
        return len(self.events)

    def activity(self, name: str, given: Any, result: Any) -> None:
        at = self.add(activity_task_scheduled_event_attributes=(
            h.ActivityTaskScheduledEventAttributes(activity_type=ActivityType(name=name),
                                                   input=_payloads(given))))
        self.add(activity_task_completed_event_attributes=h.ActivityTaskCompletedEventAttributes(
            scheduled_event_id=at, result=_payloads(result)))

    def child(self, wid: str, *, started: bool = True,
              result: BatchChildResult | None = None) -> None:
        self.add(start_child_workflow_execution_initiated_event_attributes=(
            h.StartChildWorkflowExecutionInitiatedEventAttributes(workflow_id=wid)))
        if started:
            self.add(child_workflow_execution_started_event_attributes=(
                h.ChildWorkflowExecutionStartedEventAttributes(
                    workflow_execution=WorkflowExecution(workflow_id=wid))))
        if result is not None:
            self.add(child_workflow_execution_completed_event_attributes=(
                h.ChildWorkflowExecutionCompletedEventAttributes(
                    workflow_execution=WorkflowExecution(workflow_id=wid),
                    result=_payloads(result))))


class _Temporal:
    """A client whose batch has ``history`` and whose jobs end with ``results`` (a job
    not in it: Temporal does not know it)."""

    data_converter = pydantic_data_converter

    def __init__(self, history: _History, results: dict[str, BatchChildResult]) -> None:
        self.history, self.results = history, results

    def get_workflow_handle(self, wid: str, **_: Any) -> _Handle:
        return _Handle(self, wid)


class _Handle:
    def __init__(self, temporal: _Temporal, wid: str) -> None:
        self.temporal, self.wid = temporal, wid

    async def fetch_history(self) -> WorkflowHistory:
        return WorkflowHistory(self.wid, self.temporal.history.events)

    async def result(self) -> BatchChildResult:
        if self.wid not in self.temporal.results:
            raise RPCError("workflow not found", RPCStatusCode.NOT_FOUND, b"")
        return self.temporal.results[self.wid]


def _read(lines: int) -> ReadPageResult:
    return ReadPageResult(records=[_rec(n) for n in range(1, lines + 1)], bad=[],
                          next_line=lines + 1, exhausted=True, next_offset=(lines + 1) * 100)


def _ended(state: str) -> BatchChildResult:
    return BatchChildResult(state=state, transcript_key="t.json")


async def test_a_job_asked_for_but_never_started_is_run_by_the_resume() -> None:
    """The batch stopped between asking for a child and the server starting it: the
    server never starts it, so it is a record not started (not a job to wait for)."""
    history = _History(BatchInput(profile="ticket-triage", source="s.jsonl"))
    history.activity("read_records", {}, _read(2))
    history.child("b-L1")
    history.child("b-L2", started=False)
    found = await stopped_page(_Temporal(history, {"b-L1": _ended("FINISHED")}),  # type: ignore[arg-type]
                               "b")
    assert [(o.line, o.state) for o in found.outcomes] == [(1, "FINISHED")]
    assert [r.line for r in found.unstarted] == [2] and found.start() == (2, 200)


async def test_a_started_job_temporal_no_longer_knows_is_named() -> None:
    history = _History(BatchInput(profile="ticket-triage", source="s.jsonl"))
    history.activity("read_records", {}, _read(1))
    history.child("b-L1")
    with pytest.raises(JobGone, match="job b-L1 of batch b is not known"):
        await stopped_page(_Temporal(history, {}), "b")  # type: ignore[arg-type]


async def test_jobs_cancelled_after_the_batch_was_asked_to_cancel_run_again() -> None:
    """Cancelled, then terminated while its jobs wound down: the job that ended
    CANCELLED before the batch's cancel (a person cancelled it alone) keeps its
    outcome; the one that ended CANCELLED after it was the cancel's doing and runs
    again, as a cancelled batch would have named it; the one still running at the stop
    ended CANCELLED too and runs again."""
    history = _History(BatchInput(profile="ticket-triage", source="s.jsonl"))
    history.activity("read_records", {}, _read(3))
    history.child("b-L1", result=_ended("CANCELLED"))
    history.add(workflow_execution_cancel_requested_event_attributes=(
        h.WorkflowExecutionCancelRequestedEventAttributes()))
    history.child("b-L2", result=_ended("CANCELLED"))
    history.child("b-L3")
    found = await stopped_page(_Temporal(history, {"b-L3": _ended("CANCELLED")}),  # type: ignore[arg-type]
                               "b")
    assert [(o.line, o.state) for o in found.outcomes] == [
        (1, "CANCELLED"), (2, "CANCELLED"), (3, "CANCELLED")]
    assert [r.line for r in found.stopped] == [2, 3] and not found.recovery_written


async def test_a_run_that_wrote_its_recovered_page_says_so() -> None:
    """A resume of it does not pass that page on (written once; past retention, writing
    it again would fail every later resume)."""
    recover = RecoverPageRequest(batch_id="a", page=2)
    history = _History(BatchInput(profile="ticket-triage", source="s.jsonl", recover=recover))
    history.activity("write_recovered_page", recover, "page-key")
    found = await stopped_page(_Temporal(history, {}), "b")  # type: ignore[arg-type]
    assert found.read is None and found.recovery_written
    assert recovery_written(history.events)
