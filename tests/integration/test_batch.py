"""Batches and schedules on the real stack."""

from __future__ import annotations

import asyncio
import contextlib
import json
import uuid
from pathlib import Path

import pytest
from temporalio.client import Client, WorkflowUpdateFailedError
from temporalio.service import RPCError

from tests.integration.cli import warmloop
from tests.polling import eventually
from warmloop.infra.stack import Stack
from warmloop.workers.approvals import ApprovalRefused, dev_approver, list_pending
from warmloop.workers.demo import bundled_tickets
from warmloop.workers.settings import Settings
from warmloop.workflows.batch_run import BatchResult

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




async def test_batch_run_reports_bad_lines_and_finishes_the_rest(
    client: Client, stack: Stack, tmp_path: Path, settings: Settings,
) -> None:
    src = tmp_path / "tickets.jsonl"
    lines = [json.dumps(t) for t in bundled_tickets()[:4]]
    lines.insert(2, '{"ticket_id": "T9", "oops"')
    src.write_text("\n".join(lines) + "\n")
    bid = f"batch-it-{uuid.uuid4().hex[:6]}"
    async with any_approver(client, settings):
        out = await asyncio.to_thread(warmloop, "batch", "run", str(src), "--profile",
                                      "ticket-triage", "--window", "2", "--max-steps", "4",
                                      "--batch-id", bid, "--follow")
    assert out.returncode == 0, out.stderr
    res = await client.get_workflow_handle(bid, result_type=BatchResult).result()
    assert (res.records, res.done, res.bad, res.failed) == (5, 4, 1, 0)
    assert res.cost_usd > 0
    assert "bad records (skipped)" in out.stdout


async def test_a_schedule_triggers_a_batch(client: Client, stack: Stack, tmp_path: Path,
                                           settings: Settings) -> None:
    src = tmp_path / "tickets.jsonl"
    src.write_text(json.dumps(bundled_tickets()[5]) + "\n")
    name = f"nightly-{uuid.uuid4().hex[:6]}"
    created = await asyncio.to_thread(warmloop, "schedule", "create", name, "--cron", "0 2 * * *",
                                      "--profile", "ticket-triage", "--input", str(src))
    assert created.returncode == 0, created.stderr
    try:
        listed = await asyncio.to_thread(warmloop, "schedule", "list")
        assert name in listed.stdout
        async with any_approver(client, settings):
            trig = await asyncio.to_thread(warmloop, "schedule", "trigger", name)
            assert trig.returncode == 0, trig.stderr

            async def started_batch() -> str | None:
                async for wf in client.list_workflows(
                        f"WorkflowType = 'BatchRun' AND WorkflowId STARTS_WITH 'sched-{name}'"):
                    return wf.id
                return None

            wid = await eventually(started_batch, attempts=200, interval_s=0.1)
            res = await client.get_workflow_handle(wid, result_type=BatchResult).result()
        assert res.records == 1 and res.done == 1
    finally:
        await asyncio.to_thread(warmloop, "schedule", "delete", name)
