"""`make bench-burst`: a nightly-style burst of ticket and invoice jobs, naive vs the
batch lane, while a trickle of interactive jobs runs.

(a) naive: every job started at once as an ordinary job, round-robin per step, no lanes;
(b) warmloop: two ``BatchRun``s (tickets, invoices) in the batch lane: cache-aware
    routing that packs the burst by profile, lower vLLM and Temporal priority, and each
    engine admitting at most K batch steps (K adapted to interactive TTFT).

Interactive TTFT p95 is measured idle, during (a) and during (b). Prefill tokens come
from the engines' own counters. The bench runs its own stack with small KV pools; the
last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table
from temporalio.client import Client

from bench.common import (
    bench_settings,
    bench_stack,
    counters_of,
    delta,
    histogram_quantile_ms,
    pct,
    prefill_computed,
    reset_caches,
    run_main,
    scrape,
    ttft_buckets_of,
)
from warmloop.workers.clients import build_s3
from warmloop.workers.demo import bundled_tasks
from warmloop.workers.report import breakdown_table, step_breakdown
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.batch_run import BatchInput, BatchResult, BatchRun
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput, JobResult, Lane, StepRecord
from warmloop.workflows.lanes import AdmissionConfig

# Tools that never wait for a human (urgent priorities and large payments do).
TOOLS = {"ticket-triage": ["lookup_customer", "search_kb", "draft_reply", "finish"],
         "invoice-reconciliation": ["fetch_invoice", "fetch_purchase_order", "compare_lines",
                                    "flag_discrepancy", "finish"]}
# The burst's jobs are not offered `finish`: each runs exactly --max-steps steps, so
# both phases do the same work (the random model otherwise ends jobs at random steps,
# and a phase that happened to run more steps would compute more prefill).
BURST_TOOLS = {p: [t for t in tools if t != "finish"] for p, tools in TOOLS.items()}


@dataclass
class Phase:
    name: str
    interactive_ttfts: list[float]
    prefill_tokens: int
    """All traffic, from the engines' counters (the trickle runs as long as the burst)."""
    engine_ttft_p95_ms: float | None
    """All requests (both lanes), from the engines' own TTFT histogram: the bound of the
    bucket holding p95."""
    interactive_prefill_tokens: int
    """The trickle's steps, from the engines' per-request usage."""
    batch_prefill_tokens: int
    """The burst's steps, from the engines' per-request usage."""
    batch_prompt_by_step: list[float]
    """Mean prompt tokens of the burst's k-th steps: the simulator's job sizes
    (``sim/scenarios.py: bench_burst``) are checked against them."""
    batch_completion_by_step: list[float]
    """Mean completion tokens of the burst's k-th steps (the calls' lengths)."""
    makespan_s: float
    batch_states: dict[str, int]
    interactive_jobs: int
    route_reasons: dict[str, int]
    batch_step_records: list[StepRecord]
    """The burst's steps as recorded, with where each step's time went (``StepTiming``)."""
    batch_step_rows: list[dict[str, Any]] = field(default_factory=list)
    """The same steps as rows with their job (``--steps-json``): which engine each step
    ran on and what it found cached, to set beside the simulator's steps."""

    @property
    def batch_steps(self) -> int:
        return len(self.batch_step_records)

    @property
    def batch_prompt_tokens(self) -> int:
        """The burst's steps' prompt tokens (computed or cached), from their usage."""
        return sum(st.prompt_tokens for st in self.batch_step_records)


async def trickle(client: Client, stop: asyncio.Event, tag: str, gap_s: float,
                  max_steps: int) -> list[JobResult]:
    """Interactive ticket jobs, one every ``gap_s``, until ``stop``."""
    tickets = bundled_tasks("ticket-triage")
    running: list[asyncio.Task[JobResult]] = []
    i = 0
    while not stop.is_set():
        job = JobInput(profile="ticket-triage", task=tickets[i % len(tickets)],
                       max_steps=max_steps, tools=TOOLS["ticket-triage"])
        running.append(asyncio.ensure_future(client.execute_workflow(
            AgentJob.run, job, id=f"burst-{tag}-i{i:03d}", task_queue=AGENT_TASK_QUEUE)))
        i += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=gap_s)
    return list(await asyncio.gather(*running))


def ttfts(results: list[JobResult]) -> list[float]:
    return [s.ttft_ms for r in results for s in r.steps]


def computed(results: list[JobResult]) -> int:
    """Prompt tokens the engines computed for these jobs' steps (their usage's
    ``prompt_tokens - cached_tokens``)."""
    return sum(s.prompt_tokens - s.cached_tokens for r in results for s in r.steps)


def by_step(results: list[JobResult], field: str = "prompt_tokens") -> list[float]:
    """The mean of a step's ``field`` (its usage's tokens) at each step index."""
    by: dict[int, list[int]] = {}
    for r in results:
        for k, st in enumerate(r.steps):
            by.setdefault(k, []).append(getattr(st, field))
    return [round(sum(v) / len(v), 1) for _, v in sorted(by.items())]


def reasons(results: list[JobResult]) -> dict[str, int]:
    """How the burst's steps were placed (a failover re-prefills the job elsewhere)."""
    return dict(Counter(s.route_reason for r in results for s in r.steps))


def states(results: list[JobResult]) -> dict[str, int]:
    return dict(Counter(r.state.value for r in results))


async def naive_burst(client: Client, tasks: list[tuple[str, dict[str, Any]]], tag: str,
                      max_steps: int) -> list[JobResult]:
    """Everything at once, as ordinary interactive jobs, round-robin per step."""
    return list(await asyncio.gather(*(
        client.execute_workflow(
            AgentJob.run,
            JobInput(profile=p, task=t, max_steps=max_steps, tools=BURST_TOOLS[p],
                     routing="round_robin", lane=Lane.INTERACTIVE, hold_policy="never"),
            id=f"burst-{tag}-n{i:03d}", task_queue=AGENT_TASK_QUEUE)
        for i, (p, t) in enumerate(tasks))))


async def lane_burst(client: Client, s3: Any, bucket: str, tasks: list[tuple[str, dict[str, Any]]],
                     tag: str, max_steps: int, window: int | None,
                     console: Console | None = None) -> list[BatchResult]:
    """One BatchRun per profile in the batch lane, every record submitted at once; each
    run keeps ``window`` jobs in progress (what the KV pools hold between steps; None:
    what the fleet answers, ``lanes.fleet_batch_window``)."""
    runs = []
    for profile in TOOLS:
        lines = [json.dumps(t) for p, t in tasks if p == profile]
        key = f"bench/{tag}/{profile}.jsonl"
        await asyncio.to_thread(s3.put_object, Bucket=bucket, Key=key,
                                Body=("\n".join(lines) + "\n").encode())
        inp = BatchInput(profile=profile, source=f"s3://{bucket}/{key}",
                         window=None if window is None else min(window, len(lines)),
                         max_window=len(lines),
                         page_size=len(lines), max_steps=max_steps,
                         tools=BURST_TOOLS[profile])
        runs.append(client.execute_workflow(BatchRun.run, inp, id=f"burst-{tag}-b-{profile}",
                                            task_queue=AGENT_TASK_QUEUE))
    results = list(await asyncio.gather(*runs))
    if window is None and console is not None:
        for profile in TOOLS:
            handle = client.get_workflow_handle(f"burst-{tag}-b-{profile}")
            asked = (await handle.query(BatchRun.progress)).fleet_window
            console.print(f"  {profile}: window {asked.window if asked else '?'} from the "
                          f"fleet: {asked.why if asked else 'not asked'}")
    return results


async def batch_job_results(client: Client, batches: list[BatchResult]) -> list[JobResult]:
    """The child jobs' results (for their prefill and end states)."""
    out = []
    for b in batches:
        async for w in client.list_workflows(f"WorkflowId STARTS_WITH '{b.batch_id}-L'"):
            h = client.get_workflow_handle(w.id, result_type=JobResult)
            out.append(await h.result())
    return out


async def phase(name: str, client: Client, http: httpx.AsyncClient, urls: list[str],
                redis: aioredis.Redis, engine_ids: list[str], args: argparse.Namespace,
                burst: Any) -> Phase:
    await reset_caches(http, urls, redis, engine_ids)
    before = await scrape(http, urls)
    stop = asyncio.Event()
    tag = f"{name}-{uuid.uuid4().hex[:6]}"
    interactive = asyncio.ensure_future(trickle(client, stop, tag, args.trickle_gap_s,
                                                args.interactive_steps))
    t0 = time.monotonic()
    if burst is None:
        await asyncio.sleep(args.idle_s)  # the idle phase: only the trickle runs
        batch: list[JobResult] = []
    else:
        batch = await burst(tag)
    makespan = time.monotonic() - t0
    stop.set()
    inter = await interactive
    after = await scrape(http, urls)
    d = delta(counters_of(after), counters_of(before))
    engine_p95 = histogram_quantile_ms(ttft_buckets_of(after), ttft_buckets_of(before), .95)
    return Phase(name=name, interactive_ttfts=ttfts(inter), prefill_tokens=prefill_computed(d),
                 engine_ttft_p95_ms=engine_p95, interactive_prefill_tokens=computed(inter),
                 batch_prefill_tokens=computed(batch),
                 batch_prompt_by_step=by_step(batch),
                 batch_completion_by_step=by_step(batch, "completion_tokens"),
                 makespan_s=makespan if burst else 0.0, batch_states=states(batch),
                 interactive_jobs=len(inter), route_reasons=reasons(batch),
                 batch_step_records=[st for r in batch for st in r.steps],
                 batch_step_rows=[{"job": r.job_id, **st.model_dump(
                     include={"step", "engine_id", "prompt_tokens", "cached_tokens",
                              "completion_tokens", "ttft_ms", "latency_ms", "timing"})}
                                  for r in batch for st in r.steps])


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    settings = bench_settings(
        "burst", engines=2, kv_cache_bytes=args.kv_cache_bytes,
        admission=AdmissionConfig(interactive_ttft_target_ms=args.ttft_target_ms,
                                  k_min=args.k_min, k_start=args.k_start,
                                  k_max=args.k_max,
                                  fleet_signal=args.fleet_signal))
    s3 = build_s3(settings)
    pool = {p: bundled_tasks(p) for p in TOOLS}
    half = args.jobs // 2
    tasks = [("ticket-triage", pool["ticket-triage"][i % len(pool["ticket-triage"])])
             for i in range(half)] + \
        [("invoice-reconciliation", pool["invoice-reconciliation"][i % 20])
         for i in range(args.jobs - half)]
    async with (bench_stack(settings, console, keep=args.keep_stack) as fleet,
                httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as http):
        client = fleet.client

        async def naive(tag: str) -> list[JobResult]:
            return await naive_burst(client, tasks, tag, args.max_steps)

        async def lanes(tag: str) -> list[JobResult]:
            batches = await lane_burst(client, s3, settings.s3_bucket, tasks, tag,
                                       args.max_steps, args.window)
            return await batch_job_results(client, batches)

        async def lanes_fleet(tag: str) -> list[JobResult]:
            batches = await lane_burst(client, s3, settings.s3_bucket, tasks, tag,
                                       args.max_steps, None, console)
            return await batch_job_results(client, batches)

        phases = {}
        for name, burst in (("idle", None), ("naive", naive), ("lanes", lanes),
                            ("lanes-fleet", lanes_fleet)):
            if name not in args.phases:
                continue
            console.print(f"phase {name} ...")
            phases[name] = p = await phase(name, client, http, fleet.urls, fleet.redis,
                                           fleet.engine_ids, args, burst)
            console.print(f"  interactive TTFT p50/p95 {pct(p.interactive_ttfts, .5):.0f}/"
                          f"{pct(p.interactive_ttfts, .95):.0f} ms over "
                          f"{len(p.interactive_ttfts)} steps; prefill {p.prefill_tokens:,};"
                          f" makespan {p.makespan_s:.1f}s; {p.batch_states};"
                          f" routes {p.route_reasons}")
            if p.batch_step_records:
                console.print(breakdown_table(p.batch_step_records,
                                              title=f"the burst's steps, {name}"))
    if args.steps_json:
        args.steps_json.write_text(json.dumps(
            {k: v.batch_step_rows for k, v in phases.items() if v.batch_step_rows}))
        console.print(f"steps written to {args.steps_json}")
    if set(phases) != {"idle", "naive", "lanes"}:
        return {k: {"ttft_p50_ms": pct(v.interactive_ttfts, .5),
                    "ttft_p95_ms": pct(v.interactive_ttfts, .95), "makespan_s": v.makespan_s,
                    "burst_prefill_tokens": v.batch_prefill_tokens,
                    "burst_prompt_tokens": v.batch_prompt_tokens,
                    "burst_prompt_tokens_by_step": v.batch_prompt_by_step,
                    "burst_completion_tokens_by_step": v.batch_completion_by_step}
                for k, v in phases.items()}
    return summarize(phases, console)


def summarize(ph: dict[str, Phase], console: Console) -> dict[str, Any]:
    naive, lanes = ph["naive"], ph["lanes"]
    p95 = {k: pct(v.interactive_ttfts, .95) for k, v in ph.items()}
    table = Table(title="bench-burst: 2 engines, engines' own counters")
    for c in ("figure", "naive (no lanes, round-robin)", "warmloop batch lane", "ratio"):
        table.add_column(c, justify="right")
    burst = {k: v.prefill_tokens - v.interactive_prefill_tokens for k, v in ph.items()}
    table.add_row("prefill tokens of the burst (engines' counters - the trickle's steps)",
                  f"{burst['naive']:,}", f"{burst['lanes']:,}",
                  f"{burst['lanes'] / max(1, burst['naive']):.2f}x (target <= 0.80)")
    table.add_row("  the same, summed over the burst's steps' usage",
                  f"{naive.batch_prefill_tokens:,}", f"{lanes.batch_prefill_tokens:,}",
                  f"{lanes.batch_prefill_tokens / max(1, naive.batch_prefill_tokens):.2f}x")
    table.add_row("  all traffic (the trickle runs as long as the burst)",
                  f"{naive.prefill_tokens:,}", f"{lanes.prefill_tokens:,}",
                  f"{lanes.prefill_tokens / max(1, naive.prefill_tokens):.2f}x; trickle "
                  f"{naive.interactive_prefill_tokens:,} / {lanes.interactive_prefill_tokens:,}")
    table.add_row("burst makespan", f"{naive.makespan_s:.1f}s", f"{lanes.makespan_s:.1f}s",
                  f"{lanes.makespan_s / max(1e-9, naive.makespan_s):.2f}x (target <= 1.10)")
    table.add_row("interactive TTFT p95", f"{p95['naive']:.0f} ms", f"{p95['lanes']:.0f} ms",
                  f"idle {p95['idle']:.0f} ms; lanes {p95['lanes'] / max(1e-9, p95['idle']):.2f}x"
                  f" idle (target <= 2), no lanes {p95['naive'] / max(1e-9, p95['idle']):.2f}x")
    eng = {k: v.engine_ttft_p95_ms for k, v in ph.items()}
    table.add_row("engines' own TTFT p95, every request (histogram bucket bound)",
                  f"<= {eng['naive']} ms", f"<= {eng['lanes']} ms", f"idle <= {eng['idle']} ms")
    table.add_row("burst steps", f"{naive.batch_steps}", f"{lanes.batch_steps}", "")
    table.add_row("burst jobs' end states", str(naive.batch_states), str(lanes.batch_states), "")
    console.print(table)
    return {
        "naive_prefill_tokens": burst["naive"],
        "warmloop_prefill_tokens": burst["lanes"],
        "naive_burst_steps_usage_prefill_tokens": naive.batch_prefill_tokens,
        "warmloop_burst_steps_usage_prefill_tokens": lanes.batch_prefill_tokens,
        "naive_all_traffic_prefill_tokens": naive.prefill_tokens,
        "warmloop_all_traffic_prefill_tokens": lanes.prefill_tokens,
        "trickle_prefill_tokens": {k: v.interactive_prefill_tokens for k, v in ph.items()},
        "naive_makespan_s": round(naive.makespan_s, 2),
        "warmloop_makespan_s": round(lanes.makespan_s, 2),
        "interactive_ttft_p95_idle_ms": round(p95["idle"], 1),
        "interactive_ttft_p95_burst_lanes_ms": round(p95["lanes"], 1),
        "interactive_ttft_p95_burst_nolanes_ms": round(p95["naive"], 1),
        "engine_ttft_p95_all_requests_ms": eng,
        "interactive_ttft_p50_ms": {k: round(pct(v.interactive_ttfts, .5), 1)
                                    for k, v in ph.items()},
        "interactive_steps": {k: len(v.interactive_ttfts) for k, v in ph.items()},
        "burst_steps": {"naive": naive.batch_steps, "warmloop": lanes.batch_steps},
        "burst_prompt_tokens": {"naive": naive.batch_prompt_tokens,
                                "warmloop": lanes.batch_prompt_tokens},
        "burst_prompt_tokens_by_step": {"naive": naive.batch_prompt_by_step,
                                        "warmloop": lanes.batch_prompt_by_step},
        "burst_completion_tokens_by_step": {"naive": naive.batch_completion_by_step,
                                            "warmloop": lanes.batch_completion_by_step},
        "burst_states": {"naive": naive.batch_states, "warmloop": lanes.batch_states},
        "burst_route_reasons": {"naive": naive.route_reasons, "warmloop": lanes.route_reasons},
        "burst_stage_mean_ms": {
            k: {stage: round(f["mean"], 1)
                for stage, f in step_breakdown(v.batch_step_records).items()}
            for k, v in (("naive", naive), ("warmloop", lanes))},
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=100)
    p.add_argument("--max-steps", type=int, default=5)
    p.add_argument("--interactive-steps", type=int, default=3)
    p.add_argument("--trickle-gap-s", type=float, default=2.0)
    p.add_argument("--idle-s", type=float, default=90.0,
                   help="the idle baseline: ~1.4 interactive steps a second")
    p.add_argument("--kv-cache-bytes", type=int, default=24 * 1024 * 1024,
                   help="per engine; 24 MiB is 12,288 tokens of the tiny model: the burst's "
                   "working set (~50k tokens) does not fit in the two pools at once")
    p.add_argument("--ttft-target-ms", type=float, default=300.0,
                   help="batch admission's interactive TTFT p95 target")
    p.add_argument("--k-min", type=int, default=1,
                   help="0: an engine may admit no batch step while interactive TTFT is "
                   "over target")
    p.add_argument("--k-start", type=int, default=4)
    p.add_argument("--k-max", type=int, default=16)
    p.add_argument("--window", type=int, default=16,
                   help="jobs in progress per BatchRun (two runs): ~2 x 16 jobs' own "
                   "tokens fit in the two 12k-token pools beside the shared prefixes")
    p.add_argument("--fleet-signal", action="store_true",
                   help="K also answers to the other engines' interactive TTFT")
    p.add_argument("--keep-stack", action="store_true")
    p.add_argument("--steps-json", type=Path, default=None,
                   help="write the burst's steps (job, step, engine, prompt and cached "
                   "tokens, stage times) per phase to this file")
    p.add_argument("--phases", nargs="+", default=["idle", "naive", "lanes"],
                   choices=["idle", "naive", "lanes", "lanes-fleet"],
                   help="run only these (diagnosis); the summary needs idle, naive and "
                   "lanes alone. lanes-fleet: the batch lane with each BatchRun's window "
                   "asked of the fleet (no window given)")
    run_main(p, main_async, argv)


if __name__ == "__main__":
    main()
