"""`make bench-hedge`: hedged tool calls against a tool with a heavy latency tail.

Real AgentJobs on the real stack call one read-only HTTP tool (``bench.hedge_plugin``)
that this process serves: each request, independently, takes a lognormal ~50-150 ms,
or (``--slow-share`` of them) several seconds, as a cold cache or a stalled backend
would. The same workload runs with ``JobInput.hedge_tools`` on and off, interleaved
``--repeat`` times (the order rotated each repeat).

- Tool latency is what the job saw: the ``run_tool`` activity's time in each job's
  Temporal history (scheduled to completed), so a hedge's win and its overhead both
  count.
- Job latency is each job's wall time (Temporal's start and close times).
- Extra calls are counted by the tool itself: requests marked ``X-Warmloop-Hedge``
  over the calls (unmarked requests); the workers' own count (Redis
  ``warmloop:tool_hedges``) is shown beside it, and the tool counts the losers it saw
  hang up (cancelled).

Before the first run the pause statistics are warmed with ``--warm-calls`` direct
calls to the tool (their latencies recorded as the worker records a call's), so the
hedge has an observed p95 from the first job on; the runs then add their own. The
last line of output is one JSON object: the medians, and ``ranges`` with the same keys.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import httpx
import redis.asyncio as aioredis
import uvicorn
from rich.console import Console
from rich.table import Table
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio.client import Client, WorkflowHandle

from bench.common import (
    BENCH_OFFSETS,
    bench_settings,
    bench_stack,
    fmt_range,
    medians_and_ranges,
    pct,
    policy_cell,
    rotated,
    run_main,
)
from bench.hedge_plugin import PROFILE_NAME, URL_ENV
from bench.synthetic_profiles import LOOKUP_KEYS, WORDS
from warmloop.activities.pauses import PauseStats, tool_kind
from warmloop.activities.tools.hedging import Hedging, hedge_counts
from warmloop.workers.plugins import load_plugins
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput, JobResult
from warmloop.workflows.profiles import get_profile

TOOL_PORT = 9500 + BENCH_OFFSETS["hedge"]
"""The heavy-tailed tool's HTTP server (apart from every bench stack's ports)."""
TOOL_URL = f"http://127.0.0.1:{TOOL_PORT}"
"""Where the hedge plugin's tools are served (``serving``): its ``WARMLOOP_HEDGE_TOOL_URL``."""
PLUGINS = "bench.plugin,bench.hedge_plugin"
POLICIES = {"plain": False, "hedged": True}


@dataclass(frozen=True)
class Latency:
    """A fast lognormal body and a slow uniform tail, drawn per request."""

    median_s: float
    sigma: float
    slow_share: float
    slow_min_s: float
    slow_max_s: float

    def draw(self, rng: random.Random) -> float:
        if rng.random() < self.slow_share:
            return rng.uniform(self.slow_min_s, self.slow_max_s)
        return self.median_s * math.exp(self.sigma * rng.gauss(0.0, 1.0))


@dataclass
class Served:
    """What the tool saw of one run's jobs."""

    calls: int = 0
    hedges: int = 0
    hung_up: int = 0
    """Requests whose caller went away before the answer (a cancelled loser)."""


class ToolServer:
    """The heavy-tailed tool: POST /lookup, answered after a drawn latency unless the
    caller hangs up first. Counts per run, by the job id's run tag."""

    def __init__(self, latency: Latency, seed: int) -> None:
        self.latency = latency
        self.rng = random.Random(seed)
        self.runs: dict[str, Served] = {}
        self.app = Starlette(routes=[Route("/lookup", self.lookup, methods=["POST"])])

    def served(self, job_id: str) -> Served:
        tag = job_id.rsplit("-", 1)[0]
        return self.runs.setdefault(tag, Served())

    async def lookup(self, request: Request) -> Response:
        args = await request.json()
        served = self.served(request.headers.get("x-warmloop-job", "warmup"))
        if request.headers.get("x-warmloop-hedge") == "1":
            served.hedges += 1
        else:
            served.calls += 1
        delay = self.latency.draw(self.rng)
        answer = asyncio.ensure_future(asyncio.sleep(delay))
        gone = asyncio.ensure_future(disconnected(request))
        done, _ = await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
        answer.cancel()
        gone.cancel()
        if gone in done:
            served.hung_up += 1
            return Response(status_code=499)
        words = " ".join(self.rng.choice(WORDS) for _ in range(12))
        return JSONResponse({"key": args.get("key"), "record": words})


async def disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass


@contextlib.asynccontextmanager
async def serving(app: Starlette) -> AsyncIterator[None]:
    """Serve ``app`` (the tool) on ``TOOL_PORT`` in this process while the block runs."""
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=TOOL_PORT,
                                           log_level="warning", lifespan="off",
                                           access_log=False))
    task = asyncio.create_task(server.serve())
    while not server.started:
        if task.done():
            task.result()  # raises why it could not start (the port is taken, ...)
        await asyncio.sleep(0.05)
    try:
        yield
    finally:
        server.should_exit = True
        await task


@dataclass
class PolicyRun:
    policy: str
    tool_ms: list[float] = field(default_factory=list)
    job_s: list[float] = field(default_factory=list)
    tool_failures: int = 0
    served: Served = field(default_factory=Served)
    worker_calls: int = 0
    worker_hedged: int = 0
    worker_hedge_won: int = 0
    states: dict[str, int] = field(default_factory=dict)


async def tool_times(handle: WorkflowHandle[Any, Any]) -> tuple[list[float], int]:
    """The ``run_tool`` activities' times (ms, scheduled to completed) in a job's
    history, and how many of them failed or timed out."""
    scheduled: dict[int, float] = {}
    out: list[float] = []
    failed = 0
    async for e in handle.fetch_history_events():
        t = e.event_time.ToDatetime().timestamp()
        if e.HasField("activity_task_scheduled_event_attributes"):
            if e.activity_task_scheduled_event_attributes.activity_type.name == "run_tool":
                scheduled[e.event_id] = t
        elif e.HasField("activity_task_completed_event_attributes"):
            sid = e.activity_task_completed_event_attributes.scheduled_event_id
            if sid in scheduled:
                out.append((t - scheduled[sid]) * 1000)
        elif e.HasField("activity_task_failed_event_attributes"):
            failed += e.activity_task_failed_event_attributes.scheduled_event_id in scheduled
        elif e.HasField("activity_task_timed_out_event_attributes"):
            failed += e.activity_task_timed_out_event_attributes.scheduled_event_id in scheduled
    return out, failed


async def run_policy(name: str, client: Client, redis: aioredis.Redis, tool: ToolServer,
                     args: argparse.Namespace, rep: int) -> PolicyRun:
    out = PolicyRun(policy=name)
    tag = f"hedge-{name}-{uuid.uuid4().hex[:6]}"
    before = await hedge_counts(redis)
    rng = random.Random(f"{args.seed}/{rep}")
    handles: list[WorkflowHandle[Any, JobResult]] = []
    for i in range(args.jobs):
        text = " ".join(rng.choice(WORDS) for _ in range(30))
        job = JobInput(profile=PROFILE_NAME, task={"case_id": f"S{i:04d}", "text": text},
                       max_steps=args.steps, tools=["lookup"], hold_policy="never",
                       hedge_tools=POLICIES[name])
        handles.append(await client.start_workflow(
            AgentJob.run, job, id=f"{tag}-{i:03d}", task_queue=AGENT_TASK_QUEUE))
        await asyncio.sleep(args.gap_s)
    for h in handles:
        r = await h.result()
        out.states[r.state.value] = out.states.get(r.state.value, 0) + 1
    for h in handles:
        times, failed = await tool_times(h)
        out.tool_ms += times
        out.tool_failures += failed
        desc = await h.describe()
        if desc.close_time and desc.start_time:
            out.job_s.append((desc.close_time - desc.start_time).total_seconds())
    out.served = tool.runs.get(tag, Served())
    after = await hedge_counts(redis)

    def grew(what: str) -> int:
        k = (PROFILE_NAME, "lookup", what)
        return after.get(k, 0) - before.get(k, 0)

    out.worker_calls, out.worker_hedged = grew("calls"), grew("hedged")
    out.worker_hedge_won = grew("hedge_won")
    return out


async def warm(tool_url: str, redis: aioredis.Redis, n: int) -> list[float]:
    """``n`` direct calls (16 at a time), each one's latency recorded in the pause
    statistics as the worker records a call: the hedge's p95 from the first job on."""
    stats = PauseStats(redis)
    lat: list[float] = []
    gate = asyncio.Semaphore(16)
    async with httpx.AsyncClient(timeout=60.0) as http:

        async def one(i: int) -> None:
            async with gate:
                t = time.monotonic()
                (await http.post(tool_url, json={"key": LOOKUP_KEYS[i % len(LOOKUP_KEYS)]},
                                 headers={"X-Warmloop-Job": "warmup-0"})).raise_for_status()
                s = time.monotonic() - t
                lat.append(s)
                await stats.record(PROFILE_NAME, tool_kind("lookup"), s)

        await asyncio.gather(*(one(i) for i in range(n)))
    return lat


async def threshold_ms(redis: aioredis.Redis) -> float | None:
    """The hedge threshold the workers use now (p95 of the pause statistics)."""
    profile = get_profile(PROFILE_NAME)
    delay = await Hedging(PauseStats(redis)).delay_s(profile, profile.tool("lookup"))
    return None if delay is None else delay * 1000


def hedge_settings(*, kv_cache_bytes: int = 16 * 1024 * 1024) -> Settings:
    """This bench's stack (port offset 60), whose workers also load ``bench.hedge_plugin``
    with its tools at this process's tool server."""
    os.environ[URL_ENV] = TOOL_URL
    settings = bench_settings("hedge", engines=2, kv_cache_bytes=kv_cache_bytes)
    load_plugins(plugins=PLUGINS)
    return settings.model_copy(update={"plugins": PLUGINS})


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    settings = hedge_settings(kv_cache_bytes=args.kv_cache_bytes)
    tool_url = f"{TOOL_URL}/lookup"
    latency = Latency(median_s=args.median_ms / 1000, sigma=args.sigma,
                      slow_share=args.slow_share, slow_min_s=args.slow_min_s,
                      slow_max_s=args.slow_max_s)
    tool = ToolServer(latency, args.seed)
    repeats: list[dict[str, Any]] = []
    pooled: dict[str, PolicyRun] = {n: PolicyRun(policy=n) for n in args.policies}
    async with serving(tool.app), bench_stack(settings, console,
                                              keep=args.keep_stack) as fleet:
        warmed = await warm(tool_url, fleet.redis, args.warm_calls)
        thresholds = [await threshold_ms(fleet.redis) or 0.0]
        console.print(f"warmed the pause statistics with {len(warmed)} direct calls: p50 "
                      f"{pct(warmed, .5) * 1000:.0f} ms, p95 {pct(warmed, .95) * 1000:.0f} ms, "
                      f"p99 {pct(warmed, .99) * 1000:.0f} ms; hedge threshold "
                      f"{thresholds[0]:.0f} ms")
        for rep in range(args.repeat):
            runs: dict[str, PolicyRun] = {}
            for name in rotated(list(args.policies), rep):
                console.print(f"repeat {rep + 1}/{args.repeat}, {name}: {args.jobs} jobs of "
                              f"{args.steps} steps ...")
                t0 = time.monotonic()
                r = runs[name] = await run_policy(name, fleet.client, fleet.redis, tool, args,
                                                  rep)
                pooled[name].tool_ms += r.tool_ms
                pooled[name].job_s += r.job_s
                console.print(
                    f"  {len(r.tool_ms)} tool calls: p50 {pct(r.tool_ms, .5):.0f} ms, p99 "
                    f"{pct(r.tool_ms, .99):.0f} ms; hedges {r.served.hedges} "
                    f"(workers counted {r.worker_hedged}, the hedge won {r.worker_hedge_won}), "
                    f"losers hung up {r.served.hung_up}; job p99 {pct(r.job_s, .99):.1f} s; "
                    f"{r.states}; {time.monotonic() - t0:.0f} s")
            repeats.append(figures(runs))
            thresholds.append(await threshold_ms(fleet.redis) or 0.0)
            console.print(f"  hedge threshold now {thresholds[-1]:.0f} ms")
    medians, ranges = medians_and_ranges(repeats)
    whole = {
        "tool_calls": {n: len(r.tool_ms) for n, r in pooled.items()},
        "tool_p99_ms": {n: round(pct(r.tool_ms, .99), 1) for n, r in pooled.items()},
        "job_p99_s": {n: round(pct(r.job_s, .99), 2) for n, r in pooled.items()},
    }
    report(medians, ranges, len(repeats), console, whole, thresholds)
    return {**medians, "ranges": ranges, "repeats": len(repeats), "pooled": whole,
            "threshold_ms": [round(t, 1) for t in thresholds],
            "workload": {"jobs": args.jobs, "steps": args.steps, "median_ms": args.median_ms,
                         "sigma": args.sigma, "slow_share": args.slow_share,
                         "slow_s": [args.slow_min_s, args.slow_max_s],
                         "warm_calls": args.warm_calls}}


def figures(runs: dict[str, PolicyRun]) -> dict[str, Any]:
    """One repeat's figures (the JSON keys; the medians over repeats are reported)."""
    plain, hedged = runs.get("plain"), runs.get("hedged")

    def per(f: Any) -> dict[str, Any]:
        return {k: f(v) for k, v in runs.items()}

    out: dict[str, Any] = {
        "tool_calls": per(lambda r: len(r.tool_ms)),
        "tool_p50_ms": per(lambda r: round(pct(r.tool_ms, .5), 1)),
        "tool_p95_ms": per(lambda r: round(pct(r.tool_ms, .95), 1)),
        "tool_p99_ms": per(lambda r: round(pct(r.tool_ms, .99), 1)),
        "tool_max_ms": per(lambda r: round(max(r.tool_ms, default=0.0), 1)),
        "job_p50_s": per(lambda r: round(pct(r.job_s, .5), 2)),
        "job_p99_s": per(lambda r: round(pct(r.job_s, .99), 2)),
        "extra_calls": per(lambda r: round(r.served.hedges / max(1, r.served.calls), 4)),
        "worker_extra_calls": per(lambda r: round(r.worker_hedged / max(1, r.worker_calls), 4)),
        "hedge_won": per(lambda r: r.worker_hedge_won),
        "losers_hung_up": per(lambda r: r.served.hung_up),
        "tool_failures": per(lambda r: r.tool_failures),
        "states": per(lambda r: r.states),
    }
    if plain and hedged:
        out |= {
            "tool_p99_ms_plain": out["tool_p99_ms"]["plain"],
            "tool_p99_ms_hedged": out["tool_p99_ms"]["hedged"],
            "tool_p99_ratio": round(out["tool_p99_ms"]["plain"]
                                    / max(1e-9, out["tool_p99_ms"]["hedged"]), 3),
            "extra_call_share": out["extra_calls"]["hedged"],
            "job_p99_s_plain": out["job_p99_s"]["plain"],
            "job_p99_s_hedged": out["job_p99_s"]["hedged"],
        }
    return out


def report(m: dict[str, Any], rg: dict[str, Any], n: int, console: Console,
           whole: dict[str, Any], thresholds: list[float]) -> None:
    table = Table(title=f"bench-hedge: medians \\[ranges] of {n} interleaved repeats; tool "
                        "latency as the jobs saw it (run_tool, scheduled to completed)")
    for c in ("policy", "tool calls", "tool p50 ms", "tool p95 ms", "tool p99 ms",
              "tool max ms", "job p50 s", "job p99 s", "extra calls", "losers hung up",
              "end states"):
        table.add_column(c, justify="right")
    for name in m["tool_calls"]:
        table.add_row(
            name, policy_cell(m, rg, "tool_calls", name, ".0f"),
            policy_cell(m, rg, "tool_p50_ms", name, ".0f"),
            policy_cell(m, rg, "tool_p95_ms", name, ".0f"),
            policy_cell(m, rg, "tool_p99_ms", name, ".0f"),
            policy_cell(m, rg, "tool_max_ms", name, ".0f"),
            policy_cell(m, rg, "job_p50_s", name, ".1f"),
            policy_cell(m, rg, "job_p99_s", name, ".1f"),
            policy_cell(m, rg, "extra_calls", name, ".1%"),
            policy_cell(m, rg, "losers_hung_up", name, ".0f"),
            ", ".join(f"{k} {v}" for k, v in sorted((m["states"].get(name) or {}).items())))
    console.print(table)
    if "tool_p99_ratio" in m:
        ratio = fmt_range(m["tool_p99_ratio"], rg.get("tool_p99_ratio"), ".1f")
        console.print(
            f"targets (medians): tool p99 {ratio}x lower with hedging (target >= 3); extra calls "
            f"{fmt_range(m['extra_call_share'], rg.get('extra_call_share'), '.3f')} of calls "
            f"(target <= 0.10; the workers counted "
            f"{m['worker_extra_calls'].get('hedged', 0):.3f}); job p99 "
            f"{m['job_p99_s_plain']:.1f} s -> {m['job_p99_s_hedged']:.1f} s")
    console.print(
        "pooled over the repeats: " + "; ".join(
            f"{name} {whole['tool_calls'][name]} tool calls, tool p99 "
            f"{whole['tool_p99_ms'][name]:.0f} ms, job p99 {whole['job_p99_s'][name]:.1f} s"
            for name in whole["tool_calls"])
        + "; hedge threshold (p95 of the pause statistics) "
        + " -> ".join(f"{t:.0f}" for t in thresholds) + " ms")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=12, help="jobs per run, started together")
    p.add_argument("--steps", type=int, default=16,
                   help="steps per job (each calls the tool unless the model's call is "
                        "invalid)")
    p.add_argument("--gap-s", type=float, default=0.1, help="between job starts")
    p.add_argument("--median-ms", type=float, default=80.0, help="the tool's body median")
    p.add_argument("--sigma", type=float, default=0.3, help="the body's lognormal sigma")
    p.add_argument("--slow-share", type=float, default=0.03,
                   help="share of requests that are slow, independently per request")
    p.add_argument("--slow-min-s", type=float, default=2.0)
    p.add_argument("--slow-max-s", type=float, default=5.0)
    p.add_argument("--warm-calls", type=int, default=300)
    p.add_argument("--repeat", type=int, default=3,
                   help="interleaved repeats; figures are medians with ranges")
    p.add_argument("--kv-cache-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--keep-stack", action="store_true")
    run_main(p, main_async, argv)


if __name__ == "__main__":
    main()
