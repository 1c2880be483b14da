"""bench-fleet over several seeds: medians per configuration, and warmloop's ratios paired
seed by seed (the run's closing JSON)."""

from __future__ import annotations

from typing import Any

import pytest

from bench.fleet import main, medians, spread


def _row(policy: str, seed: int, jobs: float, *, gpus: int = 128, ttft: float = 50.0,
         burst: bool = False) -> dict[str, Any]:
    return {"gpus": gpus, "load": 0.8, "burst": burst, "policy": policy, "horizon_s": 60.0,
            "seed": seed, "jobs_per_gpu_hour": jobs, "ttft_p99_ms": ttft, "hit_rate": 0.9,
            "cost_p50_usd": 1e-4, "cost_p95_usd": 2e-4, "completed": int(jobs), "jobs": 100}


def test_medians_take_each_figure_over_the_seeds_of_one_configuration() -> None:
    rows = [_row("warmloop", 1, 100.0), _row("warmloop", 2, 130.0), _row("warmloop", 3, 90.0),
            _row("warmloop", 1, 7.0, gpus=8)]
    med = medians(rows)
    assert [(r["gpus"], r["seeds"], r["jobs_per_gpu_hour"]) for r in med] == \
        [(128, 3, 100.0), (8, 1, 7.0)]
    assert all("seed" not in r for r in med)


def test_ratios_pair_each_seed_with_its_own_workload() -> None:
    # seed 1 is a busy workload for both policies, seed 2 a quiet one: paired, warmloop is
    # ahead 10 % and behind 10 %; compared across seeds it would look 0.82-1.36x
    rows = [_row("warmloop", 1, 1100.0), _row("round_robin_lru", 1, 1000.0),
            _row("warmloop", 2, 810.0), _row("round_robin_lru", 2, 900.0),
            _row("warmloop", 1, 5.0, burst=True), _row("round_robin_lru", 1, 1.0, burst=True)]
    sp = spread(rows)
    assert sp["seeds"] == [1, 2]
    assert sp["ratios"]["warmloop_over_round_robin_lru"] == {"median": 1.0, "range": [0.9, 1.1]}
    assert "warmloop_over_cache_aware_no_holds" not in sp["ratios"]  # not run
    assert sp["ranges"]["jobs_per_gpu_hour"]["warmloop"] == [810.0, 1100.0]


def test_no_seeds_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--seeds", "0", "--gpus", "8"])


def test_settle_counts_the_jobs_that_end_after_it_per_gpu_hour_of_the_rest() -> None:
    """``--settle F``: jobs per GPU-hour is the jobs that ended after F of the horizon
    over the GPU-hours after it; none ends in a fleet's first instants, so the count
    falls by fewer jobs than the window's hours do."""
    import bench.fleet as bench_fleet
    from warmloop.workflows.calibration import preset

    cal = preset("h100-llama-3.1-8b-bf16")
    whole, _, _, ended = bench_fleet.one(2, 0.8, "warmloop", cal, 30.0, False)
    assert ended == whole.completed > 0
    same, _, _, late = bench_fleet.one(2, 0.8, "warmloop", cal, 30.0, False, settle_s=15.0)
    assert same == whole  # the run itself is the same; only the count differs
    assert 0 < late < ended
    rate = bench_fleet.figures(same, 2, 30.0, settle_s=15.0, ended=late)
    assert rate["jobs_per_gpu_hour"] == round(late / (2 * 15.0 / 3600), 1)
    assert rate["settle_s"] == 15.0
    assert bench_fleet.figures(whole, 2, 30.0)["jobs_per_gpu_hour"] == \
        round(ended / (2 * 30.0 / 3600), 1)


@pytest.mark.parametrize("settle", ["1", "-0.1"])
def test_a_settle_outside_the_horizon_is_refused(settle: str) -> None:
    with pytest.raises(SystemExit):
        main(["--settle", settle, "--gpus", "8"])


def test_warmloops_variants_run_with_one_part_off_and_are_compared_seed_by_seed() -> None:
    """``--policies warmloop_no_holds ...`` (``bench.fleet.VARIANTS``): warmloop with a
    part off runs the same workload, and warmloop's ratio over it is reported."""
    import bench.fleet as bench_fleet
    from warmloop.workflows.calibration import preset

    cal = preset("h100-llama-3.1-8b-bf16")
    full = bench_fleet.one(2, 0.8, "warmloop", cal, 20.0, False)[0]
    no_holds = bench_fleet.one(2, 0.8, "warmloop_no_holds", cal, 20.0, False)[0]
    assert full.hold_decisions.get("hold", 0) > 0 and no_holds.hold_decisions == {}
    assert no_holds.policy == "warmloop_no_holds" and no_holds.jobs == full.jobs
    sp = spread([_row("warmloop", 1, 110.0), _row("warmloop_no_prewarm", 1, 100.0)])
    assert sp["ratios"]["warmloop_over_warmloop_no_prewarm"]["median"] == 1.1
