"""`make bench-fleet`: the three fleet policies at 8-256 GPUs, in the simulator.

GPUs carry a preset calibration (default H100 with Llama-3.1-8B bf16); jobs are the
bundled profiles' mix (ticket-triage and invoice-reconciliation, equal shares, their
own tools' and approvals' pause priors) arriving Poisson at a share of the fleet's
capacity, plus a 10x burst of batch jobs. Capacity is what the fleet could finish with a
perfect cache at saturation: per job, its new tokens at the calibrated prefill rate and its
output at the decode step time of the batch a saturated engine runs (``max_batch``, or
what the KV pool holds), so "80 % load" means the same offered work for every policy,
and 80 % of what the fleet can do. Per run: completed jobs per GPU-hour (jobs that ended within the
horizon), cost per task p50/p95 (the calibration's price), interactive TTFT p99. With
``--seeds N`` each configuration runs N workloads (seeds 1..N), every policy the same
ones: the closing JSON's figures are medians over them, with ``ranges`` and warmloop's
ratios paired seed by seed (``ratios``). With ``--settle F`` jobs per GPU-hour counts only
the jobs that ended after the first F of the horizon, per GPU-hour of the rest: the fleet
starts empty, so over a short horizon the figure is partly its ramp.
Policies: round_robin_lru (plain vLLM behind a balancer), cache_aware_no_holds (the
best peer's behaviour), warmloop. PNG plots go to ``.warmloop/bench-fleet/``; the last
line is one JSON object with the 128-GPU, 80 % figures first.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from pathlib import Path
from typing import Any

from warmloop import sim
from warmloop.sim.core import collecting_less, skip_exit_collection
from warmloop.sim.fleet import POLICIES, Fleet, FleetConfig, Policy
from warmloop.sim.run import Summary, simulate
from warmloop.sim.workload import WORKLOADS, JobProfile, JobSpec, burst_jobs, poisson_jobs
from warmloop.workflows.calibration import EngineCalibration, preset
from warmloop.workflows.holding import HoldConfig

VARIANTS: dict[str, Policy] = {
    "warmloop_no_prewarm": Policy("warmloop_no_prewarm", "cache_aware", "cost_model", True,
                                  False),
    "warmloop_no_holds": Policy("warmloop_no_holds", "cache_aware", "never", True, True),
    "warmloop_no_lanes": Policy("warmloop_no_lanes", "cache_aware", "cost_model", False, True),
    "warmloop_always_hold": Policy("warmloop_always_hold", "cache_aware", "always_hold", True,
                                   True),
}
"""warmloop with one of its parts off (or holding always), for ``--policies``: what each
part adds, measured on the same workloads as the three policies."""
RUNNABLE = [*POLICIES, *VARIANTS]
RELATIVE_CPU = {"round_robin_lru": 1.0, "cache_aware_no_holds": 1.5, "warmloop": 2.4}
"""CPU a run of each policy takes against round-robin's, for the same fleet and horizon
(2026-12-07, 128 GPUs, 80 %, 60 s, compiled, jobs' own blocks as runs: 13.0 / 19.2 /
31.5 s): only the order runs start in, so the longest does not start last while the
other processes sit idle."""


def saturation_batch(mix: list[tuple[JobProfile, float]], cal: EngineCalibration,
                     samples: int = 2_000) -> int:
    """Sequences a saturated engine decodes at once: ``max_batch``, or fewer when its KV
    pool cannot hold that many of the mix's steps (prompt and output) side by side."""
    rng = random.Random(0)
    profiles, weights = [p for p, _ in mix], [w for _, w in mix]
    resident = []
    for i in range(samples):
        job = rng.choices(profiles, weights)[0].job(f"c{i}", rng, 0.0)
        total = job.prefix_tokens + job.task_tokens
        for st in job.steps:
            resident.append(total + job.tail_tokens + st.output_tokens)
            total += st.result_tokens
    return max(1, min(cal.max_batch, int(cal.kv_pool_tokens // statistics.mean(resident))))


def capacity_jobs_per_s(mix: list[tuple[JobProfile, float]], cal: EngineCalibration,
                        gpus: int, samples: int = 2_000) -> float:
    """Jobs a second the fleet finishes at saturation with a perfect cache: each job's new
    tokens at the calibrated prefill rate, its output at the decode step time of the batch
    a saturated engine runs (``saturation_batch``).

    Decode per token falls 3x from batch 32 to 256 on the GPU presets, so a capacity
    priced at a small batch understates what the fleet can do: "80 % load" of it would be
    about half the real thing, where no policy queues and every policy completes the same
    jobs (this bench's figures before 2026-12-04 were priced at ``reference_batch``)."""
    rng = random.Random(0)
    profiles, weights = [p for p, _ in mix], [w for _, w in mix]
    secs = []
    batch = saturation_batch(mix, cal, samples)
    step_s = cal.decode_step_seconds(batch) / batch
    for i in range(samples):
        job = rng.choices(profiles, weights)[0].job(f"c{i}", rng, 0.0)
        total = job.prefix_tokens + job.task_tokens
        gpu = job.task_tokens / cal.prefill_tokens_per_s(total)
        for st in job.steps:
            gpu += (job.tail_tokens + st.result_tokens) / cal.prefill_tokens_per_s(total)
            gpu += st.output_tokens * step_s
            total += st.result_tokens
        secs.append(gpu)
    return gpus / statistics.mean(secs)


def one(gpus: int, load: float, policy: str, cal: EngineCalibration, horizon_s: float,
        burst: bool, seed: int = 1, workload: str = "bundled",
        holding: HoldConfig | None = None, settle_s: float = 0.0,
        ) -> tuple[Summary, float, float, int]:
    """One run: its summary, wall seconds, CPU seconds (the machine may be shared) and
    the jobs that ended at or after ``settle_s`` (every completed job when 0).
    ``holding``: the hold settings over the calibration's prices (None: the defaults)."""
    jobs = workload_jobs(gpus, load, cal, horizon_s, burst, seed, workload)
    t, cpu = time.monotonic(), time.process_time()
    config = None if holding is None else FleetConfig(hold=cal.hold_config(holding))
    fleets: list[Fleet] = []
    s = simulate(jobs, [cal] * gpus, VARIANTS.get(policy, policy), config=config,
                 until_s=horizon_s, setup=fleets.append)
    ended = s.completed if settle_s <= 0 else \
        sum(1 for j in fleets[0].jobs if j.end_s >= settle_s)  # NaN (not ended): False
    return s, time.monotonic() - t, time.process_time() - cpu, ended


_last_jobs: tuple[tuple[object, ...], list[JobSpec]] | None = None
"""The last workload built in this process, and what it was built from: the policies'
runs of one fleet and load are given the same jobs (a process often runs two of them in
turn), and building 100,000 jobs takes a few seconds."""


def workload_jobs(gpus: int, load: float, cal: EngineCalibration, horizon_s: float,
                  burst: bool, seed: int = 1, workload: str = "bundled") -> list[JobSpec]:
    """A run's jobs: Poisson arrivals at ``load`` of the fleet's capacity over the
    horizon, and with ``burst`` ten times the arrival rate as batch jobs over a fifth of
    it. The same arguments give the same list again (``simulate`` reads jobs, never
    changes them)."""
    global _last_jobs
    key = (gpus, load, cal.model_dump_json(), horizon_s, burst, seed, workload)
    if _last_jobs is not None and _last_jobs[0] == key:
        return _last_jobs[1]
    mix = WORKLOADS[workload]()
    rate = load * capacity_jobs_per_s(mix, cal, gpus)
    rng = random.Random(seed)
    with collecting_less():  # 100,000 jobs' objects, all kept: the collector's work only
        jobs = poisson_jobs(mix, rate_per_s=rate, duration_s=horizon_s, rng=rng)
        if burst:  # ten times the arrival rate, as batch jobs, over a fifth of the horizon
            n = int(10 * rate * horizon_s / 5)
            jobs += burst_jobs(mix, n=n, at_s=horizon_s / 5, over_s=horizon_s / 5, rng=rng)
    _last_jobs = (key, jobs)
    return jobs


Run = tuple[int, float, bool, str, float, int]
"""One run: GPUs, load, burst, policy, horizon, the workload's seed."""


def _row(run: Run, calibration: str, workload: str,
         holding: str | None = None, settle: float = 0.0) -> dict[str, Any]:
    """One run as a row of the table (in a worker process)."""
    gpus, load, burst, pol, horizon, seed = run
    hold = None if holding is None else HoldConfig.model_validate_json(holding)
    s, took, cpu_s, ended = one(gpus, load, pol, preset(calibration), horizon, burst,
                                seed=seed, workload=workload, holding=hold,
                                settle_s=settle * horizon)
    return {"gpus": gpus, "load": load, "burst": burst, "policy": pol, "horizon_s": horizon,
            "seed": seed, **figures(s, gpus, horizon, settle_s=settle * horizon, ended=ended),
            "wall_s": round(took, 1), "cpu_s": round(cpu_s, 1),
            "gpu_hours_per_wall_min": round(gpus * horizon / 60 / max(took, 1e-9), 2),
            "compiled": sim.COMPILED}


def figures(s: Summary, gpus: int, horizon_s: float, *, settle_s: float = 0.0,
            ended: int | None = None) -> dict[str, float]:
    """A run's row figures. Jobs per GPU-hour counts the ``ended`` jobs (those that
    ended at or after ``settle_s``; every completed one by default) over the GPU-hours
    from ``settle_s`` to the horizon."""
    ended = s.completed if ended is None else ended
    return {"jobs_per_gpu_hour": round(ended / (gpus * (horizon_s - settle_s) / 3600), 1),
            "settle_s": settle_s,
            "cost_p50_usd": round(s.cost_p50_usd, 7), "cost_p95_usd": round(s.cost_p95_usd, 7),
            "ttft_p99_ms": round(s.interactive_ttft_p99_ms, 1), "hit_rate": round(s.hit_rate, 4),
            "completed": s.completed, "jobs": s.jobs}


FIGURES = ("jobs_per_gpu_hour", "cost_p50_usd", "cost_p95_usd", "ttft_p99_ms", "hit_rate",
           "completed", "jobs")
"""A row's figures, each a median over the seeds in ``medians``."""


def _config(r: dict[str, Any]) -> tuple[int, float, bool, str, float]:
    return r["gpus"], r["load"], r["burst"], r["policy"], r["horizon_s"]


def medians(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per fleet, load, burst and policy: each figure's median over the runs'
    seeds (``seeds``: how many), in the order the configurations first appear."""
    by: dict[tuple[int, float, bool, str, float], list[dict[str, Any]]] = {}
    for r in rows:
        by.setdefault(_config(r), []).append(r)
    out = []
    for same in by.values():
        row = {**same[0], "seeds": len(same)}
        row.pop("seed", None)
        for k in FIGURES:
            if all(k in r for r in same):
                row[k] = statistics.median(r[k] for r in same)
        out.append(row)
    return out


def spread(rows: list[dict[str, Any]], gpus: int = 128, load: float = 0.8
           ) -> dict[str, Any]:
    """Over the seeds of the fleet of ``gpus`` at ``load`` (no burst): each policy's
    range of jobs per GPU-hour and TTFT p99, and warmloop's jobs per GPU-hour over each
    other policy's, seed by seed (one seed's workload run by both), as median and range.
    The simulator is deterministic for a seed, but which jobs end inside a short horizon
    moves from seed to seed by more than some policies differ."""
    sel = [r for r in rows if r["gpus"] == gpus and r["load"] == load and not r["burst"]]
    by_seed: dict[int, dict[str, dict[str, Any]]] = {}
    for r in sel:
        by_seed.setdefault(r.get("seed", 1), {})[r["policy"]] = r
    ranges: dict[str, dict[str, list[float]]] = {}
    for metric in ("jobs_per_gpu_hour", "ttft_p99_ms"):
        for pol in RUNNABLE:
            vals = [runs[pol][metric] for runs in by_seed.values() if pol in runs]
            if vals:
                ranges.setdefault(metric, {})[pol] = [min(vals), max(vals)]
    ratios: dict[str, dict[str, Any]] = {}
    for other in [p for p in RUNNABLE if p != "warmloop"]:
        vals = [runs["warmloop"]["jobs_per_gpu_hour"] / runs[other]["jobs_per_gpu_hour"]
                for runs in by_seed.values()
                if "warmloop" in runs and runs.get(other, {}).get("jobs_per_gpu_hour")]
        if vals:
            ratios[f"warmloop_over_{other}"] = {
                "median": round(statistics.median(vals), 4),
                "range": [round(min(vals), 4), round(max(vals), 4)]}
    return {"seeds": sorted(by_seed), "ranges": ranges, "ratios": ratios}


def plot(rows: list[dict[str, Any]], out: Path) -> list[str]:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    written = []
    for metric, label in (("jobs_per_gpu_hour", "completed jobs per GPU-hour"),
                          ("ttft_p99_ms", "interactive TTFT p99 (ms)"),
                          ("cost_p95_usd", "cost per task p95 ($)")):
        for gpus in sorted({r["gpus"] for r in rows}):
            sel = [r for r in rows if r["gpus"] == gpus and not r["burst"]]
            if len({r["load"] for r in sel}) < 2:
                continue
            fig, ax = plt.subplots(figsize=(6, 4))
            for pol in POLICIES:
                pts = sorted((r["load"], r[metric]) for r in sel if r["policy"] == pol)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
            ax.set_xlabel("offered load (share of perfect-cache capacity)")
            ax.set_ylabel(label)
            ax.set_title(f"{gpus} GPUs")
            ax.legend()
            path = out / f"{metric}-{gpus}gpus.png"
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(str(path))
        sel = [r for r in rows if r["load"] == 0.8 and not r["burst"]]
        if len({r["gpus"] for r in sel}) >= 2:  # the fleet sizes at 80 %
            fig, ax = plt.subplots(figsize=(6, 4))
            for pol in POLICIES:
                pts = sorted((r["gpus"], r[metric]) for r in sel if r["policy"] == pol)
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=pol)
            ax.set_xscale("log", base=2)
            ax.set_xlabel("GPUs (80 % load)")
            ax.set_ylabel(label)
            ax.legend()
            path = out / f"{metric}-by-gpus.png"
            fig.tight_layout()
            fig.savefig(path, dpi=100)
            plt.close(fig)
            written.append(str(path))
    return written


def report(rows: list[dict[str, Any]], out: Path, calibration: str, workload: str, *,
           elapsed_s: float | None = None, procs: int = 1, holding: str | None = None) -> None:
    """Plots, ``rows.json`` and the closing lines: the speed, then one JSON object with
    the 128-GPU, 80 % figures first.

    Speed is given three ways: ``elapsed_s`` (the whole run, its runs spread over
    ``procs`` processes: what "simulates in N minutes here" means), the runs' own wall
    times summed (one process's view) and their CPU time (what a shared host cannot
    inflate)."""
    med = medians(rows)
    plots = plot(med, out)
    (out / "rows.json").write_text(json.dumps(rows, indent=1))
    head = {r["policy"]: r for r in med if r["gpus"] == 128 and r["load"] == 0.8
            and not r["burst"]}
    sp = spread(rows)
    for gpus, load in sorted({(r["gpus"], r["load"]) for r in rows if not r["burst"]}):
        fleet = spread(rows, gpus, load)
        if len(fleet["seeds"]) > 1 and fleet["ratios"]:
            print(f"{gpus} GPUs, {load:.0%}, {len(fleet['seeds'])} seeds: " + "; ".join(
                f"{k.replace('_over_', ' / ')} jobs per GPU-hour {v['median']:.4f}x "
                f"[{v['range'][0]:.4f}-{v['range'][1]:.4f}]"
                for k, v in fleet["ratios"].items()))
    gpu_hours = sum(r["gpus"] * r["horizon_s"] / 3600 for r in rows)
    wall = sum(r["wall_s"] for r in rows)
    cpu = sum(r.get("cpu_s", 0.0) for r in rows)
    speed = []
    for pol in POLICIES:
        mine = [r for r in rows if r["policy"] == pol]
        h = sum(r["gpus"] * r["horizon_s"] / 3600 for r in mine)
        w = sum(r["wall_s"] for r in mine)
        c = sum(r.get("cpu_s", 0.0) for r in mine)
        if w:
            # CPU minutes too: on a shared host wall time counts the neighbours' work
            speed.append(f"{pol} {h / w * 60:.2f} GPU-h per wall min"
                         + (f", {h / c * 60:.2f} per CPU min" if c else ""))
    def per_100(seconds: float) -> str:  # minutes per 100 simulated GPU-hours
        return f"{seconds / max(gpu_hours, 1e-9) * 100 / 60:.1f}"

    compiled = bool(rows) and all(r.get("compiled") for r in rows)
    took = f"{elapsed_s:.0f} s elapsed over {procs} processes, " if elapsed_s else ""
    elapsed = f"{per_100(elapsed_s)} min elapsed, " if elapsed_s else ""
    print(f"simulated {gpu_hours:.1f} GPU-hours "
          f"({'compiled' if compiled else 'pure Python'}: WARMLOOP_SIM_COMPILED) in "
          f"{took}{wall:.0f} s of runs' wall, "
          f"{cpu:.0f} s CPU ({elapsed}{per_100(wall)} min of runs' wall, {per_100(cpu)} "
          "CPU-min per 100 GPU-hours); "
          + "; ".join(speed) + f"; plots: {', '.join(plots) or 'none'}")
    print(json.dumps({
        "gpus": 128, "load": 0.8, "calibration": calibration, "workload": workload,
        "holding": json.loads(holding) if holding else None,
        "jobs_per_gpu_hour": {k: v["jobs_per_gpu_hour"] for k, v in head.items()},
        "settle_s": next((v.get("settle_s", 0.0) for v in head.values()), None),
        "ttft_p99_ms": {k: v["ttft_p99_ms"] for k, v in head.items()},
        "cost_p95_usd": {k: v["cost_p95_usd"] for k, v in head.items()},
        "seeds": sp["seeds"], "ranges": sp["ranges"], "ratios": sp["ratios"],
        "simulated_gpu_hours": round(gpu_hours, 1), "wall_s": round(wall, 1),
        "elapsed_s": round(elapsed_s, 1) if elapsed_s else None, "procs": procs,
        "cpu_s": round(cpu, 1), "compiled": compiled, "rows": rows}))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calibration", default="h100-llama-3.1-8b-bf16")
    p.add_argument("--gpus", type=int, nargs="+", default=[8, 32, 128, 256])
    p.add_argument("--loads", type=float, nargs="+", default=[0.5, 0.65, 0.8, 0.95])
    p.add_argument("--sweep-gpus", type=int, default=32,
                   help="the size that runs every load; the others run 80 %% only")
    p.add_argument("--burst-gpus", type=int, nargs="*", default=None,
                   help="sizes that also run the 10x batch burst (default: every size)")
    p.add_argument("--policies", nargs="+", choices=RUNNABLE, default=list(POLICIES),
                   help="the three policies (default) and warmloop's variants with one "
                        "part off (VARIANTS), e.g. warmloop_no_prewarm")
    p.add_argument("--horizon-s", type=float, default=600.0)
    p.add_argument("--large-horizon-s", type=float, default=180.0,
                   help="horizon at 128 GPUs and more (keeps the run to minutes here)")
    p.add_argument("--workload", choices=sorted(WORKLOADS), default="bundled",
                   help="bundled: the bundled profiles' mix; agentic: a second, labelled "
                        "workload of long agent loops (sim.workload.agentic_mix)")
    p.add_argument("--seeds", type=int, default=1,
                   help="workloads per configuration (seeds 1..N), each run by every "
                        "policy: the table's rows per seed, the closing JSON's figures "
                        "their medians, with ranges and warmloop's ratios seed by seed")
    p.add_argument("--procs", type=int, default=os.cpu_count() or 1,
                   help="runs at once, one process each (default: one per core)")
    p.add_argument("--holding", default=None,
                   help="hold settings as JSON (HoldConfig, as WARMLOOP_HOLDING; the "
                        "calibration's prefill rate and GPU price replace those two), e.g. "
                        "'{\"rent\": \"model\"}' or '{\"cut_for_room\": true}'; "
                        "with --merge, say it again to record it")
    p.add_argument("--settle", type=float, default=0.0,
                   help="count only the jobs that end after this share of the horizon, "
                        "per GPU-hour of the rest (0 <= F < 1; default 0: every job that "
                        "ended): the fleet starts empty and a job's tool and approval "
                        "pauses keep it from ending in its first seconds, so over a short "
                        "horizon jobs per GPU-hour is partly that ramp")
    p.add_argument("--out", type=Path, default=Path(".warmloop/bench-fleet"))
    p.add_argument("--merge", type=Path, nargs="+", default=None,
                   help="run nothing: merge these rows.json files (runs split over "
                        "processes) into --out and print the closing lines")
    args = p.parse_args(argv)
    if args.seeds < 1:
        p.error("--seeds must be at least 1: each seed is one workload every policy runs")
    if not 0 <= args.settle < 1:
        p.error("--settle must be at least 0 and below 1: a share of the horizon")
    if args.holding is not None:
        HoldConfig.model_validate_json(args.holding)  # a bad setting fails here, not in a run
    args.out.mkdir(parents=True, exist_ok=True)
    if args.merge:
        merged: list[dict[str, Any]] = []
        for path in args.merge:
            merged += json.loads(path.read_text())
        report(merged, args.out, args.calibration, args.workload, holding=args.holding)
        return
    rows: list[dict[str, Any]] = []
    plan = [(g, load, False) for g in args.gpus for load in
            (args.loads if g == args.sweep_gpus else [0.8])]
    plan += [(g, 0.8, True) for g in (args.gpus if args.burst_gpus is None
                                      else args.burst_gpus)]
    runs: list[Run] = [
        (gpus, load, burst, pol, args.large_horizon_s if gpus >= 128 else args.horizon_s, seed)
        for seed in range(1, args.seeds + 1) for gpus, load, burst in plan
        for pol in args.policies]
    order = {r: i for i, r in enumerate(runs)}
    procs = max(1, min(args.procs, len(runs)))
    if args.settle:
        print(f"jobs/GPU-h: the jobs that ended after the first {args.settle:.0%} of the "
              "horizon, per GPU-hour of the rest (--settle)")
    print("| GPUs | load | burst | seed | policy | jobs/GPU-h | cost p50 / p95 | TTFT p99 ms "
          "| hit |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    started = time.monotonic()
    # Each run is one process's work from start to end (a fleet's engines share one
    # clock); runs are independent, so they spread over the cores, largest first (by
    # simulated GPU-hours times the policy's cost, so the longest run does not start
    # last and finish alone).
    biggest_first = sorted(runs, key=lambda r: -r[0] * r[4] * RELATIVE_CPU.get(r[3], 1.0))
    # The processes end without the interpreter's last collection over the fleets they
    # leave behind (seconds a process, after the last figure: skip_exit_collection).
    with ProcessPoolExecutor(procs, mp_context=mp.get_context("spawn"),
                             initializer=skip_exit_collection) as pool:
        futures = [pool.submit(_row, r, args.calibration, args.workload, args.holding,
                               args.settle) for r in biggest_first]
        for fut in as_completed(futures):
            row = fut.result()
            rows.append(row)
            rows.sort(key=lambda r: order[(*_config(r), r["seed"])])
            (args.out / "rows.json").write_text(json.dumps(rows, indent=1))  # as it goes
            print(f"| {row['gpus']} | {row['load']:.0%} | {'10x' if row['burst'] else '-'} | "
                  f"{row['seed']} | {row['policy']} | {row['jobs_per_gpu_hour']:.1f} | "
                  f"${row['cost_p50_usd']:.6f} / ${row['cost_p95_usd']:.6f} | "
                  f"{row['ttft_p99_ms']:.0f} | {row['hit_rate']:.3f} |", flush=True)
    elapsed = time.monotonic() - started
    report(rows, args.out, args.calibration, args.workload, elapsed_s=elapsed,
           procs=procs, holding=args.holding)


if __name__ == "__main__":
    main()
