"""`make bench-routing`: one seeded agent workload under four routing policies.

warmloop's cache-aware routing against round-robin, least-loaded and a real peer
router (sglang-router, policy cache_aware) run in front of the same engines. Each
policy starts from cold caches (vLLM's POST /reset_prefix_cache). Hit rates and
prefill tokens are read from the engines' own counters; the oracle hit rate comes
from the prompts actually served (1 - unique prompt tokens / all prompt tokens, at the
engines' block size).

The bench runs its own stack (ports and state apart from `warmloop dev up`) with
small KV pools, so that the working set fits the fleet only when each engine holds
a subset of the profiles.

Verdicts must hold from run to run: the policies run interleaved, ``--repeat`` times
(the order rotated each repeat), and every figure is reported as the median with its
range. By default the workload is scripted: each job replays seeded calls and tool
results (``JobInput.replay``), so every policy and every repeat sends the same prompts;
``--live`` lets the random model sample its calls instead (the easy, noisier workload).
Arrivals are sized from the engines' measured step time (``--utilization``), so a
slower or faster machine runs the same regime. The last line of output is one JSON
object: the medians, and ``ranges`` with the same keys.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, get_args

import httpx
import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table
from temporalio.client import Client
from temporalio.worker import Worker

from bench.common import (
    BENCH_MAX_MODEL_LEN,
    COUNTERS,
    TINY_KV_BYTES_PER_TOKEN,
    bench_settings,
    bench_stack,
    bounded_oracle_hit_rate,
    cache_geometry,
    counters_of,
    fmt_range,
    medians_and_ranges,
    overlaps,
    pct,
    placement_bound_hit_rate,
    policy_cell,
    reset_caches,
    rotated,
    run_main,
    scrape,
    steps_hit_rate,
)
from bench.synthetic_profiles import LOOKUP_KEYS, SYNTHETIC_DOMAINS, WORDS
from bench.synthetic_tools import SyntheticTools
from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.holds import hold_stats
from warmloop.activities.inference import InferenceActivities
from warmloop.activities.transcripts import TranscriptStore
from warmloop.workers.clients import build_s3
from warmloop.workers.report import breakdown_table, step_breakdown
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    STEP_STAGES,
    FunctionCall,
    JobInput,
    JobResult,
    ReplayScript,
    ReplayStep,
    ToolCall,
    ToolRequest,
    engine_task_queue,
)
from warmloop.workflows.holding import HoldPolicy

POLICIES = ("warmloop", "round_robin", "least_loaded", "peer")
EASY_KV_BYTES = 16 * 1024 * 1024
"""8,192 tokens an engine: one engine nearly holds the four profiles' prefixes and the
running jobs, so every cache-aware router comes close to the oracle (the easy workload)."""
PRESSURE_KV_BYTES = 8 * 1024 * 1024
"""4,096 tokens an engine: the four profiles' prefixes and the running jobs fit the two
engines together but not one, so profiles must be split and evictions followed."""
PRESSURE_IN_FLIGHT = 4.0
"""Jobs running at once under pressure: about what the two pools hold between them
(~1,500 tokens of each profile's prefix, ~500-900 of each job's own). At 6.5 (arrivals
sized from a 96 ms step) every router thrashed, warmloop and the peer alike (0.70-0.77)."""
PRESSURE_MAX_MODEL_LEN = 3072
"""Under pressure a pool holds one longest request (a job's last prompt is ~2,400
tokens) but not 6,144 tokens, which vLLM would refuse."""
PEER_ENGINE = "peer"


def routing_settings(*, engines: int, kv_cache_bytes: int,
                     max_model_len: int = BENCH_MAX_MODEL_LEN) -> Settings:
    return bench_settings("routing", engines=engines, kv_cache_bytes=kv_cache_bytes,
                          max_model_len=max_model_len)


# ---- the workload --------------------------------------------------------------------


@dataclass(frozen=True)
class JobSpec:
    index: int
    profile: str
    steps: int
    arrival_s: float
    task: dict[str, Any]


def scripted(spec: JobSpec, output_tokens: int = 12) -> ReplayScript:
    """The job's calls and results, seeded by its case: lookups with seeded keys, each
    answered by the synthetic tool's own seeded output after its seeded pause. Every
    policy and every repeat then sends the same prompts; only routing differs."""
    tools = SyntheticTools(spec.profile)
    rng = random.Random(f"script/{spec.task['case_id']}")
    steps = []
    for i in range(1, spec.steps + 1):
        key = rng.choice(LOOKUP_KEYS)
        req = ToolRequest(job_id="", step=i, profile=spec.profile,
                          task_id=spec.task["case_id"], name="lookup", arguments={"key": key})
        last = i == spec.steps
        steps.append(ReplayStep(
            call=ToolCall(id=f"call-{i}", function=FunctionCall(
                name="lookup", arguments=json.dumps({"key": key}))),
            result=tools.run(req).result.output, pause_s=0.0 if last else tools.pause_s(req),
            output_tokens=output_tokens, pause_kind="" if last else "tool:lookup"))
    return ReplayScript(steps=steps)


def scripted_pause_s(spec: JobSpec) -> float:
    """The job's tool pauses in all, as ``scripted`` replays them."""
    return sum(step.pause_s for step in scripted(spec).steps)


def job_input(spec: JobSpec, *, live: bool, hold_policy: HoldPolicy = "never",
              **options: Any) -> JobInput:
    """The spec's job: scripted unless ``live``; by default never holding, to measure
    routing alone (``--hold-policy`` lets warmloop's jobs hold through their tool pauses,
    as a user's jobs do; the touches are then taken out of the hit rate)."""
    return JobInput(profile=spec.profile, task=spec.task, max_steps=spec.steps,
                    tools=["lookup"], hold_policy=hold_policy,
                    replay=None if live else scripted(spec), **options)


def workload(seed: int, n_jobs: int, mean_gap_s: float) -> list[JobSpec]:
    """Interleaved jobs over the synthetic profiles; the first profile is hot (half of
    the jobs), the rest share the other half."""
    rng = random.Random(seed)
    hot, *others = [f"synthetic-{d}" for d in SYNTHETIC_DOMAINS]
    specs, t = [], 0.0
    for i in range(n_jobs):
        profile = hot if rng.random() < 0.5 else rng.choice(others)
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 50)))
        specs.append(JobSpec(index=i, profile=profile, steps=rng.randint(6, 10), arrival_s=t,
                             task={"case_id": f"S{i:04d}", "text": text}))
        t += rng.expovariate(1.0 / mean_gap_s)
    return specs


# ---- measuring ------------------------------------------------------------------------


@dataclass
class PolicyRun:
    policy: str
    hit_rate: float
    prefill_tokens: int
    prompt_tokens: int
    job_p50_s: float
    job_p95_s: float
    makespan_s: float
    states: dict[str, int]
    steps: int
    oracle_hit_rate: float | None = None
    bounded_oracle_hit_rate: float | None = None
    """The most a fleet of these pools could hit (``bounded_oracle_hit_rate``)."""
    placement_bound_hit_rate: float | None = None
    """The most this policy's placement allowed (``placement_bound_hit_rate``)."""
    engine_queue_ms: float = 0.0
    """Mean time a request waited in the engine's queue (its own histogram)."""
    engine_prefill_ms: float = 0.0
    """Mean time the engine spent prefilling a request (its own histogram)."""
    prefill_ms_per_1k: float = 0.0
    """Engine prefill time per 1,000 tokens it computed. The same model computes the
    same tokens at the same speed on a quiet machine, so a policy whose figure is
    higher had its engines slowed by sharing the host's cores (both engines busy beside
    Temporal and the workers), not by its routing."""
    decode_ms_per_token: float = 0.0
    """Engine decode time per generated token (its own histogram and counter): the same
    contention signal for decode."""
    top_engine_share: float = 0.0
    """The busiest engine's share of the prompt tokens (its own counter): how much a
    policy packs the work onto one engine (on a 2-core host, the other core then serves
    Temporal and the workers)."""
    touches: int = 0
    """Requests that kept a held prefix warm (only warmloop holds, and only with
    ``--hold-policy``); their prompts are out of ``hit_rate``, their computed tokens in
    ``prefill_tokens``."""
    touch_computed_tokens: int = 0
    results: list[JobResult] = field(default_factory=list)
    durations: list[float] = field(default_factory=list)
    """Each job's wall time from its start, in ``results``' order."""


HOLD_COUNTERS = ("touches", "touch_prompt_tokens", "touch_computed_tokens")


def oracle_hit_rate(trace: list[dict[str, Any]], block_size: int) -> float:
    """1 - tokens that must be computed at least once / all prompt tokens: every full
    block counted once however often it is sent, partial last blocks every time."""
    total = sum(t["tokens"] for t in trace)
    unique = {h for t in trace for h in t["hashes"]}
    partial = sum(t["tokens"] - len(t["hashes"]) * block_size for t in trace)
    return 1 - (len(unique) * block_size + partial) / total if total else 0.0


async def run_policy(client: Client, policy: str, specs: list[JobSpec], run_tag: str,
                     http: httpx.AsyncClient, urls: list[str], redis: aioredis.Redis,
                     engine_ids: list[str], block_size: int, *, live: bool,
                     fleet_blocks: int = 0, hold_policy: HoldPolicy = "never") -> PolicyRun:
    await reset_caches(http, urls, redis, engine_ids)
    before_each = [counters_of([page]) for page in await scrape(http, urls)]
    holds_before = [await hold_stats(redis, e) for e in engine_ids]
    t0 = time.monotonic()

    async def one(spec: JobSpec) -> tuple[JobResult, float]:
        await asyncio.sleep(max(0.0, spec.arrival_s - (time.monotonic() - t0)))
        job = job_input(spec, live=live,
                        hold_policy=hold_policy if policy == "warmloop" else "never",
                        routing="cache_aware" if policy in ("warmloop", "peer") else policy,
                        engine_id=PEER_ENGINE if policy == "peer" else None)
        started = time.monotonic()
        res = await client.execute_workflow(
            AgentJob.run, job, id=f"bench-{run_tag}-{policy}-{spec.index:03d}",
            task_queue=AGENT_TASK_QUEUE)
        return res, time.monotonic() - started

    done = await asyncio.gather(*(one(s) for s in specs))
    makespan = time.monotonic() - t0
    after_each = [counters_of([page]) for page in await scrape(http, urls)]
    d = {k: sum(a[k] - b[k] for a, b in zip(after_each, before_each, strict=True))
         for k in COUNTERS}
    queried = [a["vllm:prefix_cache_queries_total"] - b["vllm:prefix_cache_queries_total"]
               for a, b in zip(after_each, before_each, strict=True)]
    queries, hits = d["vllm:prefix_cache_queries_total"], d["vllm:prefix_cache_hits_total"]
    holds_after = [await hold_stats(redis, e) for e in engine_ids]
    touches = {k: float(sum(a.get(k, 0) - b.get(k, 0)
                            for a, b in zip(holds_after, holds_before, strict=True)))
               for k in HOLD_COUNTERS}
    durations = [t for _, t in done]
    results = [r for r, _ in done]
    states: dict[str, int] = {}
    for r in results:
        states[r.state.value] = states.get(r.state.value, 0) + 1
    trace = await PrefixDirectory(redis).traced()
    requests = d["vllm:request_queue_time_seconds_count"] or 1.0
    computed = max(1.0, queries - hits)
    return PolicyRun(
        prefill_ms_per_1k=1e6 * d["vllm:request_prefill_time_seconds_sum"] / computed,
        decode_ms_per_token=1000 * d["vllm:request_decode_time_seconds_sum"]
        / max(1.0, d["vllm:generation_tokens_total"]),
        engine_queue_ms=1000 * d["vllm:request_queue_time_seconds_sum"] / requests,
        engine_prefill_ms=1000 * d["vllm:request_prefill_time_seconds_sum"] / requests,
        top_engine_share=max(queried) / sum(queried) if sum(queried) else 0.0,
        policy=policy, hit_rate=steps_hit_rate(queries, hits, touches),
        touches=int(touches["touches"]),
        touch_computed_tokens=int(touches["touch_computed_tokens"]),
        prefill_tokens=int(queries - hits), prompt_tokens=int(queries),
        job_p50_s=pct(durations, 0.5), job_p95_s=pct(durations, 0.95), makespan_s=makespan,
        states=states, steps=sum(len(r.steps) for r in results),
        oracle_hit_rate=oracle_hit_rate(trace, block_size) if trace else None,
        bounded_oracle_hit_rate=bounded_oracle_hit_rate(trace, block_size, fleet_blocks)
        if trace and fleet_blocks else None,
        placement_bound_hit_rate=placement_bound_hit_rate(
            trace, block_size, fleet_blocks // len(engine_ids))
        if trace and fleet_blocks and policy != "peer" else None,
        results=results, durations=durations,
    )


# ---- the peer router --------------------------------------------------------------------


class PeerRouter:
    """sglang-router (cache_aware) in front of the bench's engines, plus an in-process
    inference worker whose engine is the router."""

    def __init__(self, urls: list[str], port: int, log_path: Path) -> None:
        self.url = f"http://127.0.0.1:{port}"
        self._argv = [sys.executable, "-m", "sglang_router.launch_router",
                      "--host", "127.0.0.1", "--port", str(port), "--worker-urls", *urls,
                      "--policy", "cache_aware", "--prometheus-host", "127.0.0.1",
                      "--prometheus-port", str(port + 20000), "--log-level", "warn"]
        self._log_path = log_path
        self._proc: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        with self._log_path.open("ab") as log:
            self._proc = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT)

    async def wait_ready(self, http: httpx.AsyncClient) -> None:
        assert self._proc is not None, "launch() first"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(f"sglang-router exited; see {self._log_path}")
            try:
                if (await http.get(f"{self.url}/readiness", timeout=2)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.2)
        raise RuntimeError(f"sglang-router not ready after 60 s; see {self._log_path}")

    def stop(self) -> None:
        if self._proc and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()


async def warm_engines(client: Client, specs: list[JobSpec], engine_ids: list[str],
                       tag: str) -> int:
    """One job of each profile on each engine before anything is measured: an engine's
    first requests with a tool set compile its guided-decoding grammar and warm its
    kernels, and whichever policy ran first paid that (one repeat's job p95 was 14.1 s
    against 10.7-11.2 s in the others, its TTFT per job 1.1 s against 0.3-0.4 s). The
    prefix caches are reset before each policy, so no cached prompt carries over."""
    firsts: dict[str, JobSpec] = {}
    for spec in specs:
        firsts.setdefault(spec.profile, spec)
    await asyncio.gather(*(
        client.execute_workflow(
            AgentJob.run, job_input(spec, live=False, engine_id=engine_id),
            id=f"bench-{tag}-warm-{engine_id}-{spec.profile}", task_queue=AGENT_TASK_QUEUE)
        for engine_id in engine_ids for spec in firsts.values()))
    return len(firsts) * len(engine_ids)


@dataclass(frozen=True)
class Calibration:
    """One scripted job run alone on the quiet fleet: what the offered load is sized
    from, so a slower or faster machine runs the same regime."""

    step_s: float
    """The stack's time for one step (routing, Temporal, the worker, the engine's prefill
    and decode), the mean over the job's steps."""
    between_steps_s: float
    """The rest of a step's share of the job's wall time beyond its scripted pause (the
    tool's activity, the pause's timer, the workflow's own turns)."""


async def calibrate(client: Client, spec: JobSpec, tag: str) -> Calibration:
    started = time.monotonic()
    res = await client.execute_workflow(
        AgentJob.run, job_input(spec, live=False), id=f"bench-{tag}-calibrate",
        task_queue=AGENT_TASK_QUEUE)
    wall = time.monotonic() - started
    walls = [s.timing.overhead_ms + s.timing.ttft_ms + s.timing.decode_ms
             for s in res.steps if s.timing is not None]
    if not walls:
        raise RuntimeError("the calibration job's steps carry no timing")
    step_s = statistics.mean(walls) / 1000
    pauses = scripted_pause_s(spec)
    return Calibration(step_s=step_s, between_steps_s=max(
        0.0, (wall - pauses) / max(1, len(res.steps)) - step_s))


def sized_gap_s(mean_steps: float, step_s: float, *, engines: int,
                utilization: float) -> float:
    """Mean time between arrivals that offers the fleet ``utilization`` of its serial
    step capacity (``engines`` / ``step_s`` steps a second) with jobs of ``mean_steps``."""
    return mean_steps * step_s / (engines * utilization)


def in_flight_gap_s(specs: list[JobSpec], cal: Calibration, *, in_flight: float) -> float:
    """Mean time between arrivals that keeps ``in_flight`` jobs running on average
    (Little's law): a job lasts its scripted pauses plus its steps as calibrated.

    KV pressure follows the jobs in flight, not the engines' speed: sized from step
    time alone, a faster host would run more jobs at once (a job is mostly its tool
    pauses) and thrash pools a slower one holds."""
    job_s = statistics.mean(scripted_pause_s(spec)
                            + spec.steps * (cal.step_s + cal.between_steps_s)
                            for spec in specs)
    return job_s / in_flight


async def direct_dispatch_ms(http: httpx.AsyncClient, url: str, n: int = 20) -> list[float]:
    """Client-side time from a direct call to its request leaving (the baseline for the
    orchestration overhead), on 1-token requests."""
    out: list[float] = []
    for i in range(n):
        sent: list[float] = []

        async def hook(_: httpx.Request, sent: list[float] = sent) -> None:
            sent.append(time.perf_counter())

        async with httpx.AsyncClient(event_hooks={"request": [hook]}, timeout=30) as c:
            t = time.perf_counter()
            await c.post(f"{url}/v1/chat/completions", json={
                "model": "tiny", "max_tokens": 1,
                "messages": [{"role": "user", "content": f"direct probe {i}"}]})
            out.append((sent[0] - t) * 1000)
    return out


# ---- the run ----------------------------------------------------------------------------


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    kv_bytes = args.kv_cache_bytes or (PRESSURE_KV_BYTES if args.pressure else EASY_KV_BYTES)
    settings = routing_settings(
        engines=args.engines, kv_cache_bytes=kv_bytes,
        max_model_len=PRESSURE_MAX_MODEL_LEN if args.pressure else BENCH_MAX_MODEL_LEN)
    run_tag = f"{int(time.time()) % 100000}"
    repeats: list[dict[str, Any]] = []
    loaded_steps: list[Any] = []
    quiet_steps: list[Any] = []
    job_rows: list[dict[str, Any]] = []
    async with (bench_stack(settings, console, keep=args.keep_stack) as fleet,
                httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as http):
        client, urls = fleet.client, fleet.urls
        block_size, fleet_blocks = await cache_geometry(http, urls)
        warmed = await warm_engines(client, workload(args.seed, args.jobs, 1.0),
                                    fleet.engine_ids, run_tag)
        console.print(f"warmed the engines: {warmed} jobs (each profile on each engine)")
        cal = await calibrate(client, workload(args.seed + 1, 1, 1.0)[0], run_tag)
        step_s = cal.step_s
        mean_steps = 8.0  # workload(): 6-10 steps a job
        if args.mean_gap_s:
            gap, sized_by = args.mean_gap_s, ""
        elif args.pressure:
            gap = in_flight_gap_s(workload(args.seed, args.jobs, 1.0), cal,
                                  in_flight=PRESSURE_IN_FLIGHT)
            sized_by = f" ({PRESSURE_IN_FLIGHT} jobs in flight)"
        else:
            gap = sized_gap_s(mean_steps, step_s, engines=args.engines,
                              utilization=args.utilization)
            sized_by = f" (utilization {args.utilization})"
        console.print(f"a quiet step takes {step_s * 1000:.0f} ms end to end (and "
                      f"{cal.between_steps_s * 1000:.0f} ms between steps); mean gap "
                      f"between arrivals {gap:.2f} s{sized_by}")
        specs = workload(args.seed, args.jobs, gap)
        peer = PeerRouter(urls, args.peer_port, settings.state_dir / "logs" / "sglang-router.log")
        peer_inference = InferenceActivities(
            engine_id=PEER_ENGINE, base_url=peer.url, model="tiny", http=http,
            transcripts=TranscriptStore(build_s3(settings), settings.s3_bucket))

        async def run(policy: str, tag: str) -> PolicyRun:
            return await run_policy(client, policy, specs, tag, http, urls, fleet.redis,
                                    fleet.engine_ids, block_size, live=args.live,
                                    fleet_blocks=fleet_blocks, hold_policy=args.hold_policy)

        try:
            for rep in range(args.repeat):
                runs: dict[str, PolicyRun] = {}
                tag = f"{run_tag}-r{rep}"
                for policy in rotated(list(args.policies), rep):
                    console.print(f"repeat {rep + 1}/{args.repeat}, policy {policy}: "
                                  f"{len(specs)} jobs ...")
                    if policy == "peer":
                        peer.launch()
                        await peer.wait_ready(http)
                        async with Worker(client, task_queue=engine_task_queue(PEER_ENGINE),
                                          activities=[peer_inference.generate],
                                          max_concurrent_activities=64):
                            runs[policy] = await run(policy, tag)
                        peer.stop()
                    else:
                        runs[policy] = await run(policy, tag)
                    r = runs[policy]
                    job_rows += [{"repeat": rep, **row} for row in job_rows_of(r)]
                    console.print(f"  hit rate {r.hit_rate:.3f}, prefill {r.prefill_tokens:,} "
                                  f"tokens, job p95 {r.job_p95_s:.1f}s, makespan "
                                  f"{r.makespan_s:.1f}s, {r.states}")
                console.print("overhead on a quiet fleet: 3 jobs, one at a time ...")
                quiet = []
                for spec in specs[:3]:
                    quiet.append(await client.execute_workflow(
                        AgentJob.run, job_input(spec, live=args.live),
                        id=f"bench-{tag}-quiet-{spec.index:03d}",
                        task_queue=AGENT_TASK_QUEUE))
                direct = await direct_dispatch_ms(http, urls[0])
                repeats.append(figures(runs, direct, quiet))
                if "warmloop" in runs:
                    loaded_steps += [s for res in runs["warmloop"].results for s in res.steps]
                quiet_steps += [s for res in quiet for s in res.steps]
        finally:
            peer.stop()
    if args.jobs_json:
        args.jobs_json.write_text(json.dumps(job_rows, indent=1))
    medians, ranges = medians_and_ranges(repeats)
    report(medians, ranges, len(repeats), console, pressure=args.pressure)
    console.print(breakdown_table(quiet_steps, title="step path on a quiet fleet, all repeats"))
    console.print(breakdown_table(loaded_steps,
                                  title="step path under the warmloop runs' load, all repeats"))
    return {**medians, "ranges": ranges, "repeats": len(repeats),
            "quiet_step_s": round(step_s, 4),
            "mean_gap_s": round(gap, 3), "workload": "live" if args.live else "scripted",
            "pressure": args.pressure, "hold_policy": args.hold_policy,
            "kv_pool_tokens": kv_bytes // TINY_KV_BYTES_PER_TOKEN}


def job_rows_of(run: PolicyRun) -> list[dict[str, Any]]:
    """One row a job: its wall time, the engines its steps ran on and each stage's sum
    over its steps (for finding where a slow job's time went)."""
    rows = []
    for res, wall in zip(run.results, run.durations, strict=True):
        stages = {k: round(sum(getattr(s.timing, k) for s in res.steps if s.timing), 1)
                  for k in STEP_STAGES}
        rows.append({"policy": run.policy, "job_id": res.job_id, "wall_s": round(wall, 3),
                     "engines": [s.engine_id for s in res.steps],
                     "reasons": [s.route_reason for s in res.steps], "stages_ms": stages})
    return rows


def paired_job_diff_ms(runs: dict[str, PolicyRun]) -> dict[str, float]:
    """Each policy's mean job time minus warmloop's, job by job: every policy runs the
    same scripted jobs at the same arrival times, so a job's twin differs only by
    routing. A p95 over 40 jobs is the second-slowest job and moves with it; the paired
    mean moves only with what every job pays."""
    wl = runs.get("warmloop")
    if wl is None:
        return {}
    return {name: round(1000 * statistics.mean(o - w for o, w in zip(
                run.durations, wl.durations, strict=True)), 1)
            for name, run in runs.items() if name != "warmloop" and run.durations}


def figures(runs: dict[str, PolicyRun], direct: list[float],
            quiet: list[JobResult]) -> dict[str, Any]:
    """One repeat's figures (the JSON keys; the medians over repeats are reported)."""
    wl = runs.get("warmloop")
    oracle = wl.oracle_hit_rate if wl and wl.oracle_hit_rate is not None else None
    bounded = wl.bounded_oracle_hit_rate if wl else None
    steps = [s for r in (wl.results if wl else []) for s in r.steps]
    quiet_steps = [s for r in quiet for s in r.steps]
    # Overhead is measured on a quiet fleet: under load the same span also holds the
    # time a step queues for a free worker slot (reported apart, as loaded_dispatch).
    dispatch = [s.dispatch_ms for s in quiet_steps]
    route = [s.route_ms for s in quiet_steps]
    loaded_dispatch = [s.dispatch_ms for s in steps]
    sticky = [s for s in steps if s.predicted_cached_tokens is not None]
    exact = sum(1 for s in sticky if s.predicted_cached_tokens == s.cached_tokens)
    reasons: dict[str, int] = {}
    for s in steps:
        reasons[s.route_reason] = reasons.get(s.route_reason, 0) + 1

    def by_policy(attr: str) -> dict[str, Any]:
        return {k: round(getattr(v, attr), 4) for k, v in runs.items()}

    def stage_p50(steps_: list[Any]) -> dict[str, float]:
        return {k: round(v["p50"], 2) for k, v in step_breakdown(steps_).items()}

    return {
        "oracle_hit_rate": round(oracle, 4) if oracle is not None else None,
        "bounded_oracle_hit_rate": round(bounded, 4) if bounded is not None else None,
        "warmloop_hit_rate": round(wl.hit_rate, 4) if wl else None,
        "round_robin_hit_rate": round(runs["round_robin"].hit_rate, 4)
        if "round_robin" in runs else None,
        "least_loaded_hit_rate": round(runs["least_loaded"].hit_rate, 4)
        if "least_loaded" in runs else None,
        "peer_hit_rate": round(runs["peer"].hit_rate, 4) if "peer" in runs else None,
        "hit_rate": by_policy("hit_rate"),
        "prefill_tokens": by_policy("prefill_tokens"),
        "prompt_tokens": by_policy("prompt_tokens"),
        "job_p50_s": by_policy("job_p50_s"),
        "job_p95_s": by_policy("job_p95_s"),
        "makespan_s": by_policy("makespan_s"),
        "engine_queue_ms": by_policy("engine_queue_ms"),
        "engine_prefill_ms": by_policy("engine_prefill_ms"),
        "prefill_ms_per_1k": by_policy("prefill_ms_per_1k"),
        "decode_ms_per_token": by_policy("decode_ms_per_token"),
        "top_engine_share": by_policy("top_engine_share"),
        "placement_bound_hit_rate": {k: round(v.placement_bound_hit_rate, 4)
                                     for k, v in runs.items()
                                     if v.placement_bound_hit_rate is not None},
        "touches": by_policy("touches"),
        "touch_computed_tokens": by_policy("touch_computed_tokens"),
        "paired_job_diff_ms": paired_job_diff_ms(runs),
        "overhead_p50_ms": round(pct(dispatch, .5), 2),
        "overhead_p95_ms": round(pct(dispatch, .95), 2),
        "route_p50_ms": round(pct(route, .5), 2),
        "route_p95_ms": round(pct(route, .95), 2),
        "loaded_dispatch_p50_ms": round(pct(loaded_dispatch, .5), 1),
        "loaded_dispatch_p95_ms": round(pct(loaded_dispatch, .95), 1),
        "direct_dispatch_p50_ms": round(pct(direct, .5), 3),
        "directory_exact_share": round(exact / len(sticky), 4) if sticky else None,
        "quiet_stage_p50_ms": stage_p50(quiet_steps),
        "loaded_stage_p50_ms": stage_p50(steps),
        "route_reasons": reasons,
        "steps": {k: v.steps for k, v in runs.items()},
    }


def report(m: dict[str, Any], rg: dict[str, Any], n: int, console: Console, *,
           pressure: bool = False) -> None:
    """The medians-and-ranges table per policy, and the targets' verdicts."""
    table = Table(title=f"bench-routing: medians \\[ranges] of {n} interleaved repeats, "
                        "engines' own counters")
    table.add_column("policy")
    for c in ("hit rate", "vs oracle", "prefill tokens", "vs round-robin", "job p50 s",
              "job p95 s", "makespan s", "engine queue / prefill ms",
              "prefill ms / 1k computed, decode ms / token", "top engine share"):
        table.add_column(c, justify="right")
    oracle = m.get("oracle_hit_rate")
    rr = m["prefill_tokens"].get("round_robin")
    for name, hit in m["hit_rate"].items():
        table.add_row(
            name, policy_cell(m, rg, "hit_rate", name),
            f"{hit / oracle:.3f}x" if oracle else "-",
            policy_cell(m, rg, "prefill_tokens", name, ",.0f"),
            f"{m['prefill_tokens'][name] / rr:.2f}x" if rr else "-",
            policy_cell(m, rg, "job_p50_s", name, ".1f"),
            policy_cell(m, rg, "job_p95_s", name, ".1f"),
            policy_cell(m, rg, "makespan_s", name, ".1f"),
            f"{m['engine_queue_ms'][name]:.0f} / {m['engine_prefill_ms'][name]:.0f}",
            f"{m['prefill_ms_per_1k'][name]:.0f}, {m['decode_ms_per_token'][name]:.1f}",
            policy_cell(m, rg, "top_engine_share", name, ".2f"))
    console.print(table)
    if oracle is not None:
        console.print(f"oracle hit rate (1 - unique/all prompt tokens): "
                      f"{fmt_range(oracle, rg.get('oracle_hit_rate'))}")
    bounded = m.get("bounded_oracle_hit_rate")
    if bounded:
        console.print("the most these pools could hit (Belady's MIN on one pool the "
                      "fleet's size): "
                      f"{fmt_range(bounded, rg.get('bounded_oracle_hit_rate'))}")
    placed = m.get("placement_bound_hit_rate", {})
    if placed:
        console.print("the most each policy's placement allowed (Belady's MIN on each "
                      "engine's pool over what it served): " + ", ".join(
                          f"{k} {fmt_range(v, rg.get('placement_bound_hit_rate', {}).get(k))}"
                          for k, v in placed.items()))
    console.print(f"warmloop route reasons (last repeat): {m.get('route_reasons')}")
    console.print(
        f"orchestration overhead per step on a quiet fleet (Temporal schedules generate -> "
        f"the request leaves for the engine): p50 "
        f"{fmt_range(m['overhead_p50_ms'], rg.get('overhead_p50_ms'), '.1f')} ms, p95 "
        f"{fmt_range(m['overhead_p95_ms'], rg.get('overhead_p95_ms'), '.1f')} ms; routing "
        f"decision p50 {m['route_p50_ms']:.1f} ms; a direct client call p50 "
        f"{m['direct_dispatch_p50_ms']:.2f} ms. Under the run's load the same span was p50 "
        f"{m['loaded_dispatch_p50_ms']:.0f} ms, p95 "
        f"{fmt_range(m['loaded_dispatch_p95_ms'], rg.get('loaded_dispatch_p95_ms'), '.0f')} ms")
    wl = m["hit_rate"].get("warmloop")
    if wl is None:
        return
    touches = m.get("touches", {}).get("warmloop", 0)
    if touches:
        console.print(f"warmloop held prefixes through tool pauses: {touches:.0f} touches "
                      f"computed {m['touch_computed_tokens']['warmloop']:,.0f} tokens (in its "
                      "prefill tokens; their prompts are out of its hit rate)")
    checks = []
    if oracle:
        checks.append(f"hit rate {wl / oracle:.3f}x oracle " + (
            "(an unbounded cache's, out of anyone's reach here)"
            if pressure else "(target >= 0.97)"))
    if pressure and m.get("bounded_oracle_hit_rate"):
        checks.append(f"{wl / m['bounded_oracle_hit_rate']:.3f}x the most these pools "
                      "could hit (target >= 0.97)")
    if "peer" in m["hit_rate"]:
        peer = m["hit_rate"]["peer"]
        apart = overlaps(rg.get("hit_rate", {}).get("warmloop"),
                         rg.get("hit_rate", {}).get("peer"))
        checks.append(f"{wl / max(1e-9, peer):.3f}x peer's (target >= 1.00; ranges "
                      f"{'overlap' if apart else 'apart'})")
        p95 = m["job_p95_s"]
        checks.append(f"job p95 {p95['warmloop'] / max(1e-9, p95['peer']):.2f}x the peer's "
                      "(target <= 1.00)")
        paired = m.get("paired_job_diff_ms", {}).get("peer")
        if paired is not None:
            span = rg.get("paired_job_diff_ms", {}).get("peer")
            checks.append(f"the peer's jobs took {fmt_range(paired, span, '+.0f')} ms longer "
                          "than their warmloop twins on average")
    if rr:
        checks.append(f"prefill {m['prefill_tokens']['warmloop'] / rr:.2f}x round-robin's")
    checks.append(f"overhead p50 {m['overhead_p50_ms']:.1f} ms (target < 10), p95 "
                  f"{m['overhead_p95_ms']:.1f} ms (target < 20); loaded dispatch p95 "
                  f"{m['loaded_dispatch_p95_ms']:.0f} ms (target < 250)")
    console.print("targets (medians): " + "; ".join(checks))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--repeat", type=int, default=3,
                   help="interleaved repeats; figures are medians with ranges")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--engines", type=int, default=2, choices=(2, 3))
    p.add_argument("--utilization", type=float, default=0.3,
                   help="offered load as a share of the fleet's measured step capacity")
    p.add_argument("--mean-gap-s", type=float, default=None,
                   help="fix the mean time between arrivals instead (exponential)")
    p.add_argument("--live", action="store_true",
                   help="let the model sample its calls (the noisier workload)")
    p.add_argument("--kv-cache-bytes", type=int, default=None,
                   help="KV pool per engine (2,048 bytes per token on the tiny model; "
                        f"default {EASY_KV_BYTES:,}, or {PRESSURE_KV_BYTES:,} with "
                        "--pressure)")
    p.add_argument("--pressure", action="store_true",
                   help="the workload where routing shows: pools that hold only part of "
                        "the profiles, so a router blind to evictions sends steps to "
                        "prefixes that are gone")
    p.add_argument("--hold-policy", default="never", choices=get_args(HoldPolicy),
                   help="warmloop's jobs hold their prefixes through tool pauses by this "
                        "policy (the routers hold nothing); default never: routing alone")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=POLICIES)
    p.add_argument("--peer-port", type=int, default=8290)
    p.add_argument("--keep-stack", action="store_true", help="leave the bench stack running")
    p.add_argument("--jobs-json", type=Path, default=None,
                   help="write each policy's jobs (wall time, engines, stage sums) here")
    run_main(p, main_async, argv)


if __name__ == "__main__":
    main()
