"""BatchRun on the time-skipping server: scripted model steps, the real batch I/O
activities over a local JSONL file and an in-memory S3 stand-in."""

from __future__ import annotations

import asyncio
import contextlib
import io
import json
import os
import uuid
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio import activity
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer, Worker

from tests.workflow.fakes import FakeActivities, reply
from warmloop.activities.batch import BatchActivities
from warmloop.workers.temporal_plugin import sandbox_runner
from warmloop.workflows import batch_run
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.batch_run import (
    BatchInput,
    BatchRun,
    RecordOutcome,
    RecoverPageRequest,
    page_key,
)
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    GenerateRequest,
    GenerateResult,
    engine_task_queue,
)
from warmloop.workflows.lanes import DEFAULT_BATCH_WINDOW, BatchWindow, BatchWindowRequest
from warmloop.workflows.tenants import (
    TENANT_SLOT_WAIT,
    JobSlotGranted,
    JobSlotRequest,
    TenantQuota,
)

GOOD = {"ticket_id": "T1001", "customer_id": "C100", "subject": "s", "body": "b"}


class CountingBody:
    """An S3 object's streaming body that counts what was read from it."""

    def __init__(self, data: bytes, s3: MemoryS3) -> None:
        self._stream = io.BytesIO(data)
        self._s3 = s3

    def read(self, n: int = -1) -> bytes:
        out = self._stream.read(n)
        self._s3.bytes_read += len(out)
        return out

    def close(self) -> None:
        self._stream.close()


class MemoryS3:
    """In-memory S3: result pages in ``objects`` (by key), batch sources in ``sources``
    (by "bucket/key"); ``down_for`` reads fail as if the endpoint were unreachable."""

    def __init__(self, sources: dict[str, bytes] | None = None, *, down_for: int = 0) -> None:
        self.objects: dict[str, bytes] = {}
        self.sources = dict(sources or {})
        self.down_for = down_for
        self.reads = 0
        self.bytes_read = 0

    def put_object(self, *, Bucket: str, Key: str, Body: bytes, **_: Any) -> None:  # noqa: N803
        self.objects[Key] = Body

    def get_object(self, *, Bucket: str, Key: str, Range: str | None = None,  # noqa: N803
                   **_: Any) -> dict[str, Any]:
        from botocore.exceptions import ClientError, EndpointConnectionError

        self.reads += 1
        if self.down_for > 0:
            self.down_for -= 1
            raise EndpointConnectionError(endpoint_url="http://s3.invalid")
        data = self.sources.get(f"{Bucket}/{Key}")
        if data is None:
            raise ClientError({"Error": {"Code": "NoSuchKey", "Message": "no such key"}},
                              "GetObject")
        start = 0 if Range is None else int(Range.removeprefix("bytes=").split("-")[0])
        if Range is not None and start >= len(data):
            raise ClientError({"Error": {"Code": "InvalidRange", "Message": "bad range"}},
                              "GetObject")
        part = data[start:]
        out: dict[str, Any] = {"Body": CountingBody(part, self), "ContentLength": len(part)}
        if Range is not None:
            out["ContentRange"] = f"bytes {start}-{len(data) - 1}/{len(data)}"
        return out


ONE_SLOT = {"acme": TenantQuota(max_jobs_in_flight=1)}
"""The agent workers' quotas in the slot tests: acme has one job slot."""


class SlotGate:
    """``claim_job_slot`` as the agent workers serve it, scripted: the first ``refuse``
    attempts are refused as a tenant at its quota is (``TENANT_SLOT_WAIT``, retried after
    ``delay_s``), the rest granted; ``refuse=-1`` refuses every attempt. Each attempt's
    workflow id is kept in order."""

    def __init__(self, refuse: int = 0, delay_s: float = 30.0) -> None:
        self.refuse = refuse
        self.delay_s = delay_s
        self.attempts: list[str] = []
        self.waiting = asyncio.Event()
        """Set at the first refusal."""

    @activity.defn(name="claim_job_slot")
    async def claim_job_slot(self, req: JobSlotRequest) -> JobSlotGranted:
        self.attempts.append(req.workflow_id)
        if self.refuse < 0 or len(self.attempts) <= self.refuse:
            self.waiting.set()
            raise ApplicationError(
                f"tenant {req.tenant} has 1 jobs running, its max_jobs_in_flight quota is 1",
                type=TENANT_SLOT_WAIT, next_retry_delay=timedelta(seconds=self.delay_s))
        return JobSlotGranted(in_flight=0)


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


@contextlib.asynccontextmanager
async def batch_workers(env: WorkflowEnvironment, fakes: FakeActivities,
                        s3: MemoryS3, slots: SlotGate | None = None,
                        quotas: dict[str, TenantQuota] | None = None) -> AsyncIterator[Any]:
    """An agent worker (AgentJob, BatchRun, the batch I/O activities over ``s3`` with
    the tenants' ``quotas``, the job-slot claims of ``slots``: a gate that grants every
    claim if None) and the engine fake0's worker; yields the client."""
    batch = BatchActivities(s3, "b", quotas=quotas)
    slots = slots or SlotGate()
    client = env.client
    async with (
        Worker(client, task_queue=AGENT_TASK_QUEUE, workflow_runner=sandbox_runner(),
               workflows=[AgentJob, BatchRun],
               activities=[fakes.route_step, fakes.pick_engine, fakes.record_pause,
                           fakes.engine_alive, fakes.batch_window,
                           fakes.run_tool, fakes.store_transcript, batch.read_records,
                           batch.write_batch_results, batch.write_recovered_page,
                           slots.claim_job_slot]),
        Worker(client, task_queue=engine_task_queue("fake0"),
               activities=[fakes.generate, fakes.prewarm]),
    ):
        yield client


async def run_batch(env: WorkflowEnvironment, inp: BatchInput,
                    *, keep_history: list[Any] | None = None, batch_id: str | None = None,
                    s3: MemoryS3 | None = None, prices: dict[str, Any] | None = None,
                    windows: list[BatchWindow | None] | None = None,
                    slots: SlotGate | None = None,
                    quotas: dict[str, TenantQuota] | None = None,
                    ) -> tuple[Any, MemoryS3, FakeActivities]:
    """Run ``inp`` to its end; ``windows``: what the fleet answers a batch without a
    window, page by page (None: the activity fails)."""
    fakes = FakeActivities(lambda req: reply("finish", '{"resolution": "resolved", '
                                                       '"priority": "low"}'), prices=prices)
    fakes.windows = windows or []
    s3 = s3 or MemoryS3()
    async with batch_workers(env, fakes, s3, slots, quotas) as client:
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


async def test_a_missing_source_ends_the_batch_with_a_clear_reason(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    res, s3, _ = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(tmp_path / "absent.jsonl")))
    assert res.state == "SOURCE_MISSING" and "cannot read" in res.reason
    assert "\n" not in res.reason and res.records == 0 and not s3.objects


@pytest.mark.parametrize("source", ["/etc/passwd", "/dev/zero", "s3://b", "s3:///k.jsonl"])
async def test_a_source_outside_the_allowed_locations_ends_the_batch_refused(
    time_skipping_env: WorkflowEnvironment, source: str,
) -> None:
    res, _, _ = await run_batch(time_skipping_env, BatchInput(profile="ticket-triage",
                                                              source=source))
    assert res.state == "SOURCE_REFUSED" and res.records == 0
    assert res.reason and "\n" not in res.reason


async def test_a_minute_of_s3_downtime_is_retried_not_fatal(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    lines = [json.dumps({**GOOD, "ticket_id": f"T{3000 + i}"}) for i in range(3)]
    s3 = MemoryS3({"b/t.jsonl": ("\n".join(lines) + "\n").encode()}, down_for=8)
    res, _, _ = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source="s3://b/t.jsonl"), s3=s3)
    assert (res.state, res.done, res.bad) == ("COMPLETED", 3, 0)
    assert s3.reads == 9


async def test_an_unknown_profile_reports_every_line_and_ends_the_batch(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    src = tmp_path / "tickets.jsonl"
    write_records(src, 3, {2: "junk"})
    res, s3, fakes = await run_batch(time_skipping_env, BatchInput(
        profile="no-such-profile", source=str(src)))
    assert (res.records, res.bad, res.done) == (4, 4, 0) and not fakes.generate_requests
    assert {o.state for o in outcomes(s3)} == {"BAD_RECORD"}


async def test_a_job_id_already_in_use_is_reported_and_the_batch_goes_on(
    dev_server_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    src = tmp_path / "tickets.jsonl"
    write_records(src, 3, {})
    bid = f"batch-{uuid.uuid4().hex[:6]}"
    # a running workflow already holds line 2's job id (no worker polls its queue). On a
    # real dev server: the time-skipping one stops skipping time for the rest of the
    # session once a workflow task nobody polls was outstanding, even after terminate.
    squatter = await dev_server_env.client.start_workflow(
        "Squatter", id=f"{bid}-L2", task_queue=f"nobody-{bid}")
    try:
        res, s3, _ = await run_batch(dev_server_env, BatchInput(
            profile="ticket-triage", source=str(src), window=2), batch_id=bid)
    finally:
        await squatter.terminate()
    by_line = {o.line: o for o in outcomes(s3)}
    assert by_line[2].state == "JOB_ID_IN_USE" and f"{bid}-L2" in by_line[2].reason
    assert by_line[1].state == by_line[3].state == "FINISHED"
    assert (res.state, res.records, res.done, res.failed) == ("COMPLETED", 3, 2, 1)
    assert res.by_state == {"FINISHED": 2, "JOB_ID_IN_USE": 1}


async def test_outcomes_keep_counts_and_the_transcript_key_not_the_transcript(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    src = tmp_path / "tickets.jsonl"
    write_records(src, 2, {})
    res, s3, _ = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src)))
    for o in outcomes(s3):
        assert o.transcript_key == f"transcripts/{o.job_id}.json"
        assert o.steps == 1 and o.prompt_tokens > 0
    assert all(len(body) < 2_000 for body in s3.objects.values())


async def test_steps_on_unpriced_engines_make_the_batch_cost_a_lower_bound(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    from warmloop.workers.cli import _batch_cost

    src = tmp_path / "tickets.jsonl"
    write_records(src, 2, {})
    priced, _, _ = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src)))
    assert priced.cost_usd > 0 and priced.cost_unknown_steps == 0
    unpriced, s3, _ = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src)), prices={})
    assert unpriced.done == 2 and unpriced.cost_usd == 0.0
    # one step each, on an engine with no price: counted, not summed as free
    assert unpriced.cost_unknown_steps == 2
    assert [o.cost_unknown_steps for o in outcomes(s3)] == [1, 1]
    assert _batch_cost(0.0, 2) == "at least $0.000000 (2 steps on unpriced engines)"
    assert _batch_cost(0.25, 0) == "$0.250000"


async def children_started_at_once(env: WorkflowEnvironment, batch_id: str) -> list[int]:
    """Per run, first to last: the child jobs it started before the first one ended (the
    window it ran with, when its page had that many records)."""
    client = env.client
    runs: list[int] = []
    run_id: str | None = None
    while True:
        history = await client.get_workflow_handle(batch_id, run_id=run_id).fetch_history()
        started = 0
        for ev in history.events:
            if ev.HasField("start_child_workflow_execution_initiated_event_attributes"):
                started += 1
            if ev.HasField("child_workflow_execution_completed_event_attributes"):
                break
        runs.insert(0, started)
        prev = history.events[0].workflow_execution_started_event_attributes \
            .continued_execution_run_id
        if not prev:
            return runs
        run_id = prev


async def run_tickets(env: WorkflowEnvironment, tmp_path: Path, n: int,
                      windows: list[BatchWindow | None] | None = None,
                      **inp: Any) -> tuple[Any, FakeActivities, str, list[int]]:
    """``n`` good tickets as a batch: its result, the fakes, its id and the children
    each run started at once."""
    src = tmp_path / "tickets.jsonl"
    write_records(src, n, {})
    bid = f"batch-{uuid.uuid4().hex[:6]}"
    res, _, fakes = await run_batch(env, BatchInput(profile="ticket-triage", source=str(src),
                                                    **inp), batch_id=bid, windows=windows)
    assert res.done == n
    return res, fakes, bid, await children_started_at_once(env, bid)


async def test_a_batch_without_a_window_runs_each_page_with_the_fleets_answer(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    answers: list[BatchWindow | None] = [
        BatchWindow(window=w, fit=w, why=f"fit {w}") for w in (2, 4, 1)]
    _, fakes, bid, at_once = await run_tickets(time_skipping_env, tmp_path, 12, answers,
                                               page_size=5, max_window=32)
    # asked once a page, for this batch, bounded by its max_window
    assert [(a.batch_id, a.max_window) for a in fakes.window_asks] == [(bid, 32)] * 3
    assert at_once == [2, 4, 1]


async def test_a_fleet_that_cannot_answer_leaves_the_default_window(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    _, fakes, _, at_once = await run_tickets(time_skipping_env, tmp_path, 6, [None])
    assert len(fakes.window_asks) == 3  # the local activity's 3 attempts
    assert at_once == [DEFAULT_BATCH_WINDOW]


async def test_a_batch_given_a_window_does_not_ask_the_fleet(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    _, fakes, _, at_once = await run_tickets(time_skipping_env, tmp_path, 6, window=5)
    assert fakes.window_asks == [] and at_once == [5]


def test_a_page_size_the_history_cannot_hold_is_refused() -> None:
    from pydantic import ValidationError

    most = batch_run.MAX_PAGE_SIZE
    BatchInput(profile="ticket-triage", source="s3://b/k.jsonl", page_size=most)
    with pytest.raises(ValidationError, match="page_size"):
        BatchInput(profile="ticket-triage", source="s3://b/k.jsonl", page_size=most + 1)


async def test_a_run_whose_history_is_full_goes_on_from_its_first_unstarted_record(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """Children's results fill a run's history: past the budget the run starts no more
    children and continues as new at the first record it did not start."""
    src = tmp_path / "tickets.jsonl"
    write_records(src, 5, {2: "oops", 5: "[]"})
    # "recorded": the id the replay test gives a recorded history (child ids depend on it)
    res, s3, fakes = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=2, page_size=100,
        history_bytes_per_run=1), batch_id="recorded")
    assert (res.records, res.done, res.bad) == (7, 5, 2)
    assert len(res.result_keys) == 5  # one child per run
    lines = sorted(o.line for o in outcomes(s3))
    assert lines == list(range(1, 8))
    assert len({r.job_id for r in fakes.generate_requests}) == 5
    # the first run stopped after its first child: it replays, and is kept for replay
    client = time_skipping_env.client
    last = await client.get_workflow_handle("recorded").fetch_history()
    first_run = last.events[0].workflow_execution_started_event_attributes.first_execution_run_id
    history = await client.get_workflow_handle("recorded", run_id=first_run).fetch_history()
    await Replayer(workflows=[BatchRun], data_converter=pydantic_data_converter,
                   workflow_runner=sandbox_runner()).replay_workflow(history)
    if os.environ.get("WARMLOOP_RECORD_HISTORIES"):
        (Path(__file__).parent / "histories" / "batch_run_history_budget.json").write_text(
            history.to_json())


async def test_a_tenants_batch_runs_each_record_as_the_tenants_job(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """A tenant's batch: its jobs are ``<tenant>/<batch id>-L<line>``, carry the tenant
    (its cache salt, its quota) and whoever started the batch, are tagged as the
    tenant's for visibility, and the result pages are under the tenant's S3 prefix."""
    from warmloop.workflows.agent_job import SA_TENANT

    src = tmp_path / "tickets.jsonl"
    write_records(src, 2, {3: "oops"})
    bare = f"batch-{uuid.uuid4().hex[:6]}"
    bid = f"acme/{bare}"
    res, s3, fakes = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=2, tenant="acme",
        submitted_by="alice@acme"), batch_id=bid)
    assert (res.state, res.done, res.bad) == ("COMPLETED", 2, 1), res.reason
    assert res.batch_id == bid
    assert {r.job_id for r in fakes.generate_requests} == {f"{bid}-L1", f"{bid}-L2"}
    assert {r.tenant for r in fakes.generate_requests} == {"acme"}
    assert {r.tenant for r in fakes.routes} == {"acme"}
    assert res.result_keys == [f"tenants/acme/batch-results/{bare}/page-00001.jsonl"]
    assert (res.results_prefix, res.pages) == (f"tenants/acme/batch-results/{bare}/", 1)
    assert list(s3.objects) == res.result_keys
    assert {o.job_id for o in outcomes(s3) if o.job_id} == {f"{bid}-L1", f"{bid}-L2"}
    child = time_skipping_env.client.get_workflow_handle(f"{bid}-L1")
    desc = await child.describe()
    assert desc.typed_search_attributes.get(SA_TENANT) == "acme"
    started = (await child.fetch_history()).events[0].workflow_execution_started_event_attributes
    job = json.loads(started.input.payloads[0].data)
    assert (job["tenant"], job["submitted_by"]) == ("acme", "alice@acme")  # alice may not approve


async def test_a_default_batchs_jobs_are_tagged_as_the_default_tenants(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    from warmloop.workflows.agent_job import SA_TENANT

    src = tmp_path / "tickets.jsonl"
    write_records(src, 1, {})
    bid = f"batch-{uuid.uuid4().hex[:6]}"
    res, s3, _ = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=1), batch_id=bid)
    assert res.done == 1 and res.result_keys == [f"batch-results/{bid}/page-00001.jsonl"]
    desc = await time_skipping_env.client.get_workflow_handle(f"{bid}-L1").describe()
    assert desc.typed_search_attributes.get(SA_TENANT) == "default"


@pytest.mark.parametrize(("tenant", "batch_id"), [("acme", "batch-{tag}"),
                                                  ("acme", "globex/batch-{tag}"),
                                                  ("default", "acme/batch-{tag}")])
async def test_a_batch_outside_its_tenants_namespace_ends_invalid_and_runs_nothing(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path, tenant: str, batch_id: str,
) -> None:
    src = tmp_path / "tickets.jsonl"
    write_records(src, 2, {})
    bid = batch_id.format(tag=uuid.uuid4().hex[:6])
    s3 = MemoryS3()
    res, _, fakes = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=2, tenant=tenant),
        batch_id=bid, s3=s3)
    assert res.state == "INVALID_INPUT"
    assert f"not in tenant {tenant}'s namespace" in res.reason and bid in res.reason
    assert (res.records, res.result_keys, s3.objects) == (0, [], {})
    assert fakes.generate_requests == []


async def test_a_batch_of_more_pages_than_it_lists_keeps_its_carry_small(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """A key a page in the carry would pass Temporal's 2 MB payload limit at ~30,000
    pages: past ``RESULT_KEYS_KEPT`` the result lists no more keys, and every page is
    still where ``page_key`` says, under ``results_prefix``."""
    n = batch_run.RESULT_KEYS_KEPT + 3
    src = tmp_path / "tickets.jsonl"
    src.write_text("oops\n" * n)  # bad lines only: a page each, no child jobs
    bid = f"batch-{uuid.uuid4().hex[:6]}"
    res, s3, _ = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), page_size=1), batch_id=bid)
    assert (res.records, res.bad, res.pages) == (n, n, n)
    assert len(res.result_keys) == batch_run.RESULT_KEYS_KEPT
    assert res.results_prefix == f"batch-results/{bid}/"
    assert res.result_keys[-1] == batch_run.page_key(bid, batch_run.RESULT_KEYS_KEPT)
    assert sorted(s3.objects) == sorted(batch_run.page_key(bid, p) for p in range(1, n + 1))
    assert all(k.startswith(res.results_prefix) for k in s3.objects)


class HangsFirstJobs(FakeActivities):
    """The model never answers the second step of the jobs of lines 1 and 2 (``lines``;
    of the jobs whose ids start with ``only``, when set) until they are cancelled; their
    first steps call a tool, so they have transcripts to keep.

    Only on a real dev server: the time-skipping one stops skipping time for the rest of
    the session once it loses track of a cancelled activity (test_cancel_during_step)."""

    started: asyncio.Event
    hung: int = 0
    lines: tuple[str, ...] = ("-L1", "-L2")
    only: str = ""

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if (req.job_id.endswith(self.lines) and req.job_id.startswith(self.only)
                and req.step == 2):
            self.generate_requests.append(req)
            self.hung += 1
            if self.hung == 2:
                self.started.set()
            await asyncio.Event().wait()  # until the worker cancels it
        return await super().generate(req)


def hanging_fakes() -> HangsFirstJobs:
    """``HangsFirstJobs`` whose jobs call a tool, then (all but the hung ones) finish."""
    fakes = HangsFirstJobs(lambda req: reply("search_kb", '{"topic": "crash"}') if req.step == 1
                           else reply("finish", '{"resolution": "resolved", "priority": "low"}'))
    fakes.started = asyncio.Event()
    return fakes


async def start_until_two_hang(client: Any, fakes: HangsFirstJobs, src: Path, bid: str,
                               **options: Any) -> Any:
    """Start ``src`` as triage batch ``bid`` (window 2, ``options`` on its input); its
    handle once two of its jobs hang (``fakes.lines``)."""
    handle = await client.start_workflow(
        BatchRun.run, BatchInput(profile="ticket-triage", source=str(src), window=2,
                                 **options),
        id=bid, task_queue=AGENT_TASK_QUEUE)
    await asyncio.wait_for(fakes.started.wait(), 60)
    return handle


async def test_a_cancelled_batch_cancels_its_running_jobs_and_keeps_their_outcomes(
    dev_server_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """Cancelled with two jobs running (window 2) and three records to go: both jobs
    end CANCELLED with their transcripts kept, their outcomes are written as the page's,
    the batch ends CANCELLED naming the first line that did not run, and nothing
    after it starts."""
    src = tmp_path / "tickets.jsonl"
    write_records(src, 5, {})
    fakes = hanging_fakes()
    s3 = MemoryS3()
    bid = f"batch-{uuid.uuid4().hex[:6]}"
    async with batch_workers(dev_server_env, fakes, s3) as client:
        handle = await start_until_two_hang(client, fakes, src, bid)
        await handle.cancel()
        res = await handle.result()
    assert res.state == "CANCELLED", res.reason
    assert "lines from 3 on did not run" in res.reason
    assert (res.done, res.failed, res.pages) == (2, 0, 1)
    by_line = {o.line: o for o in outcomes(s3)}
    assert sorted(by_line) == [1, 2]
    for line in (1, 2):
        o = by_line[line]
        assert (o.state, o.job_id) == ("CANCELLED", f"{bid}-L{line}")
        assert o.transcript_key == f"transcripts/{bid}-L{line}.json"  # kept
    assert {r.job_id for r in fakes.generate_requests} == {f"{bid}-L1", f"{bid}-L2"}
    stored = {s.job_id: s.transcript for s in fakes.stored}
    assert all(len(stored[f"{bid}-L{line}"]) == 2 for line in (1, 2))  # call and result


async def test_a_terminated_batchs_running_jobs_end_cancelled_with_their_transcripts(
    dev_server_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """Terminated (no chance to clean up itself), the batch's parent-close policy asks
    its running jobs to cancel: each ends CANCELLED with its transcript kept, where
    terminated jobs would have kept nothing. On a real Temporal server, which applies
    the policy."""
    from warmloop.workflows.contracts import JobResult, JobState

    src = tmp_path / "tickets.jsonl"
    write_records(src, 3, {})
    fakes = hanging_fakes()
    bid = f"batch-{uuid.uuid4().hex[:6]}"
    async with batch_workers(dev_server_env, fakes, MemoryS3()) as client:
        handle = await start_until_two_hang(client, fakes, src, bid)
        await handle.terminate("operator stopped it")
        for line in (1, 2):
            job = client.get_workflow_handle(f"{bid}-L{line}", result_type=JobResult)
            res = await asyncio.wait_for(job.result(), 60)
            assert res.state == JobState.CANCELLED
            assert res.transcript_key == f"transcripts/{bid}-L{line}.json"


async def test_a_terminated_batch_resumes_from_its_jobs_without_running_one_twice(
    dev_server_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """Terminated mid-page (no result, no page written) with line 1's job finished, the
    jobs of lines 2 and 3 running and 4 and 5 not started: the resume reads the page
    back from Temporal (waiting for the stopped jobs to end CANCELLED), the new batch
    writes it as the old batch's page 1 (1 FINISHED, 2 and 3 CANCELLED, their
    transcripts kept), then runs 2, 3, 4 and 5, never 1. Without the stopped lines it
    starts at 4; the page is written the same again."""
    from warmloop.workers.jobs import JobClient, resumed_batch

    src = tmp_path / "tickets.jsonl"
    write_records(src, 5, {})
    fakes = hanging_fakes()
    s3 = MemoryS3()
    bid = f"acme/batch-{uuid.uuid4().hex[:6]}"
    fakes.lines, fakes.only = ("-L2", "-L3"), f"{bid}-L"  # the first batch's jobs only
    async with batch_workers(dev_server_env, fakes, s3) as client:
        jobs = JobClient(client)
        handle = await start_until_two_hang(client, fakes, src, bid, tenant="acme",
                                             max_steps=3)  # 1 has finished
        await handle.terminate("operator stopped it")
        inp, ended, new = await resumed_batch(client, bid)
        assert (inp.start_line, inp.skip_lines, inp.recover) == (
            2, [], RecoverPageRequest(batch_id=bid, page=1))
        assert "was terminated on its page 1" in ended
        assert "cut short the jobs of lines 2, 3" in ended
        assert new == f"{bid.removeprefix('acme/')}-from-L2"
        new_id = await jobs.resume_batch(bid)
        res = await jobs.batch_result(new_id)
        old_page = [RecordOutcome.model_validate_json(line)
                    for line in s3.objects[page_key(bid, 1)].decode().splitlines()]
        later = await jobs.resume_batch(bid, rerun_cancelled=False)
        later_res = await jobs.batch_result(later)
        assert s3.objects[page_key(bid, 1)].decode().splitlines() == [
            o.model_dump_json() for o in old_page]  # written again, the same
    assert [(o.line, o.job_id, o.state) for o in old_page] == [
        (1, f"{bid}-L1", "FINISHED"), (2, f"{bid}-L2", "CANCELLED"),
        (3, f"{bid}-L3", "CANCELLED")]
    assert all(o.transcript_key for o in old_page)
    assert (res.state, res.done, res.next_line) == ("COMPLETED", 4, 6)
    resumed = [RecordOutcome.model_validate_json(line)
               for line in s3.objects[res.result_keys[0]].decode().splitlines()]
    assert [(o.line, o.state) for o in resumed] == [(n, "FINISHED") for n in (2, 3, 4, 5)]
    assert later == f"{bid}-from-L4" and (later_res.done, later_res.next_line) == (2, 6)
    ran = {r.job_id for r in fakes.generate_requests}
    assert ran == {*(f"{bid}-L{n}" for n in (1, 2, 3)), *(f"{new_id}-L{n}" for n in (2, 3, 4, 5)),
                   *(f"{later}-L{n}" for n in (4, 5))}


async def test_a_batch_cancelled_while_its_source_is_down_ends_cancelled(
    dev_server_env: WorkflowEnvironment,
) -> None:
    """Cancelled while S3 is down and the page's read is being retried: CANCELLED with
    nothing run (not SOURCE_UNAVAILABLE: the source was never given up on)."""
    s3 = MemoryS3({"b/tickets.jsonl": json.dumps(GOOD).encode() + b"\n"}, down_for=10_000)
    fakes = FakeActivities(lambda req: reply("finish", "{}"))
    async with batch_workers(dev_server_env, fakes, s3) as client:
        handle = await client.start_workflow(
            BatchRun.run, BatchInput(profile="ticket-triage", source="s3://b/tickets.jsonl",
                                     window=1),
            id=f"batch-{uuid.uuid4().hex[:6]}", task_queue=AGENT_TASK_QUEUE)
        for _ in range(200):  # until the read has failed at least once
            if s3.reads:
                break
            await asyncio.sleep(0.05)
        await handle.cancel()
        res = await handle.result()
    assert res.state == "CANCELLED" and "lines from 1 on did not run" in res.reason
    assert (res.records, res.pages, fakes.generate_requests) == (0, 0, [])


async def test_a_cancelled_batch_resumes_its_stopped_lines_and_then_the_rest(
    dev_server_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """``resume_batch``: a new batch over the same source, profile, tenant and options.
    Cancelled with the jobs of lines 1 and 3 stopped (line 2 finished, 4 and 5 never
    started), it runs 1 and 3 again, from the byte offset the result names, skips 2
    and goes on with 4 and 5; without the stopped lines (``rerun_cancelled=False``) it
    starts at 4. A completed batch, a running one and an unknown one have nothing to
    resume."""
    from warmloop.workers.jobs import InvalidJobError, JobClient

    src = tmp_path / "tickets.jsonl"
    write_records(src, 5, {})
    fakes = hanging_fakes()
    s3 = MemoryS3()
    bid = f"acme/batch-{uuid.uuid4().hex[:6]}"
    fakes.lines, fakes.only = ("-L1", "-L3"), f"{bid}-L"  # the first batch's jobs only
    async with batch_workers(dev_server_env, fakes, s3) as client:
        jobs = JobClient(client)
        handle = await start_until_two_hang(client, fakes, src, bid, tenant="acme",
                                             max_steps=3)
        with pytest.raises(InvalidJobError, match="still running"):
            await jobs.resume_batch(bid)
        await handle.cancel()
        first = await handle.result()
        assert (first.state, first.next_line, first.rerun_lines) == ("CANCELLED", 4, [1, 3])
        assert first.rerun_offset == 0 and "stopped the jobs of lines 1, 3" in first.reason
        new = await jobs.resume_batch(bid)
        assert new == f"{bid}-from-L1"
        res = await jobs.batch_result(new)
        with pytest.raises(InvalidJobError, match="every line of its source has an outcome"):
            await jobs.resume_batch(new)
        with pytest.raises(InvalidJobError, match="unknown batch"):
            await jobs.resume_batch("acme/no-such-batch")
        later = await jobs.resume_batch(bid, rerun_cancelled=False)
        assert later == f"{bid}-from-L4"
        later_res = await jobs.batch_result(later)
    assert (res.state, res.done, res.next_line, res.rerun_lines) == ("COMPLETED", 4, 6, [])
    resumed = [RecordOutcome.model_validate_json(line)
               for line in s3.objects[res.result_keys[0]].decode().splitlines()]
    assert [(o.line, o.job_id, o.state) for o in resumed] == [
        (n, f"{new}-L{n}", "FINISHED") for n in (1, 3, 4, 5)]
    assert (later_res.done, later_res.next_line) == (2, 6)
    ran = {r.job_id for r in fakes.generate_requests}
    assert ran == {*(f"{bid}-L{n}" for n in (1, 2, 3)), *(f"{new}-L{n}" for n in (1, 3, 4, 5)),
                   *(f"{later}-L{n}" for n in (4, 5))}


async def test_a_batch_cancelled_once_every_job_started_names_them_to_run_again(
    dev_server_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """Cancelled when every record of its source had started (both jobs running), the
    batch names both as stopped, and a resume runs them again (with the jobs awaited by
    a gather, the cancel reached the gather first: it named none, and the source being
    done, nothing could be resumed)."""
    from warmloop.workers.jobs import JobClient

    src = tmp_path / "tickets.jsonl"
    write_records(src, 2, {})
    fakes = hanging_fakes()
    bid = f"batch-{uuid.uuid4().hex[:6]}"
    fakes.only = f"{bid}-L"
    async with batch_workers(dev_server_env, fakes, MemoryS3()) as client:
        handle = await start_until_two_hang(client, fakes, src, bid, max_steps=3)
        await handle.cancel()
        first = await handle.result()
        assert (first.state, first.source_done, first.rerun_lines) == ("CANCELLED", True, [1, 2])
        jobs = JobClient(client)
        new = await jobs.resume_batch(bid)
        res = await jobs.batch_result(new)
    assert (new, res.state, res.done) == (f"{bid}-from-L1", "COMPLETED", 2)


async def test_a_batch_that_cannot_write_its_recovered_page_runs_nothing_and_passes_it_on(
    dev_server_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """The page to recover names a batch Temporal does not know (past its retention):
    the new batch ends RECOVERY_FAILED, nothing read or run, and resuming it passes the
    page on (or the old batch's outcomes would never be written)."""
    from warmloop.workers.jobs import resumed_batch

    src = tmp_path / "tickets.jsonl"
    write_records(src, 2, {})
    recover = RecoverPageRequest(batch_id=f"gone-{uuid.uuid4().hex[:6]}", page=3)
    fakes = FakeActivities(lambda req: reply("finish", "{}"))
    s3 = MemoryS3()
    async with batch_workers(dev_server_env, fakes, s3) as client:
        bid = f"batch-{uuid.uuid4().hex[:6]}"
        res = await client.execute_workflow(
            BatchRun.run, BatchInput(profile="ticket-triage", source=str(src), window=1,
                                     recover=recover), id=bid, task_queue=AGENT_TASK_QUEUE)
        inp, _, _ = await resumed_batch(client, bid)
    assert res.state == "RECOVERY_FAILED", res.reason
    assert f"page 3 of {recover.batch_id} was not written" in res.reason
    assert "not known to Temporal" in res.reason
    assert (res.records, res.pages, fakes.generate_requests, s3.objects) == (0, 0, [], {})
    assert (inp.start_line, inp.recover) == (1, recover)


async def test_a_resumed_batch_that_stopped_early_keeps_its_skipped_lines_when_resumed(
    dev_server_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """A resumed batch (line 2 skipped: its job finished in the batch before) cancelled
    before it ran anything: resuming it skips line 2 still, or line 2's job would run a
    second time."""
    from warmloop.workers.jobs import resumed_batch

    src = tmp_path / "tickets.jsonl"
    write_records(src, 3, {})
    fakes = slow_window_fakes()
    async with batch_workers(dev_server_env, fakes, MemoryS3()) as client:
        bid = f"batch-{uuid.uuid4().hex[:6]}"
        handle = await client.start_workflow(
            BatchRun.run, BatchInput(profile="ticket-triage", source=str(src), skip_lines=[2]),
            id=bid, task_queue=AGENT_TASK_QUEUE)
        await asyncio.wait_for(fakes.asked.wait(), 30)
        await handle.cancel()
        stopped = await asyncio.wait_for(handle.result(), 60)
        inp, _, _ = await resumed_batch(client, bid)
    assert (stopped.state, stopped.next_line, stopped.rerun_lines) == ("CANCELLED", 1, [])
    assert (inp.start_line, inp.skip_lines) == (1, [2])


class SlowWindow(FakeActivities):
    """The fleet's answer to the batch's first ask waits for ``answer`` (until the
    batch is cancelled, if never set)."""

    asked: asyncio.Event
    answer: asyncio.Event

    @activity.defn(name="batch_window")
    async def batch_window(self, req: BatchWindowRequest) -> BatchWindow:
        self.window_asks.append(req)
        self.asked.set()
        await self.answer.wait()
        return BatchWindow(window=2, fit=2, why="the fake fleet")


def slow_window_fakes() -> SlowWindow:
    fakes = SlowWindow(lambda req: reply("finish", '{"resolution": "resolved", '
                                                   '"priority": "low"}'))
    fakes.asked, fakes.answer = asyncio.Event(), asyncio.Event()
    return fakes


async def test_a_batch_cancelled_while_it_asks_the_fleet_runs_nothing(
    dev_server_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """The ask is a local activity: its cancel comes back as an ActivityError, which
    read as "the fleet did not answer" lost the cancel and ran the batch to COMPLETED."""
    src = tmp_path / "tickets.jsonl"
    write_records(src, 4, {})
    fakes = slow_window_fakes()
    s3 = MemoryS3()
    async with batch_workers(dev_server_env, fakes, s3) as client:
        handle = await client.start_workflow(
            BatchRun.run, BatchInput(profile="ticket-triage", source=str(src)),
            id=f"batch-{uuid.uuid4().hex[:6]}", task_queue=AGENT_TASK_QUEUE)
        await asyncio.wait_for(fakes.asked.wait(), 30)
        await handle.cancel()
        res = await asyncio.wait_for(handle.result(), 60)
    assert res.state == "CANCELLED", res.reason
    assert "lines from 1 on did not run" in res.reason
    assert (fakes.generate_requests, s3.objects) == ([], {})


async def test_jobs_whose_start_a_cancel_meets_end_with_their_own_outcomes(
    dev_server_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """The cancel lands as the batch starts its jobs (the fleet answers after it was
    sent): a start under way goes on, then its job is cancelled, so each started job's
    outcome is its own result (counted as done, not "never ran" and failed)."""
    from warmloop.workflows.contracts import JobResult

    src = tmp_path / "tickets.jsonl"
    write_records(src, 4, {})
    fakes = slow_window_fakes()
    s3 = MemoryS3()
    async with batch_workers(dev_server_env, fakes, s3) as client:
        bid = f"batch-{uuid.uuid4().hex[:6]}"
        handle = await client.start_workflow(
            BatchRun.run, BatchInput(profile="ticket-triage", source=str(src)),
            id=bid, task_queue=AGENT_TASK_QUEUE)
        await asyncio.wait_for(fakes.asked.wait(), 30)
        await handle.cancel()
        fakes.answer.set()
        res = await asyncio.wait_for(handle.result(), 60)
        got = outcomes(s3)
        for o in got:  # each outcome is what its job ended with
            job = await client.get_workflow_handle(o.job_id or "",
                                                   result_type=JobResult).result()
            assert (o.state, o.transcript_key) == (job.state, job.transcript_key)
    assert res.state == "CANCELLED", res.reason
    assert res.failed == 0 and res.done == len(got)
    assert all("before this job started" not in o.reason for o in got)
    assert [o.line for o in got] == list(range(1, len(got) + 1))
    assert f"lines from {len(got) + 1} on did not run" in res.reason


async def test_a_batch_that_asks_its_tenants_quota_waits_for_each_jobs_slot(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """A tenant with a quota on the workers: each record's job is started only once its
    slot is granted, the claims one at a time in line order (the first refused three
    times before it is granted), and the waiting adds nothing to the batch's history:
    one scheduled claim a record, however many attempts."""
    src = tmp_path / "tickets.jsonl"
    write_records(src, 3, {})
    bid = f"acme/batch-{uuid.uuid4().hex[:6]}"
    gate = SlotGate(refuse=3)
    kept: list[Any] = []
    res, _, fakes = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=2, tenant="acme"),
        batch_id=bid, slots=gate, keep_history=kept, quotas=ONE_SLOT)
    assert (res.state, res.done) == ("COMPLETED", 3), res.reason
    assert gate.attempts == [f"{bid}-L1"] * 4 + [f"{bid}-L2", f"{bid}-L3"]
    assert {r.job_id for r in fakes.generate_requests} == {f"{bid}-L{n}" for n in (1, 2, 3)}
    claims = [e for e in kept[0].events
              if e.activity_task_scheduled_event_attributes.activity_type.name
              == "claim_job_slot"]
    assert len(claims) == 3


async def test_a_batch_whose_tenant_has_no_quota_claims_nothing(
    time_skipping_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """No quota for the tenant on the workers (another tenant has one): no claims, not
    one activity a job."""
    src = tmp_path / "tickets.jsonl"
    write_records(src, 2, {})
    gate = SlotGate(refuse=-1)  # would hold every job back
    res, _, _ = await run_batch(time_skipping_env, BatchInput(
        profile="ticket-triage", source=str(src), window=2, tenant="globex"),
        batch_id=f"globex/batch-{uuid.uuid4().hex[:6]}", slots=gate, quotas=ONE_SLOT)
    assert (res.state, res.done, gate.attempts) == ("COMPLETED", 2, [])


async def test_a_batch_cancelled_while_its_job_waits_for_a_slot_resumes_from_that_job(
    dev_server_env: WorkflowEnvironment, tmp_path: Path,
) -> None:
    """Cancelled while its first job waits for its tenant's slot: nothing started, the
    progress query said it waited, and the batch ends CANCELLED from line 1 with no
    outcome for it (a resume runs it)."""
    src = tmp_path / "tickets.jsonl"
    write_records(src, 2, {})
    gate = SlotGate(refuse=-1, delay_s=1.0)
    fakes = FakeActivities(lambda req: reply("finish", '{"resolution": "resolved", '
                                                       '"priority": "low"}'))
    s3 = MemoryS3()
    async with batch_workers(dev_server_env, fakes, s3, gate, ONE_SLOT) as client:
        handle = await client.start_workflow(
            BatchRun.run, BatchInput(profile="ticket-triage", source=str(src), window=1,
                                     tenant="acme"),
            id=f"acme/batch-{uuid.uuid4().hex[:6]}", task_queue=AGENT_TASK_QUEUE)
        await asyncio.wait_for(gate.waiting.wait(), 30)
        progress = await handle.query(BatchRun.progress)
        assert (progress.waiting_for_quota, progress.running) == (True, 0)
        await handle.cancel()
        res = await asyncio.wait_for(handle.result(), 60)
    assert res.state == "CANCELLED", res.reason
    assert "lines from 1 on did not run" in res.reason
    assert (res.next_line, res.done, res.failed) == (1, 0, 0)
    assert fakes.generate_requests == [] and outcomes(s3) == []
