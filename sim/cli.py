"""`warmloop simulate` and `warmloop forecast`: the commands' logic (``workers/cli.py``
registers them and passes their arguments through)."""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

from warmloop.sim.core import skip_exit_collection
from warmloop.sim.fleet import POLICIES
from warmloop.sim.run import simulate
from warmloop.sim.workload import (
    JobSpec,
    bundled_mix,
    burst_jobs,
    poisson_jobs,
    trace_jobs,
)
from warmloop.workflows.calibration import PRESETS, EngineCalibration, preset


def _calibration(text: str) -> EngineCalibration:
    path = Path(text)
    if path.exists():
        return EngineCalibration.model_validate_json(path.read_text())
    return preset(text)


def simulate_main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="warmloop simulate",
        description="Simulate a fleet running warmloop's own policies (sim/).")
    p.add_argument("--gpus", type=int, default=8, help="engines, one per GPU")
    p.add_argument("--calibration", default="h100-llama-3.1-8b-bf16",
                   help=f"a preset ({', '.join(sorted(PRESETS))}) or a calibration JSON file")
    p.add_argument("--policy", nargs="+", default=list(POLICIES), choices=list(POLICIES))
    p.add_argument("--rate", type=float, default=None,
                   help="jobs a second (Poisson); default: 2 per GPU")
    p.add_argument("--duration-s", type=float, default=300.0)
    p.add_argument("--burst", type=int, default=0, help="batch jobs in one burst at 1/3")
    p.add_argument("--trace", type=Path, default=None,
                   help="replay a trace file (warmloop replay's JSONL) instead of profiles")
    p.add_argument("--trace-gap-s", type=float, default=2.0)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="one JSON object per policy")
    args = p.parse_args(argv)
    try:
        cal = _calibration(args.calibration)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    skip_exit_collection()  # the fleets left behind are garbage: no walk over them at exit
    for policy in args.policy:
        rng = random.Random(args.seed)
        jobs: list[JobSpec]
        if args.trace is not None:
            jobs = trace_jobs(args.trace, mean_gap_s=args.trace_gap_s, rng=rng)
        else:
            mix = bundled_mix()
            jobs = poisson_jobs(mix, rate_per_s=args.rate or 2.0 * args.gpus,
                                duration_s=args.duration_s, rng=rng)
            if args.burst:
                jobs += burst_jobs(mix, n=args.burst, at_s=args.duration_s / 3, over_s=10.0,
                                   rng=rng)
        t = time.monotonic()
        s = simulate(jobs, [cal] * args.gpus, policy,
                     until_s=None if args.trace else args.duration_s)
        took = time.monotonic() - t
        if args.json:
            print(json.dumps({**s.as_dict(), "wall_s": round(took, 2)}))
        else:
            print(f"{policy}: {s.completed}/{s.jobs} jobs done, {s.steps} steps, hit rate "
                  f"{s.hit_rate:.3f}, prefill {s.prefill_tokens:,} tokens, job p95 "
                  f"{s.job_p95_s:.1f} s, interactive TTFT p99 {s.interactive_ttft_p99_ms:.0f} "
                  f"ms, cost per task p50/p95 ${s.cost_p50_usd:.6f}/${s.cost_p95_usd:.6f} "
                  f"({took:.1f} s wall)")
    return 0


def forecast_main(argv: list[str] | None = None) -> int:
    from warmloop.sim.forecast import forecast, load_jobs
    p = argparse.ArgumentParser(
        prog="warmloop forecast",
        description="Forecast a profile's cost per task by Monte Carlo over observed jobs.")
    p.add_argument("profile", help="the profile whose observed jobs to learn from ('*': all)")
    p.add_argument("--observed", type=Path, required=True,
                   help="observed jobs: `warmloop result --json` output (JSON, a list, or "
                        "JSONL) or inference workers' step_generated log lines")
    p.add_argument("--runs", type=int, default=10_000)
    p.add_argument("--calibration", default="cpu-tiny",
                   help="prices steps whose cost was not recorded (a preset or a JSON file)")
    p.add_argument("--tool-costs", type=str, default="{}",
                   help='dollars per call by tool, JSON: {"search_kb": 0.001}')
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    try:
        cal = _calibration(args.calibration)
        jobs = [j for j in load_jobs(args.observed)
                if args.profile == "*" or j.profile == args.profile]
        f = forecast(jobs, cal.engine_price().pricing, runs=args.runs, seed=args.seed,
                     tool_costs=json.loads(args.tool_costs))
    except (ValueError, OSError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"{args.profile}: {f.runs:,} simulated tasks learned from {f.observed} observed jobs")
    print(f.line())
    print(f"median ${f.p50:.6f}; observed jobs inside the 80 % band: {f.observed_in_band:.0%}; "
          f"over the 95th percentile: {f.observed_over_p95:.0%}")
    print(json.dumps({"profile": args.profile, "runs": f.runs, "p10_usd": f.p10,
                      "p50_usd": f.p50, "p90_usd": f.p90, "p95_usd": f.p95,
                      "observed": f.observed, "observed_in_band": f.observed_in_band,
                      "observed_over_p95": f.observed_over_p95}))
    return 0
