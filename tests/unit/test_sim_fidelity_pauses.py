"""bench-sim-fidelity reads bench-pauses' own configuration and sets its steps beside the
simulator's (``--pauses-jobs``)."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest

from bench.sim_fidelity import _background, pauses_by_step
from warmloop.sim import scenarios


def test_the_simulated_background_is_the_one_the_bench_measured() -> None:
    assert _background({"bg_rate_per_engine": 3.2, "bg_prompt_tokens": 530}) == {
        "bg_rate": 3.2, "bg_tokens": 530}
    assert _background({}) == {}  # published figures without them: the scenario's own


def test_the_published_runs_prompt_sizes_reach_the_simulator() -> None:
    """Each call's own size, as the published runs' engines counted it, sizes the
    simulated jobs (``sized_by_prompts``); every job of the plans has its six."""
    got = _background({"prompt_tokens_by_job": {"p001": ["1550", 1632]}})
    assert got == {"prompts": {"p001": [1_550, 1_632]}}
    published = json.loads((Path(__file__).parents[2] / "bench" / "measured"
                            / "cpu_benchmarks.json").read_text())
    sizes = published["bench-pauses"]["prompt_tokens_by_job"]
    assert sorted(sizes) == sorted(j.job_id for j in scenarios.pauses_jobs())
    sized = scenarios.sized_by_prompts(scenarios.pauses_jobs(), sizes)
    assert all(j.prefix_tokens + j.task_tokens + j.tail_tokens == sizes[j.job_id][0]
               for j in sized)


def test_resumed_steps_are_summed_by_the_pause_before_them(tmp_path: Path) -> None:
    plan = next(j for j in scenarios.pauses_jobs() if j.family == "synthetic-support")
    assert plan.steps[0].pause_kind == "tool:lookup"
    steps = [{"step": 1, "engine": "e0", "prompt_tokens": 1_550, "cached_tokens": 0},
             # keepable: (1,550 // 128 - 1) * 128 = 1,408; 1,152 of it cached
             {"step": 2, "engine": "e0", "prompt_tokens": 1_635, "cached_tokens": 1_152}]
    rows = [{"repeat": r, "policy": "release", "job": plan.job_id, "steps": steps}
            for r in (0, 1)]
    rows += [{"repeat": 0, "policy": "release", "prewarm_tokens": 300, "recomputed": 428},
             {"repeat": 1, "policy": "release", "prewarm_tokens": 500, "recomputed": 628}]
    path = tmp_path / "jobs.json"
    path.write_text(json.dumps(rows))
    out = {(r["policy"], r["after"]): r for r in pauses_by_step(path, {})}
    lookup = out[("release", "tool:lookup")]
    assert lookup["measured"]["steps"] == 1
    assert lookup["measured"]["recomputed"] == 256
    assert out[("release", "prewarm")]["measured"]["recomputed"] == 400  # the median
    assert out[("release", "prewarm")]["measured"]["recomputed_range"] == [300, 500]
    # the simulator's side is its own run of the same plans: every step after a lookup
    assert lookup["simulated"]["steps"] == sum(
        st.pause_kind == "tool:lookup" for j in scenarios.pauses_jobs() for st in j.steps)
    assert math.isnan(out[("hold", "tool:lookup")]["measured"]["steps"])  # not measured


def test_figures_over_the_background_phases_are_medians() -> None:
    from bench.sim_fidelity import median_figures

    runs = [{"prefill_tokens": 2_504, "other_ttft_p95_ms": 70.0},
            {"prefill_tokens": 2_632, "other_ttft_p95_ms": 72.0},
            {"prefill_tokens": 2_888, "other_ttft_p95_ms": 71.0},
            {"prefill_tokens": 2_504, "other_ttft_p95_ms": 75.0}]
    assert median_figures(runs) == {"prefill_tokens": 2_568, "other_ttft_p95_ms": 71.5}


def test_the_background_starts_at_its_phase() -> None:
    from warmloop.sim.core import Clock
    from warmloop.sim.engine import Request
    from warmloop.sim.fleet import POLICIES, Fleet
    from warmloop.sim.scenarios import CPU_TINY_LOADED

    def sent_at(phase: float) -> list[float]:
        clock = Clock()
        fleet = Fleet(clock, [CPU_TINY_LOADED], POLICIES["round_robin_lru"])
        engine, times = fleet.engines[0], []
        real = engine.submit

        def submit(req: Request) -> None:
            times.append(clock.now)
            real(req)

        engine.submit = submit  # type: ignore[method-assign]
        fleet.background(rate_per_engine_s=2.0, prompt_tokens=256, output_tokens=1,
                         until_s=1.0, phase=phase)
        clock.run(1.0)
        return times

    assert sent_at(0.0) == [0.0, 0.5]
    assert sent_at(0.5) == [0.25, 0.75]  # half an interval in, then every interval


def _call(job: str, step: int, t: str, cached: int) -> str:
    return json.dumps({"event": "step_generated", "job_id": job, "step": step,
                       "prompt_tokens": 1_613, "cached_tokens": cached,
                       "timestamp": f"2026-12-06T16:28:{t}Z"})


def test_pre_warms_are_read_from_the_workers_logs_in_time_order() -> None:
    """In a job's group of one step number the first call is the step, the rest its
    approval's pre-warms, whichever worker logged them and in whatever order the lines
    come; other records and lines that are not JSON are skipped."""
    lines = [
        _call("pauses-release-ab12-004", 1, "35.0", 1_536),  # the view's pre-warm
        _call("pauses-release-ab12-004", 1, "20.0", 0),  # the step itself
        "not json",
        json.dumps({"event": "step_routed", "job_id": "pauses-release-ab12-004", "step": 2}),
        _call("pauses-release-ab12-004", 1, "39.0", 0),  # the decision's: prefix gone
        _call("pauses-release-ab12-004", 2, "40.0", 1_536),  # step 2, no approval
        _call("pauses-hold-cd34-000", 1, "50.0", 1_408),
        _call("pauses-hold-cd34-000", 1, "55.0", 1_664),
        _call("bench-other-job", 1, "56.0", 0),  # not bench-pauses'
    ]
    from bench.sim_fidelity import logged_prewarms

    assert logged_prewarms(lines) == {"release": {"release-ab12": [1_536, 0]},
                                      "hold": {"hold-cd34": [1_664]}}


def test_a_pre_warms_outcome_is_read_against_the_familys_prefix() -> None:
    from bench.sim_fidelity import PREWARM_OUTCOMES, prewarm_outcome

    assert [prewarm_outcome(c, 1_408) for c in (0, 256, 1_407, 1_408, 1_536)] == [
        PREWARM_OUTCOMES[0], PREWARM_OUTCOMES[1], PREWARM_OUTCOMES[1],
        PREWARM_OUTCOMES[2], PREWARM_OUTCOMES[2]]


def test_the_pre_warms_are_set_beside_the_simulators(tmp_path: Path) -> None:
    """``--pauses-logs``: the logged pre-warms per run by outcome, beside the simulated
    ones per run (one cached figure a pre-warm: under always-hold all 24 of a run, a
    view and a decision for each of its 12 approvals, find their held prefix)."""
    from bench.sim_fidelity import prewarms_beside

    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "inference-worker-e0.log").write_text("\n".join([
        _call("pauses-release-ab12-004", 1, "20.0", 0),
        _call("pauses-release-ab12-004", 1, "35.0", 0)]) + "\n")
    rows = {(r["policy"], r["found"]): r for r in prewarms_beside(logs, {})}
    assert rows["release", "nothing"]["measured"] == 1 and rows["release", "nothing"]["runs"] == 1
    assert rows["release", "part of the prefix"]["measured"] == 0
    assert math.isnan(rows["hold", "nothing"]["measured"])  # no hold run logged
    assert rows["hold", "the prefix or more"]["simulated"] == 24
    assert rows["hold", "nothing"]["simulated"] == rows["hold", "part of the prefix"][
        "simulated"] == 0
    # a pre-warm is skipped where its engine has a queue (the worker's activity skips it)
    assert 22 <= sum(rows["release", f]["simulated"] for f in
                     ("nothing", "part of the prefix", "the prefix or more")) <= 24


def test_an_approvals_lateness_is_timed_against_the_plan() -> None:
    """The view's pre-warm against the plan's view time, the decision's against its
    decision time, each from its step's end; a group without an approval or its
    pre-warms gives nothing."""
    from bench.sim_fidelity import approval_lateness

    plan = scenarios.pauses_jobs()[0]
    k = next(i for i, st in enumerate(plan.steps) if st.approval)
    st = plan.steps[k]
    assert st.viewed_after_s is not None
    step = k + 1
    calls = [("r", "p000", step, 100.0 + st.pause_s + 1.5),  # out of order: sorted
             ("r", "p000", step, 100.0),
             ("r", "p000", step, 100.0 + st.viewed_after_s + 0.5),
             ("r", "p001", 1, 10.0),  # a support job's step: no approval
             ("other-run", "p000", step, 50.0)]  # a step whose pre-warms were not logged
    assert approval_lateness(calls) == [pytest.approx(0.5), pytest.approx(1.5)]


def test_the_simulators_calls_are_timed_as_the_workers_log_them() -> None:
    """``Fleet.call_times``: a pre-warm numbered by the step before it, ending after it,
    so the simulator's approvals are timed by the same reading as the logs; with the
    lateness off they come within the simulator's own stages of the plan's times, with
    it on as late as drawn."""
    from bench.sim_fidelity import approval_lateness

    def lateness(notice: tuple[float, float]) -> list[float]:
        fleets: dict[str, Any] = {}

        def keep(policy: str, fleet: Any) -> None:
            fleet.call_times = []
            fleets[policy] = fleet

        scenarios.bench_pauses(approval_notice_s=notice, on_fleet=keep)
        return approval_lateness(("release", *c) for c in fleets["release"].call_times)

    on_time = lateness((0.0, 0.0))
    assert len(on_time) == 24 and all(0 < x < 0.3 for x in on_time)
    late = lateness((1.0, 1.0))
    assert all(1.0 < x < 1.3 for x in late)


def test_the_reviewers_lateness_is_fitted_to_the_logged_quartiles(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--pauses-logs``: the logged approvals' lateness, its quartiles, and a uniform
    range that, with the simulator's own stages added, has the same quartiles."""
    import bench.sim_fidelity
    from bench.sim_fidelity import lateness_beside

    monkeypatch.setattr(bench.sim_fidelity, "PAUSES_PHASES", 2)  # the simulated side: brief

    plan = scenarios.pauses_jobs()[0]
    k = next(i for i, st in enumerate(plan.steps) if st.approval)
    st = plan.steps[k]
    assert st.viewed_after_s is not None
    lines = []
    for run, late in enumerate((0.5, 1.0, 1.5, 2.0, 2.5)):
        job = f"pauses-release-r{run}-000"
        lines += [_call(job, k + 1, "10.000", 0),
                  _call(job, k + 1, f"{10 + st.viewed_after_s + late:06.3f}", 0),
                  _call(job, k + 1, f"{10 + st.pause_s + late:06.3f}", 0)]
    logs = tmp_path / "logs"
    logs.mkdir()
    (logs / "inference-worker-e0.log").write_text("\n".join(lines) + "\n")
    got = lateness_beside(logs, {})
    assert got["measured"]["n"] == 10
    q1, median, q3 = got["measured"]["quartiles_s"]
    assert median == pytest.approx(1.5) and q1 < median < q3
    own = sum(got["simulated, no lateness"]["quartiles_s"]) / 3
    low, high = got["fitted_notice_s"]
    assert low + own + (high - low) / 4 == pytest.approx(q1, abs=0.01)
    assert low + own + 3 * (high - low) / 4 == pytest.approx(q3, abs=0.01)
    assert got["simulated"]["n"] > 0
