"""``batch_recovery``: where a batch without a result goes on from, and a job that has
not ended yet (the whole read-back runs against Temporal in
``tests/workflow/test_batch_run.py`` and ``tests/integration/test_batch.py``)."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from warmloop.activities.batch_recovery import JobsStillStopping, StoppedPage, _ended_job
from warmloop.workflows.batch_run import BatchCarry, BatchInput, ReadPageResult, TaskRecord


def _rec(line: int) -> TaskRecord:
    return TaskRecord(line=line, task={}, offset=line * 100)


def _page(**kw: Any) -> StoppedPage:
    read = ReadPageResult(records=[_rec(n) for n in (4, 5, 6, 7)], bad=[], next_line=8,
                          exhausted=False, next_offset=800)
    inp = BatchInput(profile="ticket-triage", source="s.jsonl",
                     carry=BatchCarry(next_line=4, next_offset=400, pages=2))
    return StoppedPage(inp=inp, page=3, read=read, **kw)


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
