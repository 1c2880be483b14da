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
import statistics
import time
from collections.abc import Iterable, Iterator
from datetime import datetime
from pathlib import Path
from typing import Any

from bench.pauses import keepable_tokens
from warmloop.sim import scenarios
from warmloop.sim.run import Summary

MEASURED = Path(__file__).parent / "measured" / "cpu_benchmarks.json"
TOLERANCE = {"hit_rate": 0.10, "prefill_tokens": 0.10, "job_p95_s": 0.20, "makespan_s": 0.20}
MAIN_POLICY = {"bench-routing": "warmloop", "bench-pauses": "warmloop", "bench-burst": "lanes"}
PAUSES_PHASES = 12
"""bench-pauses is simulated this many times, its background's first request at each
twelfth of an interval, and each figure is the median: the bench's repeats start at
other phases of their steady background, and on 16 jobs one block (128 tokens) more or
less, which the phase alone moves, is 5 % of a hold policy's figure."""


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


def _background(measured: dict[str, Any]) -> dict[str, Any]:
    """The background traffic the measured bench-pauses run sized for itself (requests
    a second per engine, prompt tokens each), its calls' own prompt sizes and the
    engines' calibration its hold model priced by, where it recorded them."""
    out: dict[str, Any] = {}
    if "bg_rate_per_engine" in measured:
        out["bg_rate"] = float(measured["bg_rate_per_engine"])
    if "bg_prompt_tokens" in measured:
        out["bg_tokens"] = int(measured["bg_prompt_tokens"])
    if measured.get("prompt_tokens_by_job"):  # each call's own size
        out["prompts"] = {j: [int(n) for n in sizes]
                          for j, sizes in measured["prompt_tokens_by_job"].items()}
    if measured.get("calibration"):  # what the workers' hold model priced by
        out["hold_pricing"] = scenarios.measured_pricing(measured["calibration"])
    return out


def median_figures(runs: list[dict[str, float]]) -> dict[str, float]:
    """Each figure's median over ``runs`` (the same keys in each; token counts whole)."""
    out = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
    return {k: round(v) if k.endswith("_tokens") else v for k, v in out.items()}


def pauses_phases(measured: dict[str, Any], **scenario: Any
                  ) -> Iterator[tuple[dict[str, Summary], dict[str, Any]]]:
    """bench-pauses simulated with the background the measured run had (``measured``: its
    figures), its first request at each of ``PAUSES_PHASES`` phases in turn: each phase's
    summaries and fleets, by policy (each fleet's ``call_times`` recorded). ``scenario``:
    more of ``scenarios.bench_pauses``' arguments."""
    background = {**_background(measured), **scenario}

    for k in range(PAUSES_PHASES):
        fleets: dict[str, Any] = {}

        def keep(policy: str, fleet: Any, fleets: dict[str, Any] = fleets) -> None:
            fleet.call_times = []
            fleets[policy] = fleet

        summaries = scenarios.bench_pauses(**background, bg_phase=k / PAUSES_PHASES,
                                           on_fleet=keep)
        yield summaries, fleets


def phase_fleets(measured: dict[str, Any], **scenario: Any) -> list[dict[str, Any]]:
    """``pauses_phases``' fleets alone, every phase simulated (the log readers keep them
    to read more than one figure off one simulation)."""
    return [fleets for _, fleets in pauses_phases(measured, **scenario)]


def run(root: Path) -> dict[str, Any]:
    measured = measured_figures(root)
    pauses = [summaries for summaries, _ in pauses_phases(measured["bench-pauses"])]
    routing = scenarios.bench_routing(
        mean_gap_s=measured["bench-routing"].get("mean_gap_s", 1.9))
    burst = scenarios.bench_burst()
    sims = {"bench-routing": {p: simulated_figures("bench-routing", s)
                              for p, s in routing.items()},
            "bench-pauses": {p: median_figures([simulated_figures("bench-pauses", run[p])
                                                for run in pauses]) for p in pauses[0]},
            "bench-burst": {p: simulated_figures("bench-burst", s) for p, s in burst.items()}}
    out: dict[str, Any] = {}
    for name, figures in sims.items():
        m = measured[name]["policies"]
        by_policy = {}
        for pol, sim in figures.items():
            by_policy[pol] = {"measured": m.get(pol, {}), "simulated": sim,
                              "within": within(m.get(pol, {}), sim)}
        main = MAIN_POLICY[name]
        out[name] = {**by_policy[main], "policy": main, "by_policy": by_policy,
                     "measured_source": measured[name]["source"]}
    return out


def _sim_by_kind(fleet: Any, plans: dict[str, Any]) -> dict[str, list[int]]:
    """One simulated run's resumed steps summed by the pause before each: [steps, prompt
    tokens, recomputed tokens], and the pre-warms' computed tokens."""
    sim: dict[str, list[int]] = {"prewarm": [0, 0, fleet.prewarm_computed]}
    for st in fleet.steps:
        if st.step <= 1 or st.job_id not in plans:
            continue
        kind = plans[st.job_id].steps[st.step - 2].pause_kind or "none"
        acc = sim.setdefault(kind, [0, 0, 0])
        acc[0] += 1
        acc[1] += st.prompt_tokens
        acc[2] += st.keepable_tokens - min(st.cached_tokens, st.keepable_tokens)
    return sim


def pauses_by_step(jobs_json: Path, measured: dict[str, Any]) -> list[dict[str, Any]]:
    """bench-pauses' resumed steps set beside the simulator's, by policy and by what the
    job waited on before the step (a lookup, an approval): steps, prompt tokens,
    recomputed tokens (medians over the measured repeats, and over the simulator's
    ``PAUSES_PHASES`` background phases, with both ranges), and the pre-warms' tokens.
    ``jobs_json``: the bench's ``--jobs-json`` file (the same plans, step by step)."""
    rows = json.loads(jobs_json.read_text())
    plans = {j.job_id: j for j in scenarios.pauses_jobs()}
    phases = [{policy: _sim_by_kind(f, plans) for policy, f in fleets.items()}
              for fleets in phase_fleets(measured)]
    out = []
    for policy in phases[0]:
        # measured: per repeat, sums by the pause kind before each step
        per_rep: dict[int, dict[str, list[int]]] = {}
        for r in rows:
            if r["policy"] != policy:
                continue
            got = per_rep.setdefault(r["repeat"], {})
            if "steps" not in r:
                got.setdefault("prewarm", [0, 0, 0])[2] += r["prewarm_tokens"]
                continue
            plan = plans[r["job"]]
            for prev, st in zip(r["steps"], r["steps"][1:], strict=False):
                kind = plan.steps[prev["step"] - 1].pause_kind or "none"
                keep = keepable_tokens(prev["prompt_tokens"])
                rec = keep - min(st["cached_tokens"], keep)  # bench-pauses' own measure
                acc = got.setdefault(kind, [0, 0, 0])
                acc[0] += 1
                acc[1] += st["prompt_tokens"]
                acc[2] += rec
        kinds = {k for p in phases for k in p[policy]} | {k for g in per_rep.values() for k in g}
        for kind in sorted(kinds):
            meas = [g.get(kind, [0, 0, 0]) for g in per_rep.values()]
            med = [statistics.median(m[i] for m in meas) if meas else math.nan
                   for i in range(3)]
            sims = [p[policy].get(kind, [0, 0, 0]) for p in phases]
            out.append({"policy": policy, "after": kind,
                        "measured": {"steps": med[0], "prompt_tokens": med[1],
                                     "recomputed": med[2],
                                     "recomputed_range": [min(m[2] for m in meas),
                                                          max(m[2] for m in meas)]
                                     if meas else None},
                        "simulated": {**{f: round(statistics.median(x[i] for x in sims))
                                         for i, f in enumerate(
                                             ("steps", "prompt_tokens", "recomputed"))},
                                      "recomputed_range": [min(x[2] for x in sims),
                                                           max(x[2] for x in sims)]}})
    return out


PREWARM_OUTCOMES = ("nothing", "part of the prefix", "the prefix or more")
"""What a pre-warm found cached, against the approving family's shared prefix (its full
blocks): nothing is a prefix evicted from the engine, whose whole prompt the pre-warm
computes again."""


def prewarm_outcome(cached_tokens: int, prefix_tokens: int) -> str:
    """``cached_tokens`` of a pre-warm as one of ``PREWARM_OUTCOMES``."""
    if cached_tokens <= 0:
        return PREWARM_OUTCOMES[0]
    return PREWARM_OUTCOMES[1] if cached_tokens < prefix_tokens else PREWARM_OUTCOMES[2]


def _logged_calls(lines: Iterable[str]) -> dict[tuple[str, int], list[tuple[str, int]]]:
    """bench-pauses' calls in its inference workers' logs: (workflow id, step number) ->
    each call's (timestamp, cached tokens). A worker logs every call it serves
    (``step_generated``); a pre-warm carries the number of the step before it and comes
    after that step, so in each group, in time order, the first is the step and the rest
    its approval's pre-warms. Lines that are not such JSON records are skipped."""
    calls: dict[tuple[str, int], list[tuple[str, int]]] = {}
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict) or rec.get("event") != "step_generated":
            continue
        job = str(rec.get("job_id", ""))
        if not job.startswith("pauses-") or job.count("-") < 3:
            continue
        calls.setdefault((job, int(rec["step"])), []).append(
            (str(rec["timestamp"]), int(rec["cached_tokens"])))
    return calls


def _worker_log_lines(logs: Path) -> list[str]:
    """Every line of bench-pauses' inference workers' logs (``logs``: its log folder)."""
    lines: list[str] = []
    for path in sorted(logs.glob("inference-worker-*.log")):
        lines += path.read_text(errors="replace").splitlines()
    return lines


def logged_prewarms(lines: Iterable[str]) -> dict[str, dict[str, list[int]]]:
    """bench-pauses' pre-warms in its inference workers' logs (``_logged_calls``): policy
    -> run (the workflow ids' ``pauses-<policy>-<tag>``) -> each pre-warm's cached
    tokens, in time order."""
    calls = _logged_calls(lines)
    out: dict[str, dict[str, list[int]]] = {}
    for (job, _), got in sorted(calls.items(), key=lambda kv: min(kv[1])):
        _, policy, tag, _ = job.split("-", 3)
        runs = out.setdefault(policy, {})
        runs.setdefault(f"{policy}-{tag}", []).extend(c for _, c in sorted(got)[1:])
    return out


def approval_lateness(calls: Iterable[tuple[str, str, int, float]]) -> list[float]:
    """How late each approval's pre-warms ended against the plan's times, in seconds:
    ``calls`` are (run, plan job id, step number, end time) of steps and pre-warms, a
    pre-warm numbered by the step before it (as the workers log them and
    ``Fleet.call_times`` records them); in each (run, job, step) group of a planned
    approval, in time order, the step, the view's pre-warm and the decision's: the view's
    end less the step's less the plan's view time, the decision's less its decision
    time. What the reviewer's lateness, the path to the engine and the pre-warm's own
    compute add up to."""
    plans = {j.job_id: j for j in scenarios.pauses_jobs()}
    groups: dict[tuple[str, str, int], list[float]] = {}
    for run, job, step, at in calls:
        groups.setdefault((run, job, step), []).append(at)
    out = []
    for (_, job, step), times in groups.items():
        plan = plans.get(job)
        if plan is None or not 0 < step <= len(plan.steps):
            continue
        st = plan.steps[step - 1]
        if not st.approval or st.viewed_after_s is None or len(times) < 2:
            continue
        times.sort()
        out.append(times[1] - times[0] - st.viewed_after_s)
        if len(times) > 2:
            out.append(times[2] - times[0] - st.pause_s)
    return out


def _quartiles(values: list[float]) -> list[float]:
    return [round(q, 2) for q in statistics.quantiles(values, n=4)] if len(values) > 1 else []


def lateness_beside(logs: Path, measured: dict[str, Any],
                    phases: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The approvals' pre-warms' lateness (``approval_lateness``) as the workers logged
    them (``logs``) and as the simulator has them, at its reviewer's lateness
    (``scenarios.PAUSES_APPROVAL_NOTICE_S``) and at none: quartiles in seconds, and the
    uniform range of a lateness that gives the measured quartiles once the simulator's
    own (its quartiles at none, their mean) is taken off. ``phases``: the fleets of
    ``pauses_phases(measured)`` simulated already (``prewarms_beside`` reads the same)."""
    logged = []
    for (workflow_id, step), got in _logged_calls(_worker_log_lines(logs)).items():
        run, number = workflow_id.rsplit("-", 1)
        for stamp, _ in got:
            at = datetime.fromisoformat(stamp.replace("Z", "+00:00")).timestamp()
            logged.append((run, f"p{int(number):03d}", step, at))
    out: dict[str, Any] = {"measured": approval_lateness(logged)}
    for name, ran in (("simulated", phase_fleets(measured) if phases is None else phases),
                      ("simulated, no lateness",
                       phase_fleets(measured, approval_notice_s=(0.0, 0.0)))):
        sim: list[float] = []
        for k, fleets in enumerate(ran):
            for policy, fleet in fleets.items():
                sim += approval_lateness((f"{policy}/{k}", job, step, at)
                                         for job, step, at in fleet.call_times)
        out[name] = sim
    quart = {k: _quartiles(v) for k, v in out.items()}
    row: dict[str, Any] = {k: {"quartiles_s": quart[k], "n": len(v)} for k, v in out.items()}
    if quart["measured"] and quart["simulated, no lateness"]:
        q1, _, q3 = quart["measured"]
        own = statistics.mean(quart["simulated, no lateness"])
        width = 2 * (q3 - q1)  # a uniform range's quartiles are a half-width apart
        low = q1 - width / 4 - own
        row["fitted_notice_s"] = [round(low, 2), round(low + width, 2)]
    return row


def prewarms_beside(logs: Path, measured: dict[str, Any],
                    phases: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """Per policy and ``PREWARM_OUTCOMES``: how many pre-warms a run found so, the
    workers' logs (``logs``: bench-pauses' log folder, its ``inference-worker-*.log``)
    against the simulator's (a mean over its ``PAUSES_PHASES`` background phases; their
    fleets, ``pauses_phases(measured)``, given as ``phases`` or simulated here)."""
    logged = logged_prewarms(_worker_log_lines(logs))
    jobs = scenarios.pauses_jobs()
    block = scenarios.CPU_TINY_LOADED.block_size
    prefix = min(j.prefix_tokens for j in jobs if any(st.approval for st in j.steps))
    prefix = prefix // block * block  # the family's shared full blocks
    sims: dict[str, list[list[int]]] = {}
    for fleets in phase_fleets(measured) if phases is None else phases:
        for policy, fleet in fleets.items():
            sims.setdefault(policy, []).append(fleet.prewarm_cached)
    out = []
    for policy in sorted(set(logged) | set(sims)):
        runs = logged.get(policy, {})
        simulated = sims.get(policy, [])
        for outcome in PREWARM_OUTCOMES:
            def per_run(groups: list[list[int]], outcome: str = outcome) -> float:
                counts = [sum(prewarm_outcome(c, prefix) == outcome for c in g)
                          for g in groups]
                return statistics.mean(counts) if counts else math.nan
            out.append({"policy": policy, "found": outcome, "prefix_tokens": prefix,
                        "measured": per_run(list(runs.values())), "runs": len(runs),
                        "simulated": per_run(simulated)})
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
    p.add_argument("--pauses-jobs", type=Path, default=None,
                   help="run nothing else: set bench-pauses' steps (its --jobs-json file) "
                        "beside the simulator's, by policy and by the pause before each")
    p.add_argument("--pauses-logs", type=Path, default=None,
                   help="run nothing else: set the pre-warms bench-pauses' inference workers "
                        "logged (its log folder, e.g. .warmloop/bench-pauses/logs) beside the "
                        "simulator's, by what each found cached")
    args = p.parse_args(argv)
    if args.pauses_logs:
        measured = measured_figures(args.root)["bench-pauses"]
        phases = phase_fleets(measured)  # simulated once, read twice
        rows = prewarms_beside(args.pauses_logs, measured, phases)
        prefix = rows[0]["prefix_tokens"] if rows else 0
        print(f"| policy | a pre-warm found cached (prefix: {prefix:,} tokens) | measured, "
              f"per run | simulated, per run of {PAUSES_PHASES} phases |")
        print("| --- | --- | --- | --- |")
        for r in rows:
            print(f"| {r['policy']} | {r['found']} | {fmt(float(r['measured']))} "
                  f"({r['runs']} runs) | {fmt(float(r['simulated']))} |")
        late = lateness_beside(args.pauses_logs, measured, phases)
        print("\n| approvals' pre-warms, late against the plan | quartiles (s) | pre-warms |")
        print("| --- | --- | --- |")
        for k in ("measured", "simulated", "simulated, no lateness"):
            q = " / ".join(f"{x:.2f}" for x in late[k]["quartiles_s"]) or "-"
            print(f"| {k} | {q} | {late[k]['n']} |")
        if "fitted_notice_s" in late:
            lo, hi = late["fitted_notice_s"]
            print(f"a reviewer's lateness uniform over {lo:.2f}-{hi:.2f} s gives the measured "
                  "quartiles (scenarios.PAUSES_APPROVAL_NOTICE_S: "
                  f"{scenarios.PAUSES_APPROVAL_NOTICE_S[0]}-"
                  f"{scenarios.PAUSES_APPROVAL_NOTICE_S[1]} s)")
        return
    if args.pauses_jobs:
        measured = measured_figures(args.root)["bench-pauses"]
        print("| policy | after | steps | prompt tokens | recomputed: measured [range] | "
              f"simulated [range over {PAUSES_PHASES} background phases] |")
        print("| --- | --- | --- | --- | --- | --- |")
        for r in pauses_by_step(args.pauses_jobs, measured):
            m, sm = r["measured"], r["simulated"]
            rg = m["recomputed_range"]
            print(f"| {r['policy']} | {r['after']} | {fmt(m['steps'])} / {sm['steps']} | "
                  f"{fmt(m['prompt_tokens'])} / {sm['prompt_tokens']:,} | "
                  f"{fmt(m['recomputed'])} [{rg[0]:,}-{rg[1]:,}] | "
                  f"{sm['recomputed']:,} [{sm['recomputed_range'][0]:,}-"
                  f"{sm['recomputed_range'][1]:,}] |"
                  if rg else f"| {r['policy']} | {r['after']} | -")
        return
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
