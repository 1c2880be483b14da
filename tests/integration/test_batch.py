"""Batches and schedules on the real stack."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import time
import uuid
from pathlib import Path

import pytest
import redis.asyncio as aioredis
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from tests.integration.cli import warmloop
from tests.polling import eventually
from warmloop.activities.registry import TENANT_TOKENS, EngineRegistry, TenantUsage
from warmloop.infra.stack import Stack
from warmloop.workers.approvals import ApprovalRefused, dev_approver, list_pending
from warmloop.workers.clients import build_s3
from warmloop.workers.demo import bundled_tickets
from warmloop.workers.settings import Settings
from warmloop.workflows.batch_run import BatchResult, BatchRun, RecordOutcome, page_key
from warmloop.workflows.profiles import get_profile
from warmloop.workflows.tenants import hour_window

pytestmark = pytest.mark.integration


@contextlib.asynccontextmanager
async def any_approver(client: Client, settings: Settings):  # type: ignore[no-untyped-def]
    """Approve whatever any job asks, found through the search attribute (the batch's
    child jobs are not known to the test by handle)."""
    done = asyncio.Event()
    bot = dev_approver(settings)

    async def loop() -> None:
        while not done.is_set():
            for p in await list_pending(client):
                with contextlib.suppress(WorkflowUpdateFailedError, RPCError, ApprovalRefused):
                    await bot.decide(client, p.job_id, p.approval_id, approve=True)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(done.wait(), timeout=0.5)

    task = asyncio.create_task(loop())
    try:
        yield
    finally:
        done.set()
        await task




async def batch_run_cli(client: Client, settings: Settings, tmp_path: Path, lines: list[str],
                        batch_id: str, *args: str) -> subprocess.CompletedProcess[str]:
    """``warmloop batch run`` of ``lines`` as ticket-triage records (at most 4 steps a
    job, approvals granted), followed to its end; it must exit 0."""
    src = tmp_path / "tickets.jsonl"
    src.write_text("\n".join(lines) + "\n")
    async with any_approver(client, settings):
        out = await asyncio.to_thread(warmloop, "batch", "run", str(src), "--profile",
                                      "ticket-triage", "--max-steps", "4", "--batch-id",
                                      batch_id, "--follow", *args)
    assert out.returncode == 0, out.stderr
    return out


async def test_batch_run_reports_bad_lines_and_finishes_the_rest(
    client: Client, stack: Stack, tmp_path: Path, settings: Settings,
) -> None:
    lines = [json.dumps(t) for t in bundled_tickets()[:4]]
    lines.insert(2, '{"ticket_id": "T9", "oops"')
    bid = f"batch-it-{uuid.uuid4().hex[:6]}"
    out = await batch_run_cli(client, settings, tmp_path, lines, bid, "--window", "2")
    res = await client.get_workflow_handle(bid, result_type=BatchResult).result()
    assert (res.records, res.done, res.bad, res.failed) == (5, 4, 1, 0)
    assert res.cost_usd > 0
    assert "bad records (skipped)" in out.stdout


async def test_a_batch_without_a_window_runs_with_the_jobs_the_engines_hold(
    client: Client, stack: Stack, tmp_path: Path, settings: Settings, redis: aioredis.Redis,
) -> None:
    """No ``--window``: each page asks the fleet. The engines publish the batch jobs their
    pools hold once they have served batch steps (``batch_kv_fit``), and the second page's
    window is their sum, engine by engine."""
    bid = f"batch-fit-{uuid.uuid4().hex[:6]}"
    await batch_run_cli(client, settings, tmp_path,
                        [json.dumps(t) for t in bundled_tickets()[:4]], bid, "--page-size", "2")
    handle = client.get_workflow_handle(bid, result_type=BatchResult)
    res = await handle.result()
    assert (res.records, res.done) == (4, 4) and len(res.result_keys) == 2
    # the engines that served this batch's steps publish what their pools hold
    registry = EngineRegistry(redis, ttl_s=settings.engine_ttl_s)
    model = get_profile("ticket-triage").model
    live = [hb for hb in await registry.live() if model is None or hb.model == model]
    fits = {hb.engine_id: hb.batch_kv_fit for hb in live}
    measured = {e: f for e, f in fits.items() if f is not None}
    assert measured, f"no engine published its batch KV fit: {fits}"
    for hb in live:
        if hb.batch_kv_fit is not None:
            # at least one job, and no more than the pool's batch share at a block each
            share = settings.admission.kv_share * (hb.kv_capacity_tokens // hb.block_size)
            assert hb.block_size > 1 and 1 <= hb.batch_kv_fit <= share, hb
    # the last page ran with their sum, as the progress query (a replay) tells
    last = (await handle.query(BatchRun.progress)).fleet_window
    assert last is not None and last.fit is not None, last
    assert set(last.engines) == set(fits), (last.engines, fits)
    fit = sum(last.engines.values())
    taken, share = sum(last.others.values()), fit // (len(last.others) + 1)
    assert last.fit == fit and last.window == max(1, min(64, max(fit - taken, share)))
    assert bid not in last.others  # its own jobs of page 1 are not another batch's
    # page 1's steps were measured: engines that served them counted their KV fit, not K
    assert set(measured) - set(last.by_k), (last.by_k, measured)


async def test_a_tenants_batch_runs_as_the_tenants_jobs(
    client: Client, stack: Stack, tmp_path: Path, settings: Settings,
) -> None:
    """``batch run --tenant``: the batch is ``<tenant>/<batch id>``, its jobs the
    tenant's (visibility counts them as its jobs; their transcripts and the result
    page are under the tenant's S3 prefix)."""
    tag = uuid.uuid4().hex[:6]
    tenant, bid = f"bt-{tag}", f"batch-t-{tag}"
    lines = [json.dumps(t) for t in bundled_tickets()[:2]]
    out = await batch_run_cli(client, settings, tmp_path, lines, bid, "--window", "2",
                              "--tenant", tenant)
    wid = f"{tenant}/{bid}"
    assert f"started batch {wid}" in out.stdout
    res = await client.get_workflow_handle(wid, result_type=BatchResult).result()
    assert (res.state, res.done) == ("COMPLETED", 2), res.reason
    assert res.result_keys == [f"tenants/{tenant}/batch-results/{bid}/page-00001.jsonl"]
    s3 = build_s3(settings)
    page = await asyncio.to_thread(s3.get_object, Bucket=settings.s3_bucket,
                                   Key=res.result_keys[0])
    outcomes = [RecordOutcome.model_validate_json(line)
                for line in page["Body"].read().decode().splitlines()]
    assert {o.job_id for o in outcomes} == {f"{wid}-L1", f"{wid}-L2"}
    assert all((o.transcript_key or "").startswith(f"tenants/{tenant}/transcripts/")
               for o in outcomes), outcomes
    query = f"WorkflowType = 'AgentJob' AND WarmloopTenant = '{tenant}'"

    async def both_counted() -> bool:
        return (await client.count_workflows(query)).count == 2

    await eventually(both_counted, attempts=200, interval_s=0.1)


async def test_a_tenants_quota_bounds_its_batch(
    client: Client, stack: Stack, tmp_path: Path, redis: aioredis.Redis,
    monkeypatch: pytest.MonkeyPatch, settings: Settings,
) -> None:
    """A tenant's ``max_jobs_in_flight`` bounds its batch's window (asked for more:
    refused; asked of the fleet: cut to it), and a tenant whose hour's tokens are spent
    starts no batch."""
    tag = uuid.uuid4().hex[:6]
    one, spent = f"b1-{tag}", f"bs-{tag}"
    monkeypatch.setenv("WARMLOOP_TENANTS", json.dumps({
        one: {"max_jobs_in_flight": 1}, spent: {"tokens_per_hour": 1000}}))
    src = tmp_path / "tickets.jsonl"
    src.write_text("\n".join(json.dumps(t) for t in bundled_tickets()[:2]) + "\n")
    args = ("batch", "run", str(src), "--profile", "ticket-triage", "--max-steps", "1")
    wide = await asyncio.to_thread(warmloop, *args, "--window", "2", "--tenant", one)
    assert wide.returncode != 0
    assert f"window 2 is over tenant {one}'s max_jobs_in_flight 1" in wide.stderr + wide.stdout
    bid = f"batch-q-{tag}"
    async with any_approver(client, settings):  # a first step may ask a human
        ran = await asyncio.to_thread(warmloop, *args, "--tenant", one, "--batch-id", bid,
                                      "--follow")
    assert ran.returncode == 0, ran.stderr
    handle = client.get_workflow_handle(f"{one}/{bid}", result_type=BatchResult)
    assert (await handle.result()).done == 2
    assert (await handle.query(BatchRun.progress)).window == 1  # the fleet's answer, cut
    # the hour's tokens spent (as the inference workers count them): refused at start
    await TenantUsage(redis).add(spent, 1000)
    try:
        refused = await asyncio.to_thread(warmloop, *args, "--tenant", spent,
                                          "--batch-id", f"batch-s-{tag}")
        assert refused.returncode != 0
        assert "tokens_per_hour" in refused.stderr + refused.stdout
        with pytest.raises(RPCError):  # nothing was started
            await client.get_workflow_handle(f"{spent}/batch-s-{tag}").describe()
    finally:
        await redis.delete(TENANT_TOKENS.format(spent, hour_window(time.time())))


async def test_two_batches_of_a_one_slot_tenant_run_one_job_at_a_time(
    client: Client, stack: Stack, tmp_path: Path, settings: Settings,
) -> None:
    """Two batches of a tenant whose workers' quota is one job in flight, started
    together: each job claims the tenant's slot as it starts, so the four jobs run one
    after another (each starts after the one before it closed), where each batch alone
    keeps to its window of one and the two together ran two jobs at once. A page a
    record: the claims go on across continue-as-new, and ``batch list`` shows each
    batch once."""
    tag = uuid.uuid4().hex[:6]
    # the session's one-slot tenant (tests/conftest.py: ONE_SLOT_TENANT)
    [tenant] = [t for t, q in settings.tenants.items() if q.max_jobs_in_flight == 1]
    src = tmp_path / "tickets.jsonl"
    src.write_text("\n".join(json.dumps(t) for t in bundled_tickets()[:2]) + "\n")
    bids = [f"slots-{n}-{tag}" for n in (1, 2)]
    async with any_approver(client, settings):
        starts = await asyncio.gather(*(asyncio.to_thread(
            warmloop, "batch", "run", str(src), "--profile", "ticket-triage", "--max-steps",
            "2", "--tenant", tenant, "--batch-id", bid, "--page-size", "1") for bid in bids))
        assert all(out.returncode == 0 for out in starts), [o.stderr for o in starts]
        results = [await asyncio.wait_for(client.get_workflow_handle(
            f"{tenant}/{bid}", result_type=BatchResult).result(), 300) for bid in bids]
    assert [(r.state, r.done) for r in results] == [("COMPLETED", 2)] * 2, results
    jobs = [wf async for wf in client.list_workflows(
        f"WorkflowType = 'AgentJob' AND WarmloopTenant = '{tenant}'") if tag in wf.id]
    assert len(jobs) == 4, [j.id for j in jobs]
    spans = sorted((j.start_time, j.close_time) for j in jobs)
    assert all(end is not None for _, end in spans)
    overlaps = [(a, b) for a, b in zip(spans, spans[1:], strict=False)
                if b[0] < (a[1] or b[0])]
    assert overlaps == [], spans
    # `batch list`: each batch once (a page a run: the runs it continued as new from are
    # not listed), both ended
    listed = await asyncio.to_thread(warmloop, "batch", "list", "--tenant", tenant, "--json")
    assert listed.returncode == 0, listed.stderr
    rows = [json.loads(line) for line in listed.stdout.splitlines()]
    mine = [r for r in rows if tag in r["batch_id"]]
    assert sorted(r["batch_id"] for r in mine) == sorted(f"{tenant}/{bid}" for bid in bids)
    assert {r["status"] for r in mine} == {"COMPLETED"}


@pytest.mark.parametrize("tenant", [None, "nightly-t"])
async def test_a_schedule_triggers_a_batch(client: Client, stack: Stack, tmp_path: Path,
                                           settings: Settings, tenant: str | None) -> None:
    src = tmp_path / "tickets.jsonl"
    src.write_text(json.dumps(bundled_tickets()[5]) + "\n")
    name = f"nightly-{uuid.uuid4().hex[:6]}"
    created = await asyncio.to_thread(
        warmloop, "schedule", "create", name, "--cron", "0 2 * * *", "--profile",
        "ticket-triage", "--input", str(src), *(("--tenant", tenant) if tenant else ()))
    assert created.returncode == 0, created.stderr
    prefix = f"{tenant}/sched-{name}" if tenant else f"sched-{name}"
    try:
        listed = await asyncio.to_thread(warmloop, "schedule", "list")
        assert name in listed.stdout
        async with any_approver(client, settings):
            trig = await asyncio.to_thread(warmloop, "schedule", "trigger", name)
            assert trig.returncode == 0, trig.stderr

            async def started_batch() -> str | None:
                async for wf in client.list_workflows(
                        f"WorkflowType = 'BatchRun' AND WorkflowId STARTS_WITH '{prefix}'"):
                    return wf.id
                return None

            wid = await eventually(started_batch, attempts=200, interval_s=0.1)
            res = await client.get_workflow_handle(wid, result_type=BatchResult).result()
        assert res.records == 1 and res.done == 1
        if tenant:  # its job is the tenant's
            assert res.result_keys[0].startswith(f"tenants/{tenant}/batch-results/")
    finally:
        await asyncio.to_thread(warmloop, "schedule", "delete", name)


async def test_a_cancelled_batch_ends_its_running_jobs_cancelled_and_says_where_it_stopped(
    client: Client, stack: Stack, tmp_path: Path, settings: Settings,
) -> None:
    """``warmloop batch cancel`` on the real stack: two review jobs waiting for a human
    (window 2, offered only ``escalate``), four records left; each waiting job ends
    CANCELLED with its transcript in S3, the page's outcomes are written, and the batch
    ends CANCELLED naming the first line that did not run and the stopped lines, which
    ``batch resume`` runs first (``--keep-cancelled``: not)."""
    from warmloop.workers.jobs import JobClient

    src = tmp_path / "cases.jsonl"
    src.write_text("".join(json.dumps({"case_id": f"S{n:04d}", "text": "a case to review"})
                           + "\n" for n in range(6)))
    jobs = JobClient(client)
    bid = await jobs.start_batch("synthetic-review", str(src), window=2, max_steps=4,
                                 batch_id=f"batch-c-{uuid.uuid4().hex[:6]}",
                                 tools=["escalate"])

    async def both_waiting() -> bool:  # both jobs wait for a reviewer
        waiting = {p.job_id for p in await list_pending(client)}
        return {f"{bid}-L1", f"{bid}-L2"} <= waiting

    await eventually(both_waiting, attempts=600, interval_s=0.1)
    out = await asyncio.to_thread(warmloop, "batch", "cancel", bid)
    assert out.returncode == 0, out.stderr
    assert "CANCELLED" in out.stdout
    res = await jobs.batch_result(bid)
    assert res.state == "CANCELLED" and "lines from 3 on did not run" in res.reason
    s3 = build_s3(settings)
    page = await asyncio.to_thread(s3.get_object, Bucket=settings.s3_bucket,
                                   Key=res.result_keys[0])
    outcomes = [RecordOutcome.model_validate_json(line)
                for line in page["Body"].read().decode().splitlines()]
    assert [(o.line, o.state) for o in outcomes] == [(1, "CANCELLED"), (2, "CANCELLED")]
    for o in outcomes:  # each job's transcript kept
        assert o.transcript_key is not None
        await asyncio.to_thread(s3.head_object, Bucket=settings.s3_bucket, Key=o.transcript_key)
    again = await asyncio.to_thread(warmloop, "batch", "cancel", bid)
    assert again.returncode != 0 and "is not running" in again.stderr + again.stdout
    assert res.rerun_lines == [1, 2]
    # going on where it stopped: the stopped lines 1 and 2 first (window 2), each
    # waiting for a reviewer again
    resumed = await asyncio.to_thread(warmloop, "batch", "resume", bid)
    assert resumed.returncode == 0, resumed.stderr
    new = f"{bid}-from-L1"
    assert f"started batch {new} from line 1" in resumed.stdout

    async def waiting_for(*ids: str) -> bool:
        return set(ids) <= {p.job_id for p in await list_pending(client)}

    await eventually(lambda: waiting_for(f"{new}-L1", f"{new}-L2"), attempts=600,
                     interval_s=0.1)
    await jobs.cancel_batch(new)
    second = await jobs.batch_result(new)
    assert second.state == "CANCELLED" and "lines from 3 on did not run" in second.reason
    # without them (--keep-cancelled): from line 3, lines 3 and 4 wait
    later = await asyncio.to_thread(warmloop, "batch", "resume", new, "--keep-cancelled")
    assert later.returncode == 0, later.stderr
    third = f"{new}-from-L3"
    assert f"started batch {third} from line 3" in later.stdout
    await eventually(lambda: waiting_for(f"{third}-L3", f"{third}-L4"), attempts=600,
                     interval_s=0.1)
    await jobs.cancel_batch(third)
    assert "lines from 5 on did not run" in (await jobs.batch_result(third)).reason


async def test_a_terminated_batch_resumes_with_the_page_it_never_wrote(
    client: Client, stack: Stack, tmp_path: Path, settings: Settings,
) -> None:
    """Terminated (not cancelled) with two review jobs waiting for a human: no result,
    no page. ``warmloop batch resume`` reads the page back from Temporal (the jobs
    ended CANCELLED when the batch closed), the new batch writes it as the old batch's
    page 1 on the agent worker (both lines CANCELLED, their transcripts kept), and
    runs lines 1 and 2 again, each waiting for a reviewer."""
    from warmloop.workers.jobs import JobClient

    src = tmp_path / "cases.jsonl"
    src.write_text("".join(json.dumps({"case_id": f"S{n + 100:04d}",
                                       "text": "a case to review"})
                           + "\n" for n in range(3)))
    jobs = JobClient(client)
    bid = await jobs.start_batch("synthetic-review", str(src), window=2, max_steps=4,
                                 batch_id=f"batch-t-{uuid.uuid4().hex[:6]}",
                                 tools=["escalate"])

    async def waiting_for(*ids: str) -> bool:
        return set(ids) <= {p.job_id for p in await list_pending(client)}

    await eventually(lambda: waiting_for(f"{bid}-L1", f"{bid}-L2"), attempts=600,
                     interval_s=0.1)
    await client.get_workflow_handle(bid).terminate("an operator stopped it")
    status = await asyncio.to_thread(warmloop, "batch", "status", bid)
    assert status.returncode == 0, status.stderr
    assert "terminated without a result, on its page 1 (0 page(s)" in status.stdout
    assert f"warmloop batch resume {bid}" in status.stdout
    resumed = await asyncio.to_thread(warmloop, "batch", "resume", bid)
    assert resumed.returncode == 0, resumed.stderr
    new = f"{bid}-from-L1"
    assert f"started batch {new} from line 1" in resumed.stdout
    assert "was terminated on its page 1" in resumed.stdout
    await eventually(lambda: waiting_for(f"{new}-L1", f"{new}-L2"), attempts=600,
                     interval_s=0.1)
    s3 = build_s3(settings)
    page = await asyncio.to_thread(s3.get_object, Bucket=settings.s3_bucket,
                                   Key=page_key(bid, 1))
    outcomes = [RecordOutcome.model_validate_json(line)
                for line in page["Body"].read().decode().splitlines()]
    assert [(o.line, o.job_id, o.state) for o in outcomes] == [
        (1, f"{bid}-L1", "CANCELLED"), (2, f"{bid}-L2", "CANCELLED")]
    for o in outcomes:  # each job's transcript kept
        assert o.transcript_key is not None
        await asyncio.to_thread(s3.head_object, Bucket=settings.s3_bucket, Key=o.transcript_key)
    await jobs.cancel_batch(new)
    assert "lines from 3 on did not run" in (await jobs.batch_result(new)).reason
