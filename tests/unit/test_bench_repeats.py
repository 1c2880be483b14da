"""The benchmarks' repeat folding: medians and ranges of every figure, so a verdict
rests on more than one run."""

from __future__ import annotations

from bench.common import fmt_range, medians_and_ranges, overlaps, rotated


def test_numbers_fold_to_their_median_and_range_key_by_key() -> None:
    runs = [
        {"hit_rate": {"warmloop": 0.85, "peer": 0.86}, "overhead_p50_ms": 9.0,
         "states": {"warmloop": {"FINISHED": 40}}, "workload": "scripted"},
        {"hit_rate": {"warmloop": 0.89, "peer": 0.85}, "overhead_p50_ms": 7.0,
         "states": {"warmloop": {"FINISHED": 39}}, "workload": "scripted"},
        {"hit_rate": {"warmloop": 0.88, "peer": 0.84}, "overhead_p50_ms": 12.0,
         "states": {"warmloop": {"FINISHED": 40}}, "workload": "scripted"},
    ]
    medians, ranges = medians_and_ranges(runs)
    assert medians["hit_rate"] == {"warmloop": 0.88, "peer": 0.85}
    assert ranges["hit_rate"] == {"warmloop": [0.85, 0.89], "peer": [0.84, 0.86]}
    assert medians["overhead_p50_ms"] == 9.0 and ranges["overhead_p50_ms"] == [7.0, 12.0]
    # what is not a number is kept from the last repeat, with no range
    assert medians["workload"] == "scripted" and "workload" not in ranges


def test_a_figure_missing_from_a_repeat_folds_over_the_others_and_none_stays_none() -> None:
    medians, ranges = medians_and_ranges([{"a": 1.0, "b": None}, {"b": None}, {"a": 3.0}])
    assert medians == {"a": 2.0, "b": None} and ranges == {"a": [1.0, 3.0]}


def test_policy_order_rotates_each_repeat() -> None:
    policies = ["warmloop", "round_robin", "least_loaded", "peer"]
    firsts = [rotated(policies, r)[0] for r in range(4)]
    assert firsts == policies
    assert all(sorted(rotated(policies, r)) == sorted(policies) for r in range(6))


def test_ranges_format_and_overlap() -> None:
    assert fmt_range(0.887, [0.852, 0.901]) == "0.887 [0.852–0.901]"
    assert fmt_range(0.887, [0.887, 0.887]) == "0.887"
    assert overlaps([0.85, 0.89], [0.84, 0.86]) is True
    assert overlaps([0.88, 0.90], [0.84, 0.86]) is False
    assert overlaps(None, [0.1, 0.2]) is None
