"""`make bench-hygiene`: cache-aware context hygiene against none and against every step.

Long jobs (40 steps, each tool output ~350 tokens) and short jobs (6 steps) run
together on engines whose KV pools are too small for every context at once, under
three policies: no hygiene (``off``), warmloop's cost model (``cost_model``: archive
large old outputs at a continue-as-new point when the saving over the expected
remaining steps beats re-prefilling the compacted tail), and trimming before every
step (``every_step``). The jobs are scripted (``JobInput.replay``): every policy and
repeat sends the same calls and tool outputs, so only hygiene differs.

What is counted, per job class, from the engines' own usage of every step:

- ``prefill_*``: the prompt tokens the engine read (``usage.prompt_tokens`` summed:
  the input tokens every step is billed for, cached or not). This is what the issue's
  target is about and what the cost model prices (``warmloop.workflows.hygiene``).
- ``computed_*``: of those, the tokens the engine computed (prompt - cached): the
  one-time re-prefills compaction causes show here, and evictions in the small pools.
- ``priced_*``: computed + cached_fraction x cached, in uncached-token equivalents:
  the cost model's own objective (cached_fraction from the engines' calibration).
- ``peak_context_*``: the longest prompt of any step.

The fleet-wide engine counters (Prometheus) are read too, as a check on the sums.
Policies run interleaved, ``--repeat`` times (order rotated); figures are medians with
ranges. The last line of output is one JSON object: the medians, and ``ranges``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table
from temporalio.client import Client

from bench.common import (
    COUNTERS,
    bench_settings,
    bench_stack,
    engine_counters,
    fmt_range,
    medians_and_ranges,
    pct,
    policy_cell,
    prefill_computed,
    reset_caches,
    rotated,
)
from bench.synthetic_profiles import LOOKUP_KEYS, WORDS
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.calibration import CPU_TINY
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    FunctionCall,
    JobInput,
    JobResult,
    ReplayScript,
    ReplayStep,
    ToolCall,
)
from warmloop.workflows.hygiene import is_summary

POLICIES = {"none": "off", "hygiene": "cost_model", "every_step": "every_step"}
"""Bench name -> JobInput.context_hygiene."""
PROFILES = ("synthetic-support", "synthetic-billing")
"""Two prefix families, so that routing spreads the jobs over both engines."""
CACHED_FRACTION = CPU_TINY.cached_fraction


@dataclass(frozen=True)
class JobSpec:
    index: int
    kind: str  # "long" or "short"
    steps: int
    max_steps: int
    task: dict[str, Any]


def scripted(spec: JobSpec, *, words: tuple[int, int], pause_s: float,
             output_tokens: int) -> ReplayScript:
    """Lookups with seeded keys, each answered by a seeded record of ``words`` words
    (one token a word on the tiny model), then a short seeded pause."""
    rng = random.Random(f"hygiene/{spec.kind}/{spec.index}")
    steps = []
    for i in range(1, spec.steps + 1):
        key = rng.choice(LOOKUP_KEYS)
        text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(*words)))
        last = i == spec.steps
        steps.append(ReplayStep(
            call=ToolCall(id=f"call-{i}", function=FunctionCall(
                name="lookup", arguments=json.dumps({"key": key}))),
            result=f"record {key} (page {i}): {text}",
            pause_s=0.0 if last else round(rng.uniform(0.5, 1.5) * pause_s, 3),
            output_tokens=output_tokens, pause_kind="" if last else "tool:lookup"))
    return ReplayScript(steps=steps)


def workload(args: argparse.Namespace) -> list[JobSpec]:
    """Long and short jobs, alternating while both last."""
    rng = random.Random(args.seed)
    kinds = [k for pair in zip(["long"] * args.long_jobs, ["short"] * args.short_jobs,
                               strict=False) for k in pair]
    n = min(args.long_jobs, args.short_jobs)
    kinds += ["long"] * (args.long_jobs - n) + ["short"] * (args.short_jobs - n)
    specs = []
    for i, kind in enumerate(kinds):
        long = kind == "long"
        text = " ".join(rng.choice(WORDS) for _ in range(40))
        specs.append(JobSpec(
            index=i, kind="long" if long else "short",
            steps=args.long_steps if long else args.short_steps,
            max_steps=args.long_budget if long else args.short_budget,
            task={"case_id": f"S{i:04d}", "text": text}))
    return specs


@dataclass
class ClassFigures:
    prompt: int = 0
    cached: int = 0
    peak: int = 0
    archived: int = 0
    """Tool outputs replaced by summaries in the jobs' final transcripts."""
    continued: int = 0
    """Continue-as-new points taken (runs - 1): compaction points here."""
    states: dict[str, int] = field(default_factory=dict)
    durations: list[float] = field(default_factory=list)

    @property
    def computed(self) -> int:
        return self.prompt - self.cached

    @property
    def priced(self) -> float:
        return self.computed + CACHED_FRACTION * self.cached


@dataclass
class PolicyRun:
    policy: str
    by_kind: dict[str, ClassFigures]
    engine_prompt: int
    engine_computed: int


async def run_policy(client: Client, name: str, specs: list[JobSpec], http: httpx.AsyncClient,
                     urls: list[str], fleet_redis: Any, engine_ids: list[str],
                     args: argparse.Namespace) -> PolicyRun:
    await reset_caches(http, urls, fleet_redis, engine_ids)
    before = await engine_counters(http, urls)
    tag = uuid.uuid4().hex[:6]

    async def one(spec: JobSpec) -> tuple[JobSpec, JobResult, float]:
        await asyncio.sleep(spec.index * args.gap_s)
        job = JobInput(profile=PROFILES[spec.index % 2], task=spec.task, max_steps=spec.max_steps,
                       tools=["lookup"], hold_policy="never",
                       context_hygiene=POLICIES[name],  # type: ignore[arg-type]
                       replay=scripted(spec, words=(args.min_words, args.max_words),
                                       pause_s=args.pause_s, output_tokens=8))
        t = time.monotonic()
        res = await client.execute_workflow(
            AgentJob.run, job, id=f"hygiene-{tag}-{name}-{spec.index:02d}",
            task_queue=AGENT_TASK_QUEUE)
        return spec, res, time.monotonic() - t

    done = await asyncio.gather(*(one(s) for s in specs))
    after = await engine_counters(http, urls)
    d = {k: after[k] - before[k] for k in COUNTERS}
    by_kind = {"long": ClassFigures(), "short": ClassFigures()}
    for spec, res, took in done:
        f = by_kind[spec.kind]
        f.prompt += res.usage.prompt_tokens
        f.cached += res.usage.cached_tokens
        f.peak = max([f.peak, *(s.prompt_tokens for s in res.steps)])
        f.archived += sum(1 for m in res.transcript if m.role == "tool"
                          and is_summary(m.content))
        f.continued += res.runs - 1
        f.states[res.state.value] = f.states.get(res.state.value, 0) + 1
        f.durations.append(took)
    return PolicyRun(policy=name, by_kind=by_kind,
                     engine_prompt=int(d["vllm:prompt_tokens_total"]),
                     engine_computed=prefill_computed(d))


def figures(runs: dict[str, PolicyRun]) -> dict[str, Any]:
    """One repeat's JSON (the medians over repeats are reported)."""
    out: dict[str, Any] = {}
    for kind in ("long", "short"):
        for name, r in runs.items():
            f = r.by_kind[kind]
            out[f"prefill_{kind}_{name}"] = f.prompt
        none = runs["none"].by_kind[kind] if "none" in runs else None
        for metric, get in (("prefill", lambda f: f.prompt), ("computed", lambda f: f.computed),
                            ("priced", lambda f: round(f.priced)),
                            ("peak_context", lambda f: f.peak),
                            ("archived", lambda f: f.archived),
                            ("continued", lambda f: f.continued),
                            ("job_p50_s", lambda f: round(pct(f.durations, .5), 2))):
            out[f"{metric}_{kind}"] = {n: get(r.by_kind[kind]) for n, r in runs.items()}
        if none is not None:
            for metric, get in (("prefill", lambda f: f.prompt),
                                ("computed", lambda f: f.computed),
                                ("priced", lambda f: f.priced)):
                base = max(1.0, float(get(none)))
                out[f"{metric}_{kind}_vs_none"] = {
                    n: round(get(r.by_kind[kind]) / base, 4) for n, r in runs.items()}
        out[f"states_{kind}"] = {n: r.by_kind[kind].states for n, r in runs.items()}
    out["engine_prompt_tokens"] = {n: r.engine_prompt for n, r in runs.items()}
    out["engine_computed_tokens"] = {n: r.engine_computed for n, r in runs.items()}
    out["usage_prompt_tokens"] = {n: sum(f.prompt for f in r.by_kind.values())
                                  for n, r in runs.items()}
    return out


def report(m: dict[str, Any], rg: dict[str, Any], n: int, console: Console) -> None:
    for kind in ("long", "short"):
        table = Table(title=f"bench-hygiene, {kind} jobs: medians \\[ranges] of {n} "
                            "interleaved repeats, engines' own usage")
        for c in ("policy", "prefill (read)", "x none", "computed", "x none",
                  "priced (uncached-eq.)", "x none", "peak context", "archived",
                  "compaction points", "job p50 s", "end states"):
            table.add_column(c, justify="right")
        for name in m[f"prefill_{kind}"]:
            table.add_row(
                name, policy_cell(m, rg, f"prefill_{kind}", name, ",.0f"),
                policy_cell(m, rg, f"prefill_{kind}_vs_none", name, ".3f"),
                policy_cell(m, rg, f"computed_{kind}", name, ",.0f"),
                policy_cell(m, rg, f"computed_{kind}_vs_none", name, ".3f"),
                policy_cell(m, rg, f"priced_{kind}", name, ",.0f"),
                policy_cell(m, rg, f"priced_{kind}_vs_none", name, ".3f"),
                policy_cell(m, rg, f"peak_context_{kind}", name, ",.0f"),
                policy_cell(m, rg, f"archived_{kind}", name, ".0f"),
                policy_cell(m, rg, f"continued_{kind}", name, ".0f"),
                policy_cell(m, rg, f"job_p50_s_{kind}", name, ".1f"),
                ", ".join(f"{k} {v}" for k, v in sorted((m[f"states_{kind}"].get(name)
                                                          or {}).items())))
        console.print(table)
    check = Table(title="check: the steps' usage against the engines' own counters (fleet)")
    for c in ("policy", "sum of steps' prompt tokens", "engines' prompt_tokens_total",
              "engines' computed"):
        check.add_column(c, justify="right")
    for name in m["engine_prompt_tokens"]:
        check.add_row(name, policy_cell(m, rg, "usage_prompt_tokens", name, ",.0f"),
                      policy_cell(m, rg, "engine_prompt_tokens", name, ",.0f"),
                      policy_cell(m, rg, "engine_computed_tokens", name, ",.0f"))
    console.print(check)
    long_ratio = m["prefill_long_vs_none"].get("hygiene")
    short_ratio = m["prefill_short_vs_none"].get("hygiene")
    if long_ratio is not None and short_ratio is not None:
        lr = (rg.get("prefill_long_vs_none") or {}).get("hygiene")
        sr = (rg.get("prefill_short_vs_none") or {}).get("hygiene")
        console.print(
            f"targets (medians): long-job prefill {fmt_range(long_ratio, lr, '.3f')}x no "
            f"hygiene (target <= 0.6); short-job prefill {fmt_range(short_ratio, sr, '.3f')}x "
            f"(target <= 1, no compaction: {m['continued_short'].get('hygiene', 0):.0f} "
            f"points, {m['archived_short'].get('hygiene', 0):.0f} archived)")


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    settings = bench_settings("hygiene", engines=args.engines,
                              kv_cache_bytes=args.kv_cache_bytes)
    # long contexts: without hygiene a long job's last prompt nears 17k tokens
    settings = settings.model_copy(update={"engine_max_model_len": args.max_model_len})
    specs = workload(args)
    repeats: list[dict[str, Any]] = []
    async with (bench_stack(settings, console, keep=args.keep_stack) as fleet,
                httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as http):
        for rep in range(args.repeat):
            runs: dict[str, PolicyRun] = {}
            for name in rotated(list(args.policies), rep):
                console.print(f"repeat {rep + 1}/{args.repeat}, policy {name}: "
                              f"{args.long_jobs} long + {args.short_jobs} short jobs ...")
                t = time.monotonic()
                r = runs[name] = await run_policy(fleet.client, name, specs, http, fleet.urls,
                                                  fleet.redis, fleet.engine_ids, args)
                lg, sh = r.by_kind["long"], r.by_kind["short"]
                console.print(f"  {time.monotonic() - t:.0f}s; long: read {lg.prompt:,}, "
                              f"computed {lg.computed:,}, peak {lg.peak:,}, archived "
                              f"{lg.archived} at {lg.continued} points; short: read "
                              f"{sh.prompt:,}, archived {sh.archived}; {lg.states} {sh.states}")
            repeats.append(figures(runs))
    medians, ranges = medians_and_ranges(repeats)
    report(medians, ranges, len(repeats), console)
    return {**medians, "ranges": ranges, "repeats": len(repeats),
            "cached_fraction": CACHED_FRACTION,
            "workload": {"long_jobs": args.long_jobs, "long_steps": args.long_steps,
                         "short_jobs": args.short_jobs, "short_steps": args.short_steps,
                         "words_per_output": [args.min_words, args.max_words],
                         "kv_pool_tokens": args.kv_cache_bytes // 2048}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--repeat", type=int, default=3)
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--long-jobs", type=int, default=2)
    p.add_argument("--long-steps", type=int, default=40)
    p.add_argument("--long-budget", type=int, default=44, help="long jobs' max_steps")
    p.add_argument("--short-jobs", type=int, default=2)
    p.add_argument("--short-steps", type=int, default=6)
    p.add_argument("--short-budget", type=int, default=8, help="short jobs' max_steps")
    p.add_argument("--min-words", type=int, default=300, help="words in a tool output")
    p.add_argument("--max-words", type=int, default=400)
    p.add_argument("--pause-s", type=float, default=0.3, help="mean pause after a step")
    p.add_argument("--gap-s", type=float, default=0.5, help="between job starts")
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--kv-cache-bytes", type=int, default=44 * 1024 * 1024,
                   help="KV pool per engine (2,048 bytes a token on the tiny model): "
                   "small enough that the long jobs' contexts compete")
    p.add_argument("--max-model-len", type=int, default=20_480,
                   help="at most the KV pool (vLLM refuses a longer one)")
    p.add_argument("--seed", type=int, default=20)
    p.add_argument("--keep-stack", action="store_true", help="leave the stack running")
    args = p.parse_args(argv)
    console = Console(stderr=True, width=180)  # the tables are wide
    out = asyncio.run(main_async(args, console))
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
