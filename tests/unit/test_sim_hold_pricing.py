"""The simulated hold model prices re-prefill by what the workers' would: the engines'
``warmloop calibrate`` figures (measured alone), not the curves the simulated engines
run at under the bench's load."""

from __future__ import annotations

import dataclasses

import pytest

from warmloop.sim import scenarios
from warmloop.sim.core import Clock
from warmloop.sim.fleet import Fleet
from warmloop.sim.run import simulate
from warmloop.workflows import holding
from warmloop.workflows.holding import CostModel, HoldChoice, HoldConfig, PauseDistribution

MEASURED = {"e1": {"prefill_tokens_per_s": {"2048": 63_000, "128": 105_000, "512": 66_000}},
            "e0": {"prefill_tokens_per_s": {"128": 61_000, "2048": 50_000, "512": 66_000},
                   "source": "measured e0"}}


def test_measured_pricing_keeps_the_engines_order_and_their_rates() -> None:
    e0, e1 = scenarios.measured_pricing(MEASURED)
    assert [p.prompt_tokens for p in e0.prefill] == [128, 512, 2048]
    assert e0.prefill_tokens_per_s(2048) == pytest.approx(50_000)
    assert e1.prefill_tokens_per_s(128) == pytest.approx(105_000)
    assert e0.kv_pool_tokens == scenarios.CPU_TINY.with_kv_pool_bytes(
        16 * scenarios.MIB).kv_pool_tokens
    assert "measured e0" in e0.source


def test_a_fleet_told_one_pricing_per_engine_or_none() -> None:
    cfg = dataclasses.replace(scenarios.CPU_FLEET,
                              hold_pricing=scenarios.measured_pricing(MEASURED)[:1])
    with pytest.raises(ValueError, match="one per engine"):
        Fleet(Clock(), scenarios.cpu_engines(16 * scenarios.MIB), scenarios.PAUSES_POLICIES[
            "warmloop"], cfg)


def test_warmloops_holds_are_priced_by_the_measured_calibration() -> None:
    pricing = scenarios.measured_pricing(MEASURED)
    seen: list[tuple[int, float]] = []
    real = holding.decide_hold

    def spy(costs: CostModel, pauses: PauseDistribution) -> HoldChoice:
        assert isinstance(costs, holding.HoldCosts)
        seen.append((costs.prefix_tokens, costs.prefill_s_per_token))
        return real(costs, pauses)

    mp = pytest.MonkeyPatch()
    mp.setattr(holding, "decide_hold", spy)
    try:
        simulate(scenarios.pauses_jobs(n_jobs=4), scenarios.cpu_engines(16 * scenarios.MIB),
                 scenarios.PAUSES_POLICIES["warmloop"],
                 config=dataclasses.replace(scenarios.CPU_FLEET, hold_pricing=pricing))
    finally:
        mp.undo()
    assert seen
    loaded = scenarios.CPU_TINY_LOADED
    for tokens, s_per_token in seen:
        assert any(s_per_token == pytest.approx(c.prefill_s_per_token(tokens))
                   for c in pricing)
        # the loaded curve, which the simulated engines run at, is about half as fast
        assert s_per_token < 0.7 * loaded.prefill_s_per_token(tokens)


def test_a_hold_past_the_cap_cuts_the_oldest_short_and_stays_under_it() -> None:
    """With ``cut_for_room``, as the workers' ``HoldManager._make_room``: the oldest hold
    gives up its tail where that is room enough (bench-pauses' always-hold run does so),
    and the held blocks never pass the cap."""
    trims: list[bool] = []
    over: list[int] = []
    real_trim, real_pin = Fleet._trim, Fleet._pin

    def trim(self: Fleet, hold: object, excess: int) -> bool:
        before = len(hold.keys)  # type: ignore[attr-defined]
        ok = real_trim(self, hold, excess)  # type: ignore[arg-type]
        trims.append(ok)
        if ok:
            assert len(hold.keys) == before - excess >= 1  # type: ignore[attr-defined]
        return ok

    def pin(self: Fleet, job: object, engine: object, ttl_s: float) -> None:
        real_pin(self, job, engine, ttl_s)  # type: ignore[arg-type]
        cap = self.hold_cfg.max_held_fraction * engine.cal.kv_pool_tokens  # type: ignore[attr-defined]
        held = self.held[engine.engine_id].blocks * engine.block  # type: ignore[attr-defined]
        if held > cap:
            over.append(held)

    mp = pytest.MonkeyPatch()
    mp.setattr(Fleet, "_trim", trim)
    mp.setattr(Fleet, "_pin", pin)
    try:
        simulate(scenarios.pauses_jobs(), scenarios.cpu_engines(16 * scenarios.MIB),
                 scenarios.PAUSES_POLICIES["hold"],
                 config=dataclasses.replace(scenarios.CPU_FLEET,
                                            hold=HoldConfig(cut_for_room=True)))
    finally:
        mp.undo()
    assert True in trims and over == []
