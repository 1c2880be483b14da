"""bench-pauses sizes its background traffic by the churn it makes, so hosts of any
speed run the same cache regime while their engines can."""

from __future__ import annotations

import argparse

import pytest

from bench.pauses import bg_rate


def args(**kw: float | None) -> argparse.Namespace:
    base: dict[str, float | int | None] = {
        "bg_rate": None, "bg_utilization": None, "bg_pools_per_pause": 0.68,
        "bg_max_utilization": 0.5, "kv_cache_bytes": 16 * 1024 * 1024,
        "pause_median_s": 3.0}
    return argparse.Namespace(**{**base, **kw})


def test_the_rate_follows_the_pool_not_the_hosts_speed() -> None:
    # the reference host: 43 ms a request; an AVX2 host: 90 ms; the same rate for both
    fast, _ = bg_rate(args(), 0.043, 530)
    slow, how = bg_rate(args(), 0.090, 530)
    assert fast == slow == pytest.approx(0.68 * 8192 / 530 / 3.0)
    assert fast == pytest.approx(3.5, abs=0.05)  # what 15 % gave on the reference host
    assert "utilization 0.32" in how


def test_a_host_too_slow_for_the_regime_is_capped_and_told() -> None:
    rate, how = bg_rate(args(), 0.288, 530)  # bfloat16 emulated: 288 ms a request
    assert rate * 0.288 == pytest.approx(0.5)
    assert "capped" in how and "too slow" in how


def test_the_older_sizings_stay_available() -> None:
    assert bg_rate(args(bg_utilization=0.15), 0.05, 530)[0] == pytest.approx(3.0)
    assert bg_rate(args(bg_rate=2.0, bg_utilization=0.15), 0.05, 530)[0] == 2.0
