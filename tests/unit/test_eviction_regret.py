"""A hold's rent measured from the engine's evictions (``EvictionRegret``): blocks the
engine evicted and computed again, counted for as much room as would have kept them;
what the KV event applier and the hold manager make of it. The real engine's events are
in tests/integration/test_holds.py."""

from __future__ import annotations

import random
from typing import Any

import pytest

from tests.unit.test_holds import StubPauses, manager
from warmloop.activities.directory import KvEventApplier
from warmloop.sim.core import Clock
from warmloop.sim.fleet import POLICIES, Fleet, FleetConfig
from warmloop.workflows.calibration import preset
from warmloop.workflows.holding import (
    EvictionRegret,
    HoldAction,
    HoldConfig,
    HoldCosts,
    PauseDistribution,
    decide_hold,
    displaced_on_curve,
)
from warmloop.workflows.profiles import get_profile

LOOKUPS = PauseDistribution(samples=(3.0,) * 18 + (45.0,) * 2, prior_median_s=3,
                            prior_p90_s=8)
"""bench-pauses' lookups: short, and one in ten outlasts the rest many times over."""


def cpu_engine(*, displaced: float | None, kv_usage: float = 0.2) -> HoldCosts:
    # one CPU bench engine: an 8,192-token pool, a 1,700-token prompt, 20 us a token
    return HoldCosts(prefix_tokens=1_700, kv_capacity_tokens=8_192, kv_usage=kv_usage,
                     prefill_s_per_token=20e-6, gpu_usd_per_s=0.8 / 3600,
                     latency_usd_per_s=0.01, displaced_tokens_per_s=displaced)


def test_churn_of_fresh_prompts_regrets_nothing_so_holding_through_the_tail_is_free() -> None:
    r = EvictionRegret(min_span_s=30)
    for t in range(60):  # a pool turned over by prompts that never come back
        r.stored([f"fresh-{t}-{i}" for i in range(8)], 16, now=float(t))
        r.evicted([f"fresh-{t - 1}-{i}" for i in range(8)], 16, now=float(t))
    assert r.regretted == 0 and r.displaced_tokens_per_s(1_700, now=60.0) == 0.0
    held = decide_hold(cpu_engine(displaced=0.0), LOOKUPS)
    assert held.action == HoldAction.HOLD and held.ttl_s >= 45
    # the contention model prices the same room as if every block were reused by
    # someone: it lets the long pauses go (what always-hold beat it by)
    modelled = decide_hold(cpu_engine(displaced=None), LOOKUPS)
    assert modelled.action == HoldAction.RELEASE or modelled.ttl_s < 45


def test_a_recompute_counts_for_the_room_that_would_have_kept_it() -> None:
    r = EvictionRegret(min_span_s=10)
    r.evicted(["a"], 16, now=0.0)
    r.evicted([f"b{i}" for i in range(10)], 16, now=1.0)  # 160 tokens evicted after it
    r.stored(["a"], 16, now=20.0)  # "a" again: a pool 176 tokens larger had kept it
    assert r.regretted == 1
    assert r.displaced_tokens_per_s(175, now=20.0) == 0.0
    assert r.displaced_tokens_per_s(176, now=20.0) == pytest.approx(16 / 20)
    r.stored(["a"], 16, now=21.0)  # cached now, not a ghost: stored twice is one regret
    assert r.regretted == 1


def test_recomputes_that_cost_others_much_make_holding_dear() -> None:
    # a pool where what is evicted is needed again at once: each held token displaces
    # others' reuse, and a short tool pause is no longer worth 1,700 tokens of room
    dear = decide_hold(cpu_engine(displaced=5_000.0), LOOKUPS)
    cheap = decide_hold(cpu_engine(displaced=0.0), LOOKUPS)
    assert dear.action == HoldAction.RELEASE or dear.ttl_s < cheap.ttl_s


def test_no_measure_before_the_minimum_span_and_old_recomputes_age_out() -> None:
    r = EvictionRegret(horizon_s=100, min_span_s=30, stale_s=500)
    assert r.displaced_tokens_per_s(1_000, now=0.0) is None  # nothing seen at all
    r.evicted(["a"], 16, now=0.0)
    r.stored(["a"], 16, now=5.0)
    assert r.displaced_tokens_per_s(1_000, now=29.0) is None
    assert r.displaced_tokens_per_s(1_000, now=50.0) == pytest.approx(16 / 50)
    assert r.displaced_tokens_per_s(1_000, now=200.0) == 0.0  # past the horizon


def test_the_ghost_list_is_bounded_oldest_first() -> None:
    r = EvictionRegret(max_ghosts=4, min_span_s=1)
    r.evicted([f"g{i}" for i in range(6)], 16, now=0.0)
    r.stored(["g0", "g1"], 16, now=1.0)  # forgotten: too old to be worth remembering
    assert r.regretted == 0
    r.stored(["g5"], 16, now=1.0)
    assert r.regretted == 1


@pytest.mark.parametrize("kwargs", [{"min_span_s": 0}, {"horizon_s": 10, "min_span_s": 20},
                                    {"stale_s": 0}, {"max_regrets": 0},
                                    {"max_ghosts": 0}])
def test_a_config_that_cannot_measure_is_refused(kwargs: dict[str, Any]) -> None:
    with pytest.raises(ValueError, match="EvictionRegret"):
        EvictionRegret(**kwargs)


class _Dir:
    async def store_blocks(self, engine_id: str, hashes: Any, now: float) -> None:
        pass

    async def remove_blocks(self, engine_id: str, hashes: Any) -> None:
        pass

    async def clear_engine(self, engine_id: str) -> None:
        pass


async def test_the_kv_event_applier_tells_the_regret_what_the_engine_evicts_and_stores(
) -> None:
    t = [0.0]
    r = EvictionRegret(min_span_s=1)
    applier = KvEventApplier(_Dir(), "e0", regret=r, clock=lambda: t[0])  # type: ignore[arg-type]
    prompt = {"type": "BlockStored", "block_hashes": [b"v1", b"v2"], "parent_block_hash": None,
              "token_ids": list(range(256)), "block_size": 128, "medium": "GPU"}
    await applier.apply([prompt])
    t[0] = 1.0
    await applier.apply([{"type": "BlockRemoved", "block_hashes": [b"v2"]},
                         {"type": "BlockRemoved", "block_hashes": [b"unknown"]}])
    assert r.regretted == 0
    t[0] = 4.0
    # the same prompt again: its first block was still cached (vLLM sends only the
    # recomputed one, under a new engine hash), its second had been evicted
    await applier.apply([{"type": "BlockStored", "block_hashes": [b"v2b"],
                          "parent_block_hash": b"v1", "token_ids": list(range(128, 256)),
                          "block_size": 128, "medium": "GPU"}])
    assert r.regretted == 1
    assert r.displaced_tokens_per_s(128, now=4.0) == pytest.approx(128 / 4)


async def test_the_hold_manager_prices_rent_by_the_regret_and_counts_it() -> None:
    touches: list[dict[str, Any]] = []
    m, redis, clock = manager(StubPauses(3.0, 30.0), touches, kv_usage=0.2, capacity=8_192)
    m.regret = r = EvictionRegret(min_span_s=1)
    triage = get_profile("ticket-triage")
    kind = "tool:search_kb"
    r.evicted(["x"], 128, now=clock.t)
    clock.t += 10
    r.stored(["fresh"], 128, now=clock.t)  # fresh churn only: room costs nothing
    free = await m.after_step(job_id="j1", profile=triage, kind=kind,
                              prefix_tokens=list(range(1_700)), policy="cost_model",
                              interactive=True)
    costs = m.costs(1_700, interactive=True)
    assert isinstance(costs, HoldCosts) and costs.displaced_tokens_per_s == 0.0
    assert free is not None and free.action == HoldAction.HOLD
    m.resume("j1")
    # now everything evicted comes straight back: room is dear
    for i in range(200):
        r.evicted([f"hot{i}"], 128, now=clock.t)
        r.stored([f"hot{i}"], 128, now=clock.t)
    dear = await m.after_step(job_id="j2", profile=triage, kind=kind,
                              prefix_tokens=list(range(1_700)), policy="cost_model",
                              interactive=True)
    assert dear is not None
    assert dear.action == HoldAction.RELEASE or dear.ttl_s < free.ttl_s
    await m.tick()
    assert redis.hashes["warmloop:holds:stats:e0"]["regretted_blocks"] == 200


def test_the_curve_a_heartbeat_carries_reads_as_the_regret_does() -> None:
    r = EvictionRegret(min_span_s=10)
    assert r.curve(now=0.0) is None
    r.evicted([f"a{i}" for i in range(40)], 16, now=0.0)  # 640 tokens, oldest first
    r.stored(["a0", "a39"], 16, now=20.0)  # a0 at 640 tokens' distance, a39 at 16
    curve = r.curve(now=20.0)
    assert curve == [(256, 16 / 20), (512, 16 / 20), (1024, 32 / 20)]
    for room in (16, 300, 640, 2_000):
        # rounded up to the next point: at least what the regret itself says
        exact = r.displaced_tokens_per_s(room, now=20.0)
        assert exact is not None and displaced_on_curve(curve, room) >= exact
    assert displaced_on_curve(curve, 100) == 16 / 20
    assert displaced_on_curve(curve, 5_000) == 32 / 20 and displaced_on_curve([], 5) == 0


async def test_a_holder_without_the_events_prices_rent_by_the_engines_heartbeat() -> None:
    # the gateway: no regret of its own, the inference worker's curve in the heartbeat
    m, _, _ = manager(StubPauses(3.0, 30.0), [], kv_usage=0.2, capacity=8_192)
    assert m.regret is None
    modelled = m.costs(1_700, interactive=True)
    assert isinstance(modelled, HoldCosts) and modelled.displaced_tokens_per_s is None
    hb = m._info()
    assert hb is not None
    hb.room_regret = [(256, 0.0), (512, 0.0), (1024, 0.0), (2048, 3.5)]
    priced = m.costs(1_700, interactive=True)
    assert isinstance(priced, HoldCosts) and priced.displaced_tokens_per_s == 3.5


def test_events_that_stop_leave_no_measure_rather_than_free_room() -> None:
    # a KV event publisher that died must not read as a pool where nothing comes back
    r = EvictionRegret(min_span_s=10, stale_s=60)
    r.evicted(["a"], 16, now=0.0)
    r.stored(["b"], 16, now=20.0)
    assert r.displaced_tokens_per_s(1_000, now=30.0) == 0.0
    assert r.displaced_tokens_per_s(1_000, now=81.0) is None and r.curve(now=81.0) is None
    r.stored(["c"], 16, now=90.0)  # events again: measuring again
    assert r.displaced_tokens_per_s(1_000, now=90.0) == 0.0


def test_rent_by_the_model_ignores_the_measure_in_the_worker_and_the_simulator() -> None:
    m, _, _ = manager(StubPauses(3.0, 30.0), [], kv_usage=0.2, capacity=8_192)
    m.regret = r = EvictionRegret(min_span_s=1)
    r.evicted(["x"], 128, now=0.0)
    r.stored(["y"], 128, now=1_000.0)
    measured = m.costs(1_700, interactive=True)
    assert isinstance(measured, HoldCosts) and measured.displaced_tokens_per_s == 0.0
    m.config = HoldConfig(rent="model")
    modelled = m.costs(1_700, interactive=True)
    assert isinstance(modelled, HoldCosts) and modelled.displaced_tokens_per_s is None
    cal = preset("cpu-tiny")
    for rent, follows in (("measured", True), ("model", False)):
        fleet = Fleet(Clock(), [cal], POLICIES["warmloop"],
                      FleetConfig(hold=HoldConfig(rent=rent)))  # type: ignore[arg-type]
        assert (fleet.engines[0].regret is not None) is follows
    assert Fleet(Clock(), [cal], POLICIES["cache_aware_no_holds"]).engines[0].regret is None


def test_the_one_pass_curve_agrees_with_the_regret_at_each_room() -> None:
    rng = random.Random(3)
    r = EvictionRegret(min_span_s=1)
    for t in range(200):
        r.evicted([f"b{t}-{i}" for i in range(rng.randrange(1, 40))], 16, now=float(t))
        back = [f"b{u}-{i}" for u in range(max(0, t - 50), t) for i in range(3)
                if rng.random() < 0.05]
        r.stored(back, 16, now=float(t) + 0.5)
    curve = r.curve(now=200.0)
    assert curve is not None and len(curve) > 3 and r.regretted > 50
    for room, rate in curve:
        exact = r.displaced_tokens_per_s(room, now=200.0)
        assert exact is not None and rate == pytest.approx(exact, abs=1e-3)


def test_recomputes_beyond_the_bound_are_read_over_the_span_they_cover() -> None:
    r = EvictionRegret(min_span_s=1, max_regrets=10)
    for t in range(100):  # one recompute a second, at distance 16
        r.evicted([f"x{t}"], 16, now=float(t))
        r.stored([f"x{t}"], 16, now=float(t))
    assert len(r._regrets) == 10
    # the last ten cover the span since the one dropped before them: still 16 a second
    assert r.displaced_tokens_per_s(16, now=99.0) == pytest.approx(16 * 10 / 10)


def test_a_batch_over_the_bound_at_one_instant_claims_no_rate_over_no_time() -> None:
    # One batch of KV events shares one clock reading: 12 recomputes at t=50 over a bound
    # of 10 dropped two made at 50, and the ten kept were read over 1e-9 s (a rate of
    # ~1e11 tokens a second). Those made at the floor's instant go with it.
    r = EvictionRegret(min_span_s=1, max_regrets=10)
    r.evicted(["old"], 16, now=0.0)
    r.stored(["old"], 16, now=1.0)
    r.evicted([f"x{i}" for i in range(12)], 16, now=40.0)
    r.stored([f"x{i}" for i in range(12)], 16, now=50.0)
    rate = r.displaced_tokens_per_s(1 << 20, now=50.0)
    assert rate is not None and rate < 1_000
