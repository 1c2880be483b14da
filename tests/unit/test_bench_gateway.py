"""bench-gateway's harness: the seeded workload, the block-level oracle, the figures and
the last line's keys (no stack: the run itself is `make bench-gateway`)."""

from __future__ import annotations

import argparse

import pytest

from bench.common import medians_and_ranges
from bench.gateway import (
    POLICIES,
    CallRecord,
    PolicyRun,
    estimate_makespan_s,
    gateway_metrics,
    oracle_hit_rate,
    policy_figures,
    result_json,
    served_bound,
    served_placement_bound,
    session_headers,
    steady_ramp_s,
    workload,
)
from warmloop.workflows.routing import block_hashes


def test_workload_is_seeded_and_session_i_does_not_depend_on_the_count() -> None:
    a, b = workload(3, 40), workload(3, 40)
    assert a == b
    assert workload(3, 10).sessions == a.sessions[:10]
    assert workload(4, 40).sessions != a.sessions


def test_workload_shape() -> None:
    w = workload(5, 400)
    hot, *others = w.kinds
    assert len(w.kinds) >= 3
    # one kind carries half the sessions
    assert 0.42 < sum(s.kind == hot for s in w.sessions) / len(w.sessions) < 0.58
    assert {s.kind for s in w.sessions} == set(w.kinds)
    pauses = [p for s in w.sessions for p in s.pauses_s]
    assert all(6 <= s.calls <= 10 and len(s.pauses_s) == s.calls - 1 for s in w.sessions)
    assert 0 < sum(p >= 20 for p in pauses) < 0.15 * len(pauses)  # a few long ones
    assert max(pauses) <= 60 and min(pauses) > 0
    for s in w.sessions[:20]:
        prompts = list(s.prompts())
        assert prompts[0][0] == {"role": "system", "content": w.kinds[s.kind].system}
        assert len(w.kinds[s.kind].system.split()) > 1000  # a long shared prefix
        for prev, cur in zip(prompts, prompts[1:], strict=False):
            # each call appends the assistant's tool call and the tool's result
            assert cur[:len(prev)] == prev
            assert [m["role"] for m in cur[len(prev):]] == ["assistant", "tool"]
            assert cur[-1]["tool_call_id"] == cur[-2]["tool_calls"][0]["id"]


def test_time_scale_scales_only_the_pauses() -> None:
    a, b = workload(9, 30), workload(9, 30, time_scale=0.1)
    assert [s.turns for s in a.sessions] == [s.turns for s in b.sessions]
    assert [p * 0.1 for s in a.sessions for p in s.pauses_s] == pytest.approx(
        [p for s in b.sessions for p in s.pauses_s])
    assert b.pause_s == pytest.approx(0.1 * a.pause_s)


def test_the_first_sessions_start_at_the_steady_state_gap() -> None:
    w = workload(2, 6)
    one = [sum(s.pauses_s) + s.calls * 0.5 for s in w.sessions]
    ramp = steady_ramp_s(w.sessions, 3, request_s=0.5)
    assert ramp == pytest.approx(sum(one) / 6 / 3)
    # one slot: sessions one after another; six: slot j opens j gaps late
    assert estimate_makespan_s(w.sessions, 1, ramp, request_s=0.5) == pytest.approx(sum(one))
    assert estimate_makespan_s(w.sessions, 6, 0.01, request_s=0.5) == pytest.approx(
        max(j * 0.01 + one[j] for j in range(6)))
    assert estimate_makespan_s(w.sessions, 6, request_s=0.5) == pytest.approx(max(one))


def test_gateway_metrics_are_read_from_its_exposition_text() -> None:
    text = "\n".join([
        "# TYPE warmloop_gateway_hold_decisions_total counter",
        'warmloop_gateway_hold_decisions_total{action="hold"} 12',
        'warmloop_gateway_hold_decisions_total{action="release"} 3',
        "warmloop_gateway_learn_skipped_total 1",
        'warmloop_gateway_failovers_total{engine="e1"} 2',
        'warmloop_gateway_added_latency_seconds_bucket{le="0.0005"} 1',
        'warmloop_gateway_added_latency_seconds_bucket{le="0.001"} 8',
        'warmloop_gateway_added_latency_seconds_bucket{le="+Inf"} 10',
        "warmloop_gateway_added_latency_seconds_sum 0.012",
        "warmloop_gateway_added_latency_seconds_count 10"])
    g = gateway_metrics(text)
    assert g["hold_decisions"] == {"hold": 12.0, "release": 3.0}
    assert g["learn_skipped"] == 1.0 and g["failovers"] == 2.0
    assert g["own_added_mean_ms"] == pytest.approx(1.2)
    assert g["own_added_p50_ms"] == pytest.approx(1.0)


def test_final_header_only_on_the_last_call() -> None:
    assert session_headers("s1", "support", final=False) == {
        "x-session-id": "s1", "x-session-kind": "support"}
    assert session_headers("s1", "support", final=True)["x-session-final"] == "true"


def test_oracle_counts_each_full_block_once_and_partial_blocks_every_time() -> None:
    # block 2: [1,2][3,4]+5 and [1,2][3,4][6,7]: 3 unique blocks (6 tokens) + 1 partial
    assert oracle_hit_rate([[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 7]], 2) == pytest.approx(
        1 - 7 / 11)
    # the same tokens after a different first block are other blocks (hash chains)
    assert oracle_hit_rate([[1, 2, 3, 4], [9, 9, 3, 4]], 2) == 0.0
    assert oracle_hit_rate([[1, 2]] * 4, 2) == pytest.approx(0.75)
    assert oracle_hit_rate([], 16) == 0.0


def test_the_bound_follows_the_order_the_run_sent_the_prompts() -> None:
    w = workload(3, 2)
    calls = [(s.index, k) for s in w.sessions for k in range(s.calls)]
    # block 2; session 0's calls share [1,2], session 1's share [5,6], all distinct after
    prompts = [[1, 2, 10 + i] if s == w.sessions[0].index else [5, 6, 10 + i]
               for i, (s, _) in enumerate(calls)]
    total = sum(map(len, prompts))
    chains = [{"tokens": len(p), "hashes": block_hashes(p, 2)} for p in prompts]

    def sent(order: list[tuple[int, int]]) -> list[CallRecord]:
        return [CallRecord(session=s, call=k, sent=float(t)) for t, (s, k) in enumerate(order)]

    # a one-block pool: session by session, each shared block misses once
    one_by_one = served_bound(w, chains, sent(calls), 2, 1)
    assert one_by_one == pytest.approx(2 * (len(calls) - 2) / total)
    # interleaved, the pool can still keep one of the two families between its uses
    mixed = [c for pair in zip(calls[:len(calls) // 2], calls[len(calls) // 2:],
                               strict=False) for c in pair]
    mixed += [c for c in calls if c not in mixed]
    assert served_bound(w, chains, sent(mixed), 2, 1) < one_by_one
    # a pool that holds both families: the unbounded oracle in any order
    assert served_bound(w, chains, sent(mixed), 2, 2) == pytest.approx(
        oracle_hit_rate(prompts, 2))
    # interleaved but each family on its own engine (one block each): every shared
    # block misses once, as sent one by one; unknown engines give no placement bound
    def on(order: list[tuple[int, int]]) -> list[CallRecord]:
        return [CallRecord(session=s, call=k, sent=float(t),
                           engine="e0" if s == w.sessions[0].index else "e1")
                for t, (s, k) in enumerate(order)]

    assert served_placement_bound(w, chains, on(mixed), 2, 1) == pytest.approx(one_by_one)
    assert served_placement_bound(w, chains, sent(mixed), 2, 1) is None


def _counters(queries: float, hits: float, prompt: float) -> dict[str, float]:
    return {"vllm:prefix_cache_queries_total": queries, "vllm:prefix_cache_hits_total": hits,
            "vllm:prompt_tokens_total": prompt}


def _run() -> PolicyRun:
    recs = [
        CallRecord(session=0, call=0, sent=0.0, ttft_ms=100.0, done=1.0, prompt_tokens=1000,
                   cached_tokens=0, route="affinity"),
        CallRecord(session=0, call=1, sent=5.0, ttft_ms=20.0, done=5.5, prompt_tokens=1200,
                   cached_tokens=1000, route="affinity"),
        CallRecord(session=1, call=0, sent=1.0, done=2.0, error="502: engine died"),
    ]
    # engine e0 also served one touch: 1,000 prompt tokens, 1 computed (+1 output token)
    return PolicyRun(policy="warmloop", records=recs,
                     engines={"e0": _counters(3200, 1999, 3200), "e1": _counters(0, 0, 0)},
                     touches={"e0": {"touches": 1, "touch_prompt_tokens": 1000,
                                     "touch_computed_tokens": 2}},
                     makespan_s=6.0, served_by="warmloop gateway")


def test_policy_figures_take_touches_out_of_the_hit_rate_but_bill_their_prefill() -> None:
    f = policy_figures(_run())
    assert f["hit_rate"] == pytest.approx(1000 / 2200, abs=1e-4)
    assert f["usage_hit_rate"] == pytest.approx(1000 / 2200, abs=1e-4)
    assert f["prefill_tokens"] == 3200 - 1999
    assert f["workload_prefill_tokens"] == 1200
    assert f["engine_shares"] == {"e0": 1.0, "e1": 0.0}
    assert f["requests"] == 3 and f["errors"] == 1
    assert f["error_samples"] == ["502: engine died"]  # what went wrong, printed with it
    assert f["session_p95_s"] == 5.5  # first call sent to last answer read
    assert f["ttft_p95_ms"] == 100.0
    assert f["route_reasons"] == {"affinity": 2}


def test_last_line_has_the_oracle_each_policy_and_the_overhead() -> None:
    f = policy_figures(_run())
    rep = {"oracle_hit_rate": 0.9, **{p: f for p in POLICIES[:-1]},
           "round_robin": {"unavailable": "vllm-router is not installed"},
           "overhead_p50_ms": 1.2, "overhead_p95_ms": 3.0, "gateway_call_p50_ms": 20.0,
           "direct_call_p50_ms": 18.8}
    medians, ranges = medians_and_ranges([rep, rep])
    args = argparse.Namespace(live=30, ramp_s=1.5, time_scale=1.0, max_tokens=16,
                              kv_cache_bytes=1 << 24, seed=16)
    out = result_json(medians, ranges, 2, args=args, wall_s=600.0, w=workload(1, 2),
                      block_size=128)
    assert out["oracle_hit_rate"] == 0.9 and out["overhead_p50_ms"] == 1.2
    for p in POLICIES[:-1]:
        assert {"hit_rate", "prefill_tokens", "ttft_p95_ms"} <= set(out[p])
    assert out["round_robin"] == {"unavailable": "vllm-router is not installed"}
