"""The hold/release cost model: obvious cases, and monotonicity as properties."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from warmloop.workflows.holding import (
    HoldAction,
    HoldCosts,
    ObservedPrefill,
    PauseDistribution,
    TtlCacheCosts,
    _best_hold,
    decide_hold,
    expected_hold_usd,
    keepalive_schedule,
)

TOOL = PauseDistribution(prior_median_s=3, prior_p90_s=8)          # a ~3 s tool call
APPROVAL = PauseDistribution(prior_median_s=2400, prior_p90_s=7200)  # ~40 min human


def costs(kv_usage: float, *, prefix: int = 2000, offload: float | None = None) -> HoldCosts:
    # an H100-class engine: $3/h, 20k prefill tokens/s, 1M-token KV pool, latency $0.01/s
    return HoldCosts(prefix_tokens=prefix, kv_capacity_tokens=1_000_000, kv_usage=kv_usage,
                     prefill_s_per_token=1 / 20_000, gpu_usd_per_s=3 / 3600,
                     latency_usd_per_s=0.01, offload_reload_s_per_token=offload)


def test_short_tool_at_low_pressure_holds_for_most_of_the_pauses() -> None:
    choice = decide_hold(costs(0.3), TOOL)
    assert choice.action == HoldAction.HOLD
    assert choice.ttl_s >= 8  # covers the p90 of the pause
    assert choice.expected_usd < choice.release_usd


def test_an_approval_that_takes_hours_releases() -> None:
    assert decide_hold(costs(0.3), APPROVAL).action == HoldAction.RELEASE


def test_high_pressure_releases_even_short_pauses_or_holds_briefly() -> None:
    low, high = decide_hold(costs(0.3), TOOL), decide_hold(costs(0.999), TOOL)
    assert high.action == HoldAction.RELEASE or high.ttl_s < low.ttl_s


def test_offload_wins_when_reloading_is_cheaper_than_both() -> None:
    choice = decide_hold(costs(0.95, offload=1 / 200_000), APPROVAL)
    assert choice.action == HoldAction.OFFLOAD


def test_samples_replace_the_prior_once_there_are_enough() -> None:
    slow = PauseDistribution(samples=(3600.0,) * 25, prior_median_s=2, prior_p90_s=4)
    assert decide_hold(costs(0.3), slow).action == HoldAction.RELEASE
    few = PauseDistribution(samples=(3600.0,) * 5, prior_median_s=2, prior_p90_s=4)
    assert decide_hold(costs(0.3), few).action == HoldAction.HOLD


def test_prior_must_be_ordered() -> None:
    with pytest.raises(ValueError, match="prior_p90_s"):
        PauseDistribution(prior_median_s=10, prior_p90_s=5)


@settings(max_examples=60, deadline=None)
@given(usage=st.floats(0.0, 0.99), bump=st.floats(0.0, 0.99),
       median=st.floats(0.5, 20_000), spread=st.floats(1.0, 10.0))
def test_more_pressure_never_turns_release_into_hold(usage: float, bump: float,
                                                     median: float, spread: float) -> None:
    pauses = PauseDistribution(prior_median_s=median, prior_p90_s=median * spread)
    higher = min(0.999, usage + bump * (1 - usage))
    before, after = decide_hold(costs(usage), pauses), decide_hold(costs(higher), pauses)
    if before.action == HoldAction.RELEASE:
        assert after.action == HoldAction.RELEASE
    if before.action == after.action == HoldAction.HOLD:
        assert after.ttl_s <= before.ttl_s  # dearer memory never buys a longer hold


@settings(max_examples=60, deadline=None)
@given(usage=st.floats(0.0, 0.99), median=st.floats(0.5, 20_000),
       spread=st.floats(1.0, 10.0), factor=st.floats(1.0, 100.0))
def test_longer_pauses_never_turn_release_into_hold(usage: float, median: float,
                                                    spread: float, factor: float) -> None:
    pauses = PauseDistribution(prior_median_s=median, prior_p90_s=median * spread)
    before = decide_hold(costs(usage), pauses)
    after = decide_hold(costs(usage), pauses.scaled(factor))
    if before.action == HoldAction.RELEASE:
        assert after.action == HoldAction.RELEASE


# ---- TTL-cache endpoints ---------------------------------------------------------------


def test_keepalive_pings_go_before_each_expiry_until_the_hold_ends() -> None:
    assert keepalive_schedule(cache_ttl_s=300, hold_for_s=1000, margin_s=5) == [295, 590, 885]
    assert keepalive_schedule(cache_ttl_s=300, hold_for_s=290) == []  # the cache outlives it
    assert keepalive_schedule(cache_ttl_s=300, hold_for_s=590, margin_s=5) == [295]
    with pytest.raises(ValueError, match="must exceed margin_s"):
        keepalive_schedule(cache_ttl_s=5, hold_for_s=100, margin_s=5)


def test_ttl_endpoint_pings_through_a_tool_call_but_not_through_an_approval() -> None:
    # list prices of a managed API: $3/M input, $0.30/M cached, $15/M output, 5 min TTL
    api = TtlCacheCosts(prefix_tokens=20_000, cache_ttl_s=300, input_usd_per_token=3e-6,
                        cached_input_usd_per_token=0.3e-6, output_usd_per_token=15e-6)
    assert decide_hold(api, TOOL).action == HoldAction.HOLD
    assert decide_hold(api, APPROVAL).action == HoldAction.RELEASE
    assert api.ping_usd() == pytest.approx(20_000 * 0.3e-6 + 15e-6)


def _best_hold_by_definition(c: HoldCosts, points: list[float]) -> tuple[float, float]:
    """The search as first written: ``expected_hold_usd`` over every candidate TTL."""
    best_ttl, best = 0.0, float("inf")
    for ttl in sorted(set(points)):
        cost = expected_hold_usd(c, points, ttl)
        if cost < best:
            best_ttl, best = ttl, cost
    return best_ttl, best


@settings(max_examples=300, deadline=None)
@given(samples=st.lists(st.floats(min_value=0.01, max_value=5_000), min_size=20,
                        max_size=120),
       repeats=st.integers(min_value=1, max_value=3),
       usage=st.floats(min_value=0.0, max_value=0.999),
       prefix=st.integers(min_value=1, max_value=200_000))
def test_the_one_sweep_search_chooses_what_the_definition_chooses(
        samples: list[float], repeats: int, usage: float, prefix: int) -> None:
    # repeated points (ties) are the case a running sum can get wrong
    dist = PauseDistribution(samples=tuple(samples * repeats), prior_median_s=3,
                             prior_p90_s=8)
    c = costs(usage, prefix=prefix)
    points = dist.points()
    ttl, cost = _best_hold(c, points, c.reprefill_usd())
    want_ttl, want = _best_hold_by_definition(c, points)
    assert cost == pytest.approx(want, rel=1e-9)
    if ttl != want_ttl:  # only a tie to rounding may choose differently
        assert expected_hold_usd(c, points, ttl) == pytest.approx(want, rel=1e-9)


def test_a_prewarm_is_worth_it_only_on_an_engine_without_a_queue() -> None:
    from warmloop.workflows.holding import prewarm_worthwhile
    assert prewarm_worthwhile(0)
    assert not prewarm_worthwhile(1)
    assert not prewarm_worthwhile(40)


# ---- the re-prefill price the engine's own steps show ----------------------------------


def test_observed_prefill_is_the_slope_not_the_ratio() -> None:
    """TTFT = 30 ms + 40 us a token: a ratio would put the fixed 30 ms on every token."""
    seen = ObservedPrefill(window=32, min_steps=8, min_spread_tokens=512)
    rng = random.Random(5)
    for _ in range(32):
        tokens = rng.randint(50, 1_800)
        seen.observe(tokens, 0.030 + 40e-6 * tokens + rng.uniform(-0.002, 0.002))
    got = seen.s_per_token()
    assert got is not None and got == pytest.approx(40e-6, rel=0.15)


def test_observed_prefill_waits_for_enough_different_steps() -> None:
    seen = ObservedPrefill(window=32, min_steps=8, min_spread_tokens=512)
    for _ in range(7):
        seen.observe(1_000, 0.08)
    assert seen.s_per_token() is None  # too few
    for _ in range(20):
        seen.observe(1_100, 0.09)
    assert seen.s_per_token() is None  # all about one length: no slope to read
    seen.observe(100, 0.02)
    assert seen.s_per_token() is not None


def test_observed_prefill_ignores_garbage_and_forgets_old_steps() -> None:
    seen = ObservedPrefill(window=8, min_steps=4, min_spread_tokens=100)
    for bad in ((-5, 0.1), (100, 0.0), (100, -1.0), (100, math.nan), (100, math.inf)):
        seen.observe(*bad)
    assert seen.s_per_token() is None
    for tokens in (100, 1_000) * 4:  # an old, slow regime ...
        seen.observe(tokens, 200e-6 * tokens)
    for tokens in (100, 1_000) * 4:  # ... replaced by the window's last 8 steps
        seen.observe(tokens, 20e-6 * tokens)
    assert seen.s_per_token() == pytest.approx(20e-6)
    # a slope that is not positive says nothing about re-prefill
    flat = ObservedPrefill(window=8, min_steps=4, min_spread_tokens=100)
    for tokens in (100, 1_000) * 4:
        flat.observe(tokens, 0.05)
    assert flat.s_per_token() is None


def test_observed_prefill_refuses_a_window_smaller_than_its_minimum() -> None:
    with pytest.raises(ValueError, match="min_steps"):
        ObservedPrefill(window=4, min_steps=8)
