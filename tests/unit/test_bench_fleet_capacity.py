"""bench-fleet's offered load: a share of what the fleet can do at saturation."""

from __future__ import annotations

from bench.fleet import capacity_jobs_per_s, saturation_batch
from warmloop.sim.workload import WORKLOADS
from warmloop.workflows.calibration import preset


def test_a_saturated_engine_decodes_its_largest_batch_its_pool_holds() -> None:
    bundled, agentic = WORKLOADS["bundled"](), WORKLOADS["agentic"]()
    h200, h100 = preset("h200-llama-3.1-8b-bf16"), preset("h100-llama-3.1-8b-bf16")
    assert saturation_batch(bundled, h200) == h200.max_batch  # 866k tokens hold 256 steps
    assert saturation_batch(bundled, h100) < h100.max_batch  # 396k tokens do not
    # the agentic mix's long contexts fill the pool sooner
    assert saturation_batch(agentic, h200) < saturation_batch(bundled, h200)


def test_capacity_prices_decode_at_the_saturation_batch_not_the_reference_one() -> None:
    mix, cal = WORKLOADS["bundled"](), preset("h200-llama-3.1-8b-bf16")
    one = capacity_jobs_per_s(mix, cal, 1)
    assert capacity_jobs_per_s(mix, cal, 8) == 8 * one
    # decode of a saturated batch costs a third of batch 32's a token: more jobs fit
    at_reference = cal.model_copy(update={"max_batch": cal.reference_batch})
    assert saturation_batch(mix, at_reference) == cal.reference_batch
    assert one > 1.5 * capacity_jobs_per_s(mix, at_reference, 1)


def test_hold_settings_reach_the_simulated_fleet() -> None:
    """``--holding`` (a HoldConfig as JSON): the runs' fleets hold by it, over each
    engine's calibrated prices; a bad setting is refused before any run."""
    import pytest

    from bench.fleet import main, one
    from warmloop.workflows.calibration import preset
    from warmloop.workflows.holding import HoldConfig

    cal = preset("h100-llama-3.1-8b-bf16")
    base = one(2, 0.8, "warmloop", cal, 20.0, False)[0]
    no_room = one(2, 0.8, "warmloop", cal, 20.0, False,
                holding=HoldConfig(max_held_fraction=0.001))[0]
    assert base.hold_decisions.get("hold", 0) > 0
    # a cap with no room: every hold let go at once, so more is recomputed after pauses
    assert no_room.post_pause_recomputed > base.post_pause_recomputed
    with pytest.raises(Exception, match="max_held_fraction"):
        main(["--holding", '{"max_held_fraction": 2}', "--gpus", "2"])


def test_runs_of_one_workload_share_its_jobs_and_figures() -> None:
    """A process's runs of the same fleet, load and horizon reuse the jobs it built
    (the policies' runs in turn), and a run on reused jobs gives the figures a run on
    fresh ones does: the simulator must not change the jobs it is given."""
    import bench.fleet as bench_fleet
    from warmloop.workflows.calibration import preset

    cal = preset("h100-llama-3.1-8b-bf16")
    bench_fleet._last_jobs = None
    fresh = bench_fleet.one(2, 0.8, "warmloop", cal, 20.0, True)[0]  # built, then run
    first = bench_fleet.workload_jobs(2, 0.8, cal, 20.0, True)
    again = bench_fleet.one(2, 0.8, "warmloop", cal, 20.0, True)[0]  # run again
    assert bench_fleet.workload_jobs(2, 0.8, cal, 20.0, True) is first
    assert again == fresh
    assert bench_fleet.workload_jobs(2, 0.9, cal, 20.0, True) is not first
