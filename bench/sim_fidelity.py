"""`make bench-sim-fidelity`: the simulator against this project's measured benchmarks.

Runs the configurations of bench-routing, bench-pauses and bench-burst in the simulator
on the CPU engines' calibration (``warmloop.sim.scenarios``) and prints them beside the
measured figures: result files under ``.warmloop/`` when a bench left one
(``.warmloop/bench-<name>/result.json``: its last JSON line), else the published
figures in ``bench/measured/cpu_benchmarks.json`` (dated, with their commands). Targets:
hit rate and prefill tokens within 10 %, job p95 and makespan within 20 %. The last line
is one JSON object: per benchmark, ``measured`` and ``simulated`` (warmloop's policy),
``by_policy`` for the others, and ``within`` per figure.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

from warmloop.sim import scenarios
from warmloop.sim.run import Summary

MEASURED = Path(__file__).parent / "measured" / "cpu_benchmarks.json"
TOLERANCE = {"hit_rate": 0.10, "prefill_tokens": 0.10, "job_p95_s": 0.20, "makespan_s": 0.20}
MAIN_POLICY = {"bench-routing": "warmloop", "bench-pauses": "warmloop", "bench-burst": "lanes"}


def measured_figures(root: Path) -> dict[str, Any]:
    published = json.loads(MEASURED.read_text())
    for name in MAIN_POLICY:
        result = root / ".warmloop" / name / "result.json"
        if result.exists():
            published[name] = {"source": str(result), **json.loads(result.read_text())}
    return published


def simulated_figures(name: str, s: Summary) -> dict[str, float]:
    if name == "bench-pauses":
        return {"prefill_tokens": s.post_pause_recomputed,
                "other_ttft_p95_ms": round(s.other_ttft_p95_ms, 1)}
    if name == "bench-burst":
        return {"prefill_tokens": s.prefill_tokens, "makespan_s": round(s.makespan_s, 1),
                "interactive_ttft_p95_ms": round(s.ttft_p95_ms, 1)}
    return {"hit_rate": round(s.hit_rate, 4), "prefill_tokens": s.prefill_tokens,
            "job_p95_s": round(s.job_p95_s, 2), "makespan_s": round(s.makespan_s, 1)}


def within(measured: dict[str, float], simulated: dict[str, float]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, tol in TOLERANCE.items():
        if k in measured and k in simulated and measured[k]:
            err = simulated[k] / measured[k] - 1
            out[k] = {"error": round(err, 3), "ok": abs(err) <= tol}
    return out


def run(root: Path) -> dict[str, Any]:
    measured = measured_figures(root)
    sims = {"bench-routing": scenarios.bench_routing(
                mean_gap_s=measured["bench-routing"].get("mean_gap_s", 1.9)),
            "bench-pauses": scenarios.bench_pauses(),
            "bench-burst": scenarios.bench_burst()}
    out: dict[str, Any] = {}
    for name, runs in sims.items():
        m = measured[name]["policies"]
        by_policy = {}
        for pol, s in runs.items():
            sim = simulated_figures(name, s)
            by_policy[pol] = {"measured": m.get(pol, {}), "simulated": sim,
                              "within": within(m.get(pol, {}), sim)}
        main = MAIN_POLICY[name]
        out[name] = {**by_policy[main], "policy": main, "by_policy": by_policy,
                     "measured_source": measured[name]["source"]}
    return out


def fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, float) and v < 1:
        return f"{v:.3f}"
    if isinstance(v, float) and v < 1000:
        return f"{v:.1f}"
    return f"{v:,.0f}" if isinstance(v, (int, float)) else str(v)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", type=Path, default=Path.cwd())
    args = p.parse_args(argv)
    t = time.monotonic()
    out = run(args.root)
    print("| benchmark | policy | figure | measured | simulated | error | target |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for name, b in out.items():
        for pol, row in b["by_policy"].items():
            keys = sorted(set(row["measured"]) | set(row["simulated"]))
            for k in keys:
                w = row["within"].get(k)
                err = f"{w['error']:+.0%}" if w else "-"
                target = ("met" if w["ok"] else "missed") if w else "-"
                print(f"| {name} | {pol} | {k} | {fmt(row['measured'].get(k))} | "
                      f"{fmt(row['simulated'].get(k))} | {err} | {target} |")
    print(f"simulated in {time.monotonic() - t:.1f} s")
    print(json.dumps({k: {kk: v[kk] for kk in ("measured", "simulated", "within", "policy",
                                                  "by_policy")} for k, v in out.items()}))


if __name__ == "__main__":
    main()
