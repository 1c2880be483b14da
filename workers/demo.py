"""`make demo`: run the bundled tickets as ticket-triage jobs (and, if asked, the bundled
invoices as invoice-reconciliation jobs), grade each against its ground truth and print
the report.

An urgent priority or a large payment waits for a human; the demo plays the approver
through the same Update the CLI uses.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from importlib import resources

from rich.console import Console
from temporalio.client import (
    Client,
    WorkflowHandle,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.service import RPCError

from warmloop.workers.approvals import ApprovalRefused, Approver, dev_approver
from warmloop.workers.clients import connect
from warmloop.workers.report import report_table, summarize
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput, JobResult


def bundled_tasks(profile: str = "ticket-triage") -> list[dict[str, object]]:
    pkg, name = {"ticket-triage": ("ticket_triage", "tickets.jsonl"),
                 "invoice-reconciliation": ("invoice_reconciliation", "invoices.jsonl")}[profile]
    text = resources.files(f"warmloop.activities.data.{pkg}").joinpath(name).read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _parameters(settings: Settings) -> str:
    """The served demo model's size, from its PROVENANCE.json."""
    try:
        prov = json.loads((settings.resolved_model_path / "PROVENANCE.json").read_text())
        return f"{int(prov['parameters']) / 1e6:.1f}M parameters"
    except (OSError, ValueError, KeyError, TypeError):
        return "a few million parameters"


def bundled_tickets() -> list[dict[str, object]]:
    return bundled_tasks("ticket-triage")


async def stand_in_approver(client: Client, approver: Approver,
                            handles: list[WorkflowHandle[AgentJob, JobResult]],
                            done: asyncio.Event) -> int:
    """Approve every pending approval of the demo's jobs as it appears, as the embedded
    stack's ``demo-bot`` (a verified dev identity, through signed assertions)."""
    decided = 0
    while not done.is_set():
        for h in handles:
            try:
                pending = await h.query(AgentJob.pending_approvals)
                for p in pending:
                    await approver.decide(client, h.id, p.approval_id, approve=True,
                                          comment="approved by the demo")
                    decided += 1
            except (RPCError, WorkflowQueryFailedError, WorkflowUpdateFailedError,
                    ApprovalRefused):
                continue  # a restarting worker, or a job that just ended: ask again later
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout=0.5)
    return decided


async def run_demo(settings: Settings, *, n_jobs: int, max_steps: int, console: Console,
                   invoice_jobs: int = 0) -> None:
    """``n_jobs`` bundled tickets (and ``invoice_jobs`` bundled invoices), each graded
    against its ground truth (``warmloop.infra.demo_model.grading``)."""
    from warmloop.infra.demo_model.grading import grade_result

    client = await connect(settings)
    tickets = bundled_tickets()
    invoices = bundled_tasks("invoice-reconciliation")
    run_id = uuid.uuid4().hex[:6]
    jobs: list[tuple[str, str, dict[str, object], int | None]] = [
        ("ticket-triage", f"demo-{run_id}-{i:03d}", tickets[i % len(tickets)], max_steps)
        for i in range(n_jobs)]
    jobs += [("invoice-reconciliation", f"demo-{run_id}-inv-{i:03d}",
              invoices[i % len(invoices)], None) for i in range(invoice_jobs)]
    also = f" and {invoice_jobs} invoice-reconciliation" if invoice_jobs else ""
    console.print(f"running {n_jobs} ticket-triage{also} jobs (run {run_id}) ...")
    started = time.perf_counter()
    handles = [
        await client.start_workflow(
            AgentJob.run,
            JobInput(profile=profile, task=task, max_steps=steps),
            id=job_id, task_queue=AGENT_TASK_QUEUE,
        )
        for profile, job_id, task, steps in jobs
    ]
    done = asyncio.Event()
    approver = asyncio.create_task(stand_in_approver(client, dev_approver(settings), handles, done))
    results: list[JobResult] = list(await asyncio.gather(*(h.result() for h in handles)))
    done.set()
    approved = await approver
    elapsed = time.perf_counter() - started
    s = summarize(results)
    correct: dict[str, tuple[int, int]] = {}
    fields: dict[str, dict[str, int]] = {}
    for r, (_profile, _id, task, _steps) in zip(results, jobs, strict=True):
        grade = grade_result(r, task)
        if grade is None:
            continue
        good, graded = correct.get(r.profile, (0, 0))
        correct[r.profile] = (good + grade.whole_task, graded + 1)
        per = fields.setdefault(r.profile, {})
        for f, ok in grade.fields.items():
            per[f] = per.get(f, 0) + ok

    console.print(report_table(results, title=f"warmloop demo: {len(jobs)} jobs in "
                               f"{elapsed:.1f}s", correct=correct))
    console.print(f"{s.cached_tokens:,} of {s.prompt_tokens:,} prompt tokens came from the "
                  f"engines' prefix caches ({s.cache_share:.1%}); TTFT p50/p95 "
                  f"{s.ttft_p50_ms:.0f}/{s.ttft_p95_ms:.0f} ms; {approved} approvals "
                  "granted by the demo's stand-in approver.")
    for profile, per in fields.items():
        n = correct[profile][1]
        console.print(f"{profile} graded against its ground truth: "
                      + ", ".join(f"{f} {k}/{n}" for f, k in per.items()))
    if settings.serves_demo_model:
        where = ("on 2 CPU cores (make model)" if settings.engine_model == "demo" else
                 "24 times longer on a lent GPU (bench/demo_model_gpu.py)")
        console.print(f"The demo model is a small Llama ({_parameters(settings)}) trained {where} "
                      "from generated transcripts of the bundled agents (infra/demo_model): a "
                      "demo model, not a product model. The bundled tickets and invoices are "
                      "among its training cases; its held-out accuracy is in the README.")
    else:
        console.print("The tiny model has random weights: its tool choices are arbitrary, its "
                      "prefix caching is real.")
    console.print(f"Inspect one job: warmloop result {handles[0].id}    "
                  "All recent jobs: warmloop report --since 1h")
    console.print("Temporal UI: http://127.0.0.1:"
                  f"{settings.temporal_ui_port}    Stop the stack: make down  (warmloop dev down)")
