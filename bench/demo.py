"""`make demo`: run the bundled tickets as ticket-triage jobs and print the report."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from importlib import resources

from rich.console import Console
from rich.table import Table

from bench.report import summarize
from workers.clients import connect
from workers.settings import Settings
from workflows.agent_job import AgentJob
from workflows.contracts import AGENT_TASK_QUEUE, JobInput, JobResult


def bundled_tickets() -> list[dict[str, object]]:
    text = resources.files("activities.data.ticket_triage").joinpath("tickets.jsonl").read_text()
    return [json.loads(line) for line in text.splitlines() if line.strip()]


async def run_demo(settings: Settings, *, n_jobs: int, max_steps: int, console: Console) -> None:
    client = await connect(settings)
    tickets = bundled_tickets()
    run_id = uuid.uuid4().hex[:6]
    console.print(f"running {n_jobs} ticket-triage jobs (run {run_id}) ...")
    started = time.perf_counter()
    handles = [
        await client.start_workflow(
            AgentJob.run,
            JobInput(profile="ticket-triage", task=tickets[i % len(tickets)],
                     max_steps=max_steps),
            id=f"demo-{run_id}-{i:03d}", task_queue=AGENT_TASK_QUEUE,
        )
        for i in range(n_jobs)
    ]
    results: list[JobResult] = await asyncio.gather(*(h.result() for h in handles))
    elapsed = time.perf_counter() - started
    s = summarize(results)

    table = Table(title=f"warmloop demo: {n_jobs} ticket-triage jobs in {elapsed:.1f}s",
                  show_header=True)
    table.add_column("figure")
    table.add_column("value", justify="right")
    table.add_row("jobs finished (all terminal states)", str(s.jobs))
    for state, n in sorted(s.states.items()):
        table.add_row(f"  {state}", str(n))
    table.add_row("model steps", str(s.steps))
    table.add_row("prompt tokens", f"{s.prompt_tokens:,}")
    table.add_row("  served from cache (engine-reported)", f"{s.cached_tokens:,}")
    table.add_row("share of prompt tokens from cache", f"{s.cache_share:.1%}")
    table.add_row("steps after a job's first with cached tokens",
                  f"{s.later_steps_cached}/{s.later_steps}")
    table.add_row("TTFT p50 / p95 (ms)", f"{s.ttft_p50_ms:.0f} / {s.ttft_p95_ms:.0f}")
    console.print(table)
    console.print("The tiny model has random weights: its tool choices are arbitrary, its "
                  "prefix caching is real.")
    console.print(f"Inspect one job: warmloop result {handles[0].id}")
    console.print("Temporal UI: http://127.0.0.1:"
                  f"{settings.temporal_ui_port}   Stop the stack: make down  (warmloop dev down)")
