"""BatchRun on the time-skipping server: scripted model steps, the real batch I/O
activities over a local JSONL file and an in-memory S3 stand-in."""

from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any

import pytest
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflow.fakes import FakeActivities, reply
from warmloop.activities.batch import BatchActivities
from warmloop.workers.temporal_plugin import sandbox_runner
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.batch_run import BatchInput, BatchRun, RecordOutcome
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, engine_task_queue

GOOD = {"ticket_id": "T1001", "customer_id": "C100", "subject": "s", "body": "b"}


class MemoryS3:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put_object(self, *, Bucket: str, Key: str, Body: bytes, **_: Any) -> None:  # noqa: N803
        self.objects[Key] = Body


def write_records(path: Path, n_good: int, bad_at: dict[int, str]) -> None:
    """n_good valid tickets; at the 1-based line numbers in bad_at, the given text."""
    lines, i = [], 0
    total = n_good + len(bad_at)
    for line in range(1, total + 1):
        if line in bad_at:
            lines.append(bad_at[line])
        else:
            lines.append(json.dumps({**GOOD, "ticket_id": f"T{2000 + i}"}))
            i += 1
    path.write_text("\n".join(lines) + "\n")


async def run_batch(env: WorkflowEnvironment, inp: BatchInput,
                    *, keep_history: list[Any] | None = None, batch_id: str | None = None
                    ) -> tuple[Any, MemoryS3, FakeActivities]:
    fakes = FakeActivities(lambda req: reply("finish", '{"resolution": "resolved", '
                                                       '"priority": "low"}'))
    s3 = MemoryS3()
    batch = BatchActivities(s3, "b")
    client = env.client
    async with (
        Worker(client, task_queue=AGENT_TASK_QUEUE, workflow_runner=sandbox_runner(),
                   workflows=[AgentJob, BatchRun],
               activities=[fakes.route_step, fakes.pick_engine, fakes.record_pause,
                           fakes.run_tool, fakes.store_transcript, batch.read_records,
                           batch.write_batch_results]),
        Worker(client, task_queue=engine_task_queue("fake0"),
               activities=[fakes.generate, fakes.prewarm]),
    ):
        bid = batch_id or f"batch-{uuid.uuid4().hex[:6]}"
        res = await client.execute_workflow(BatchRun.run, inp, id=bid,
                                            task_queue=AGENT_TASK_QUEUE)
        if keep_history is not None:
            keep_history.append(await client.get_workflow_handle(bid).fetch_history())
    return res, s3, fakes


def outcomes(s3: MemoryS3) -> list[RecordOutcome]:
    return [RecordOutcome.model_validate_json(line) for key in sorted(s3.objects)
            for line in s3.objects[key].decode().splitlines()]


async def test_bad_lines_are_reported_by_line_number_and_the_rest_finish(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    src = tmp_path / "tickets.jsonl"
    write_records(src, 5, {2: "{not json", 4: json.dumps({**GOOD, "ticket_id": "bad"}),
                           6: "[1, 2]"})
    res, s3, fakes = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=2))
    assert (res.records, res.done, res.bad, res.failed) == (8, 5, 3, 0)
    by_line = {o.line: o for o in outcomes(s3)}
    assert sorted(by_line) == list(range(1, 9))
    assert by_line[2].state == "BAD_RECORD" and "invalid JSON" in by_line[2].reason
    assert by_line[4].state == "BAD_RECORD" and "ticket_id" in by_line[4].reason
    assert by_line[6].state == "BAD_RECORD" and "not a JSON object" in by_line[6].reason
    assert all(by_line[n].state == "FINISHED" for n in (1, 3, 5, 7, 8))
    # batch jobs ran in the batch lane: behind interactive steps in the engine's queue
    assert len(fakes.generate_requests) == 5
    assert {r.priority for r in fakes.generate_requests} == {10}


async def test_a_batch_larger_than_a_page_continues_as_new_and_counts_each_record_once(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    src = tmp_path / "tickets.jsonl"
    write_records(src, 23, {10: "oops"})
    res, s3, fakes = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=3, page_size=5))
    assert res.records == 24 and res.done == 23 and res.bad == 1
    assert len(res.result_keys) == 5  # ceil(24 / 5) pages, one run each
    lines = [o.line for o in outcomes(s3)]
    assert sorted(lines) == list(range(1, 25)) and len(set(lines)) == 24
    job_ids = [o.job_id for o in outcomes(s3) if o.job_id]
    assert len(set(job_ids)) == 23
    assert len({r.job_id for r in fakes.generate_requests}) == 23  # each record ran once


async def test_a_missing_source_fails_the_batch_with_a_clear_reason(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    from temporalio.client import WorkflowFailureError

    with pytest.raises(WorkflowFailureError) as err:
        await run_batch(time_skipping_env, BatchInput(profile="ticket-triage",
                                                      source=str(tmp_path / "absent.jsonl")))
    activity_error = err.value.cause
    assert activity_error is not None and "cannot read" in str(activity_error.__cause__)
