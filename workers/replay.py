"""`warmloop replay TRACE.jsonl`: a team's recorded agent jobs, run again on its fleet.

Every job of the trace runs through the real ``AgentJob`` (routing, failover, holds),
once per configuration (a ``--routing`` policy), in a sliding window of N jobs. Each
step is generated on the engines at the recorded output length, but the transcript
gets the recorded tool call and result, and the job waits the recorded pause, so
every configuration sends the same prompts (the prompt digest shows it) and the
figures differ only by what the configuration did with them.

Before each configuration the engines' prefix caches are reset (vLLM's POST
/reset_prefix_cache, served with VLLM_SERVER_DEV_MODE=1) where they allow it; the
output says when they did not. Hit rate and prefill tokens come from the engines' own
counters, read before and after, so run a replay on a fleet no one else is using.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table
from temporalio.client import Client
from temporalio.common import SearchAttributePair, TypedSearchAttributes, WorkflowIDReusePolicy

from warmloop.activities.holds import pause_kind
from warmloop.activities.pauses import tool_kind
from warmloop.activities.registry import EngineRegistry
from warmloop.activities.trace_prompts import TracePromptStore
from warmloop.workers.engine_metrics import (
    CacheResetError,
    delta,
    engine_counters,
    prefill_computed,
    reset_caches,
)
from warmloop.workers.report import percentile
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import SA_TENANT, AgentJob
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput, JobResult
from warmloop.workflows.profiles import UnknownProfileError, get_profile
from warmloop.workflows.routing import RoutingPolicy
from warmloop.workflows.tenants import job_workflow_id
from warmloop.workflows.trace import (
    InlinePrompt,
    TraceError,
    TraceJob,
    check_profile_job,
    inline_prompts,
    parse_trace,
    prompt_digest,
    replay_script,
)

ROUTING_ALIASES: dict[str, RoutingPolicy] = {
    "cache_aware": "cache_aware", "warmloop": "cache_aware",
    "round_robin": "round_robin", "round-robin": "round_robin",
    "least_loaded": "least_loaded", "least-loaded": "least_loaded",
}


def routing_policy(name: str) -> RoutingPolicy:
    try:
        return ROUTING_ALIASES[name]
    except KeyError:
        raise ValueError(f"--routing {name!r}: use cache_aware (warmloop), round_robin or "
                         "least_loaded") from None


# ---- the trace -------------------------------------------------------------------------


@dataclass(frozen=True)
class PreparedTrace:
    """A validated trace as job inputs (routing set per configuration)."""

    source: str
    jobs: list[tuple[int, JobInput]]
    """(line number, input) per job, in trace order."""
    prompts: list[InlinePrompt]
    """Distinct inline prompts, to store before the jobs start."""
    arrivals: list[float] | None = None
    """Each job's start, in seconds after the first's (the lines' ``arrival_s``), when
    every line has one; None otherwise."""

    @property
    def steps(self) -> int:
        return sum(len(j.replay.steps) for _, j in self.jobs if j.replay is not None)


def load_trace(path: Path) -> list[tuple[int, TraceJob]]:
    try:
        text = path.read_text()
    except OSError as e:
        raise TraceError([f"cannot read {path}: {e.strerror}"]) from None
    return parse_trace(text.splitlines())


def prepare(lines: list[tuple[int, TraceJob]], source: str) -> PreparedTrace:
    """Job inputs for the trace's lines; ``TraceError`` for a line naming an unknown
    profile or a task its profile refuses. Needs the process's profiles loaded."""
    prompts = inline_prompts(lines)
    jobs: list[tuple[int, JobInput]] = []
    for n, line in lines:
        if line.profile is not None:
            try:
                profile = get_profile(line.profile)
            except UnknownProfileError as e:
                raise TraceError([f"line {n}: profile: {e}"]) from None
            check_profile_job(n, line, profile)
            name = profile.name
            # what a live job would wait on after each call: a tool, or a human
            kinds = [pause_kind(profile, s.call.name, s.call.arguments_text()) or ""
                     for s in line.steps]
        else:
            name = prompts[n].name
            kinds = [tool_kind(s.call.name) for s in line.steps]
        jobs.append((n, JobInput(
            profile=name, task=line.task_object,
            # the step cap only: a token, cost or wall-time cap would put run-dependent
            # figures in the prompt's budget line, and the prompts must not differ by run
            limits=JobLimits(max_steps=len(line.steps)), lane=line.lane,
            tenant=line.tenant, replay=replay_script(line, kinds))))
    distinct = list({p.name: p for p in prompts.values()}.values())
    times = [line.arrival_s for _, line in lines]
    arrivals = None
    if all(t is not None for t in times):
        first = min(t for t in times if t is not None)
        arrivals = [t - first for t in times if t is not None]
    return PreparedTrace(source=source, jobs=jobs, prompts=distinct, arrivals=arrivals)


def arrival_problem(trace: PreparedTrace) -> str | None:
    """Why the trace cannot be replayed at its recorded arrivals; None when it can."""
    if trace.arrivals is not None:
        return None
    return ("--arrivals needs every line's arrival_s (the seconds at which the job "
            "arrived); this trace has none on some lines: replay it with --window instead")


# ---- one configuration -------------------------------------------------------------------


@dataclass
class ConfigRun:
    """What one configuration did with the trace."""

    routing: str
    jobs: int
    states: dict[str, int]
    steps: int
    counters: dict[str, float]
    """The engines' own counters over the run (after - before)."""
    cached_tokens: int
    """Cached tokens the engines reported per step, summed."""
    later_steps: int
    later_steps_cached: int
    cost_usd: float
    cost_unknown_steps: int
    ttft_p50_ms: float
    ttft_p95_ms: float
    makespan_s: float
    digest: str
    hashed_steps: int
    caches_reset: str
    start_lag_max_s: float | None = None
    """At recorded arrivals: the latest any job started after its arrival (the start
    call's own time included); None when a window paced the jobs."""

    @property
    def hit_rate(self) -> float:
        q = self.counters["vllm:prefix_cache_queries_total"]
        return self.counters["vllm:prefix_cache_hits_total"] / q if q else 0.0

    @property
    def prompt_tokens(self) -> int:
        return int(self.counters["vllm:prefix_cache_queries_total"])

    @property
    def prefill_tokens(self) -> int:
        return prefill_computed(self.counters)

    def as_json(self) -> dict[str, Any]:
        return {
            "routing": self.routing, "jobs": self.jobs, "states": self.states,
            "steps": self.steps, "hit_rate": round(self.hit_rate, 4),
            "prompt_tokens": self.prompt_tokens, "prefill_tokens": self.prefill_tokens,
            "cached_tokens": self.cached_tokens, "later_steps": self.later_steps,
            "later_steps_cached": self.later_steps_cached,
            "cost_usd": round(self.cost_usd, 8), "cost_unknown_steps": self.cost_unknown_steps,
            "ttft_p50_ms": round(self.ttft_p50_ms, 1), "ttft_p95_ms": round(self.ttft_p95_ms, 1),
            "makespan_s": round(self.makespan_s, 2), "prompt_digest": self.digest,
            "hashed_steps": self.hashed_steps, "caches_reset": self.caches_reset,
            "start_lag_max_s": (None if self.start_lag_max_s is None
                                else round(self.start_lag_max_s, 3)),
        }


@dataclass(frozen=True)
class Fleet:
    client: Client
    redis: aioredis.Redis
    http: httpx.AsyncClient
    urls: list[str]
    engine_ids: list[str]


async def live_fleet(client: Client, redis: aioredis.Redis, http: httpx.AsyncClient,
                     settings: Settings) -> Fleet:
    live = await EngineRegistry(redis, ttl_s=settings.engine_ttl_s).live()
    if not live:
        raise RuntimeError("no live engines in the registry; is the stack up "
                           "(`warmloop engines`)?")
    return Fleet(client=client, redis=redis, http=http,
                 urls=[e.url.rstrip("/") for e in live], engine_ids=[e.engine_id for e in live])


async def run_config(fleet: Fleet, trace: PreparedTrace, routing: RoutingPolicy, *,
                     window: int, tag: str, reset: bool, log: Console,
                     speed: float | None = None) -> ConfigRun:
    """``speed``: start each job at its recorded arrival divided by ``speed`` (the
    window does not apply: production's jobs did not wait for one another); None: keep
    ``window`` jobs running, in trace order."""
    if not reset:
        caches_reset = "no (--no-reset)"
    else:
        try:
            await reset_caches(fleet.http, fleet.urls, fleet.redis, fleet.engine_ids)
            caches_reset = "yes"
        except CacheResetError as e:
            caches_reset = f"no: {e}"
            log.print(f"[yellow]warning:[/] prefix caches not reset ({e}); this "
                      "configuration starts with what the last one left", highlight=False)
    before = await engine_counters(fleet.http, fleet.urls)
    due = ([a / speed for a in trace.arrivals]
           if speed is not None and trace.arrivals is not None else None)
    """Each job's start, in seconds after the run's (paced runs)."""
    slots = asyncio.Semaphore(len(trace.jobs) if due is not None else window)  # FIFO
    started = time.monotonic()
    lags: list[float] = []
    """How late each job started after its recorded arrival (paced runs)."""

    async def one(i: int, job: JobInput) -> JobResult | None:
        if due is not None:
            # when the job arrived, on the replay's clock (a timer, not a wait on others)
            await asyncio.sleep(max(0.0, started + due[i] - time.monotonic()))
        async with slots:
            handle = await fleet.client.start_workflow(
                AgentJob.run, job.model_copy(update={"routing": routing}),
                id=job_workflow_id(job.tenant, f"replay-{tag}-{routing}-{i:04d}"),
                task_queue=AGENT_TASK_QUEUE,
                id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE,
                search_attributes=TypedSearchAttributes(
                    [SearchAttributePair(SA_TENANT, job.tenant)]))
            if due is not None:
                lags.append(time.monotonic() - started - due[i])
            try:
                return await handle.result()
            except Exception as e:  # noqa: BLE001 - a failed workflow is counted, not fatal
                log.print(f"  job {handle.id} failed: {e}", highlight=False)
                return None

    results = await asyncio.gather(*(one(i, job) for i, (_, job) in enumerate(trace.jobs)))
    makespan = time.monotonic() - started
    counters = delta(await engine_counters(fleet.http, fleet.urls), before)
    done = [(n, r) for (n, _), r in zip(trace.jobs, results, strict=True) if r is not None]
    steps = [s for _, r in done for s in r.steps]
    later = [s for _, r in done for s in r.steps[1:]]
    ttfts = [s.ttft_ms for s in steps]
    hashes = [(n, s.step, s.prompt_hash) for n, r in done for s in r.steps if s.prompt_hash]
    states = Counter(r.state.value for _, r in done)
    if len(done) < len(results):
        states["WORKFLOW_FAILED"] = len(results) - len(done)
    return ConfigRun(
        routing=routing, jobs=len(results), states=dict(sorted(states.items())),
        steps=len(steps), counters=counters,
        cached_tokens=sum(s.cached_tokens for s in steps), later_steps=len(later),
        later_steps_cached=sum(1 for s in later if s.cached_tokens > 0),
        cost_usd=sum(r.usage.cost_usd for _, r in done),
        cost_unknown_steps=sum(r.usage.cost_unknown_steps for _, r in done),
        ttft_p50_ms=percentile(ttfts, 50), ttft_p95_ms=percentile(ttfts, 95),
        makespan_s=makespan, digest=prompt_digest(hashes), hashed_steps=len(hashes),
        caches_reset=caches_reset, start_lag_max_s=max(lags) if lags else None,
    )


async def replay(settings: Settings, trace: PreparedTrace, routings: list[RoutingPolicy], *,
                 client: Client, window: int, reset: bool, log: Console,
                 speed: float | None = None) -> list[ConfigRun]:
    """Store the trace's inline prompts, then run every configuration in turn."""
    from warmloop.workers.clients import build_redis, build_s3

    store = TracePromptStore(build_s3(settings), settings.s3_bucket)
    for p in trace.prompts:
        try:
            await store.put(p)
        except Exception as e:  # noqa: BLE001 - botocore's errors have no common base here
            raise RuntimeError(f"cannot store the trace's inline prompts in S3 "
                               f"({settings.s3_endpoint_url or 'AWS'}, bucket "
                               f"{settings.s3_bucket}): {e}") from None
    tag = uuid.uuid4().hex[:6]
    redis = build_redis(settings)
    try:
        async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as http:
            fleet = await live_fleet(client, redis, http, settings)
            runs = []
            for routing in routings:
                log.print(f"replaying {len(trace.jobs)} jobs ({trace.steps} steps) with routing "
                          f"{routing} on {', '.join(fleet.engine_ids)}, "
                          f"{pace_label(window, speed)} ...",
                          highlight=False)
                r = await run_config(fleet, trace, routing, window=window, tag=tag,
                                     reset=reset, log=log, speed=speed)
                log.print(f"  done in {r.makespan_s:.1f}s: hit rate {r.hit_rate:.3f}, prefill "
                          f"{r.prefill_tokens:,} tokens, digest {r.digest}", highlight=False)
                runs.append(r)
    finally:
        await redis.aclose()
    return runs


# ---- the report --------------------------------------------------------------------------


def _ratio(value: float, first: float) -> str:
    if not first or math.isnan(value) or math.isnan(first):
        return ""
    return f" ({value / first:.2f}x)"


def _cost(r: ConfigRun) -> str:
    if r.cost_unknown_steps and r.cost_unknown_steps >= r.steps:
        return "unknown (no engine declares a price)"
    text = f"${r.cost_usd:.6f}"
    if r.cost_unknown_steps:
        text = f">= {text} ({r.cost_unknown_steps} steps on unpriced engines)"
    return text


def report_table(runs: list[ConfigRun], *, title: str) -> Table:
    """One column per configuration; ratios against the first."""
    table = Table(title=title)
    table.add_column("figure")
    for r in runs:
        table.add_column(r.routing, justify="right")
    first = runs[0]

    def row(name: str, fmt: Any, value: Any = None) -> None:
        cells = []
        for i, r in enumerate(runs):
            cell = fmt(r)
            if value is not None and i > 0:
                cell += _ratio(float(value(r)), float(value(first)))
            cells.append(cell)
        table.add_row(name, *cells)

    row("jobs", lambda r: f"{r.jobs} ({', '.join(f'{k} {v}' for k, v in r.states.items())})")
    row("model steps", lambda r: str(r.steps))
    row("hit rate (engine counters)", lambda r: f"{r.hit_rate:.3f}", lambda r: r.hit_rate)
    row("prompt tokens (engine counters)", lambda r: f"{r.prompt_tokens:,}")
    row("prefill tokens computed (engine counters)", lambda r: f"{r.prefill_tokens:,}",
        lambda r: r.prefill_tokens)
    row("cached tokens reported by steps", lambda r: f"{r.cached_tokens:,}",
        lambda r: r.cached_tokens)
    row("steps after a job's first with cached tokens",
        lambda r: f"{r.later_steps_cached}/{r.later_steps}")
    row("cost", _cost, lambda r: r.cost_usd if r.cost_unknown_steps < r.steps else math.nan)
    row("TTFT p50 (ms)", lambda r: f"{r.ttft_p50_ms:.0f}", lambda r: r.ttft_p50_ms)
    row("TTFT p95 (ms)", lambda r: f"{r.ttft_p95_ms:.0f}", lambda r: r.ttft_p95_ms)
    row("makespan (s)", lambda r: f"{r.makespan_s:.1f}", lambda r: r.makespan_s)
    row("prompt digest (hashed steps)", lambda r: f"{r.digest} ({r.hashed_steps})")
    row("caches reset before", lambda r: r.caches_reset)
    if any(r.start_lag_max_s is not None for r in runs):
        row("latest start after its arrival (s)",
            lambda r: "-" if r.start_lag_max_s is None else f"{r.start_lag_max_s:.2f}")
    return table


def pace_label(window: int, speed: float | None) -> str:
    """How the jobs were started: at their recorded arrivals, or in a window."""
    return f"at the recorded arrivals x{speed:g}" if speed is not None else f"window {window}"


def summary(trace: PreparedTrace, runs: list[ConfigRun], window: int,
            speed: float | None = None) -> dict[str, Any]:
    """The report's JSON line: ``window`` null when the jobs started at their recorded
    arrivals (``speed``)."""
    return {"trace": trace.source, "jobs": len(trace.jobs), "steps": trace.steps,
            "inline_prompts": len(trace.prompts),
            "window": None if speed is not None else window, "arrivals_speed": speed,
            "configs": [r.as_json() for r in runs]}


def print_report(console: Console, trace: PreparedTrace, runs: list[ConfigRun],
                 window: int, speed: float | None = None) -> None:
    console.print(report_table(runs, title=f"warmloop replay {trace.source}: {len(trace.jobs)} "
                                           f"jobs, {trace.steps} recorded steps, "
                                           f"{pace_label(window, speed)}"))
    digests = {r.digest for r in runs}
    if len(digests) == 1:
        console.print(f"every configuration sent the same prompts (digest {runs[0].digest})",
                      highlight=False)
    else:
        console.print("[yellow]the prompt digests differ[/]: some steps were not replayed "
                      "alike (a job ended early, or a worker that reports no prompt hash)")
    print(json.dumps(summary(trace, runs, window, speed)), flush=True)
