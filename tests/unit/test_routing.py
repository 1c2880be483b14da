"""The pure routing policy, the block-hash chain and the KV-event mapping."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from bench.common import bounded_oracle_hit_rate, placement_bound_hit_rate, steps_hit_rate
from bench.routing import oracle_hit_rate, workload
from warmloop.activities.directory import KvEventApplier, prompt_chain
from warmloop.activities.registry import parse_cache_config
from warmloop.workflows.routing import (
    EngineCandidate,
    RoutingConfig,
    block_hashes,
    choose_engine,
    first_difference,
    pick_engine,
)

CFG = RoutingConfig(prefill_tokens_per_s=20_000, delay_per_request_s=0.05, max_load=8)


def cand(engine_id: str, cached: int = 0, running: int = 0, waiting: int = 0,
         in_flight: int = 0) -> EngineCandidate:
    return EngineCandidate(engine_id=engine_id, expected_cached_tokens=cached, running=running,
                           waiting=waiting, in_flight=in_flight)


def test_a_job_returns_to_the_engine_that_holds_its_transcript() -> None:
    d = choose_engine([cand("e0", cached=4096, running=2), cand("e1", running=1)],
                      job_id="j", last_engine="e0", config=CFG)
    assert (d.engine_id, d.reason, d.expected_cached_tokens) == ("e0", "sticky", 4096)


def test_a_new_job_goes_where_its_profile_prefix_is_warm() -> None:
    d = choose_engine([cand("e0"), cand("e1", cached=1792)], job_id="j", config=CFG)
    assert (d.engine_id, d.reason) == ("e1", "prefix")


def test_cold_start_spreads_by_load() -> None:
    d = choose_engine([cand("e0", running=3), cand("e1", running=1)], job_id="j", config=CFG)
    assert (d.engine_id, d.reason) == ("e1", "least_loaded")


def test_an_engine_over_its_load_threshold_is_passed_over_despite_its_cache() -> None:
    d = choose_engine([cand("e0", cached=8192, running=8), cand("e1", running=0)],
                      job_id="j", last_engine="e0", config=CFG)
    assert d.engine_id == "e1"


def test_queueing_outweighs_a_small_cache_hit() -> None:
    # 256 cached tokens save ~13 ms; four more requests in front cost ~200 ms
    d = choose_engine([cand("e0", cached=256, running=5), cand("e1", running=1)],
                      job_id="j", last_engine="e0", config=CFG)
    assert d.engine_id == "e1"


def test_in_flight_steps_count_before_the_heartbeat_shows_them() -> None:
    d = choose_engine([cand("e0", in_flight=6), cand("e1", running=1)], job_id="j", config=CFG)
    assert d.engine_id == "e1"


def test_failover_is_named_and_baselines_ignore_caches() -> None:
    d = choose_engine([cand("e1")], job_id="j", last_engine="e0", failover=True, config=CFG)
    assert (d.engine_id, d.reason) == ("e1", "failover")
    engines = [cand("e0", cached=9000, running=4), cand("e1", running=1)]
    assert choose_engine(engines, job_id="j", policy="least_loaded").engine_id == "e1"
    assert [choose_engine(engines, job_id="j", policy="round_robin", turn=t).engine_id
            for t in range(3)] == ["e0", "e1", "e0"]


def test_no_candidates_is_an_error() -> None:
    try:
        choose_engine([], job_id="j")
    except ValueError as e:
        assert "no live engine" in str(e)
    else:
        raise AssertionError("expected ValueError")


@given(cached=st.integers(0, 30_000), load=st.integers(0, 7), extra=st.integers(1, 4))
def test_more_cached_tokens_never_lose_an_engine_the_decision(cached: int, load: int,
                                                              extra: int) -> None:
    base = [cand("e0", cached=cached, running=load), cand("e1", running=load)]
    first = choose_engine(base, job_id="j", config=CFG)
    if first.engine_id == "e0":
        more = [cand("e0", cached=cached + extra * 128, running=load), cand("e1", running=load)]
        assert choose_engine(more, job_id="j", config=CFG).engine_id == "e0"


def test_block_hashes_chain_so_a_shared_prefix_shares_hashes() -> None:
    a = list(range(1000))
    b = list(range(500)) + [7] * 500
    ha, hb = block_hashes(a, 128), block_hashes(b, 128)
    assert len(ha) == 7  # full blocks only
    assert first_difference(ha, hb) == 3  # block 3 (tokens 384..511) holds token 500
    assert block_hashes(a[:256], 128) == ha[:2]
    # the same block content after a different prefix hashes differently
    assert block_hashes([1] * 128 + [2] * 128, 128)[1] != block_hashes([3] * 128 + [2] * 128,
                                                                       128)[1]


def test_block_hashes_are_blake2b_over_little_endian_ids_chained_from_the_salt() -> None:
    """The hash's definition: directories written by another worker version, the
    gateway and the KV-event map all rely on it, so a faster rewrite must not change it."""
    ids = [0, 1, 2**32 - 1, 70_000] * 8 + [5]  # 33 ids: two blocks of 16 and a partial

    def reference(parent: bytes, block: list[int]) -> bytes:
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(b"".join(t.to_bytes(4, "little") for t in block))
        return h.digest()

    first = reference(b"salt", ids[:16])
    second = reference(first, ids[16:32])
    assert block_hashes(ids, 16, salt="salt") == [first.hex(), second.hex()]
    with pytest.raises(ValueError, match="token ids"):
        block_hashes([-1] * 16, 16)


def test_prompt_chain_keeps_only_blocks_before_the_tail_reusable() -> None:
    chain = prompt_chain(list(range(1000)), 128, tail_tokens=40)
    assert len(chain.hashes) == 7 and chain.reusable_blocks == 7  # tail in the partial block
    chain = prompt_chain(list(range(1000)), 128, tail_tokens=150)
    assert chain.reusable_blocks == 6


class _Dir:
    def __init__(self) -> None:
        self.stored: list[str] = []
        self.removed: list[str] = []
        self.cleared = 0

    async def store_blocks(self, engine_id: str, hashes: Any, now: float) -> None:
        self.stored += list(hashes)

    async def remove_blocks(self, engine_id: str, hashes: Any) -> None:
        self.removed += list(hashes)

    async def clear_engine(self, engine_id: str) -> None:
        self.cleared += 1


async def test_kv_events_map_onto_the_routers_block_hashes() -> None:
    tokens = list(range(300))
    d = _Dir()
    applier = KvEventApplier(d, "e0")  # type: ignore[arg-type]
    await applier.apply([{"type": "BlockStored", "block_hashes": [b"v1", b"v2"],
                          "parent_block_hash": None, "token_ids": tokens[:256],
                          "block_size": 128, "medium": "GPU"}])
    assert d.stored == block_hashes(tokens, 128)
    # a child block whose parent we know extends the chain; an unknown parent is skipped
    await applier.apply([["BlockStored", [b"v3"], b"v2", tokens[256:300] + [0] * 84, 128, None,
                          "GPU"],
                         {"type": "BlockStored", "block_hashes": [b"x"],
                          "parent_block_hash": b"unknown", "token_ids": [1] * 128,
                          "block_size": 128}])
    assert d.stored[2] == block_hashes(tokens[:256] + tokens[256:300] + [0] * 84, 128)[2]
    assert len(d.stored) == 3
    # an offload tier dropping its copy leaves the engine's pool as it was
    await applier.apply([{"type": "BlockRemoved", "block_hashes": [b"v2"], "medium": "CPU"},
                         ["BlockRemoved", [b"v3"], "CPU"]])
    assert d.removed == []
    await applier.apply([{"type": "BlockRemoved", "block_hashes": [b"v2", b"nope"]}])
    assert d.removed == [d.stored[1]]
    await applier.apply([{"type": "AllBlocksCleared"}])
    assert d.cleared == 1


def test_cache_config_is_read_from_vllm_labels() -> None:
    text = ('# HELP x\nvllm:cache_config_info{block_size="128",engine="0",'
            'kv_cache_size_tokens="5120",num_gpu_blocks="40"} 1.0\n')
    assert parse_cache_config(text) == (128, 5120)
    assert parse_cache_config("vllm:cache_config_info{block_size=\"16\",num_gpu_blocks=\"10\"} 1"
                              ) == (16, 160)
    assert parse_cache_config("") == (0, 0)


def test_oracle_counts_each_block_once() -> None:
    trace = [{"tokens": 300, "hashes": ["a", "b"]}, {"tokens": 300, "hashes": ["a", "b"]},
             {"tokens": 256, "hashes": ["a", "c"]}]
    # unique: a, b, c (384 tokens) + partial 44 + 44 + 0 -> 472 of 856 computed
    assert abs(oracle_hit_rate(trace, 128) - (1 - 472 / 856)) < 1e-9


def test_the_bench_workload_is_seeded_and_has_a_hot_profile() -> None:
    a, b = workload(7, 64, 0.5), workload(7, 64, 0.5)
    assert a == b
    hot = sum(1 for s in a if s.profile == "synthetic-support")
    assert 20 <= hot <= 44 and len({s.profile for s in a}) == 4
    assert all(6 <= s.steps <= 10 for s in a)


def test_a_batch_step_stays_with_its_transcript_where_an_interactive_one_moves() -> None:
    engines = [cand("e0", cached=4096, running=6), cand("e1", cached=1536, running=2)]
    assert choose_engine(engines, job_id="j", last_engine="e0", config=CFG).engine_id == "e1"
    assert choose_engine(engines, job_id="j", last_engine="e0", config=CFG,
                         batch=True).engine_id == "e0"
    # a batch job's engine past max_load: the step waits in its admission queue there
    queued = [cand("e0", cached=4096, running=10), cand("e1", running=3)]
    assert choose_engine(queued, job_id="j", last_engine="e0", config=CFG).engine_id == "e1"
    batch = choose_engine(queued, job_id="j", last_engine="e0", config=CFG, batch=True)
    assert (batch.engine_id, batch.reason) == ("e0", "sticky")


def test_a_batch_burst_spreads_once_the_warm_engine_is_much_busier() -> None:
    cfg = RoutingConfig(prefill_tokens_per_s=20_000, delay_per_request_s=0.01, max_load=8)
    # 1,792 cached tokens save ~90 ms: worth a few more requests in front, not a burst
    close = [cand("e0", cached=1792, in_flight=7), cand("e1", in_flight=3)]
    assert choose_engine(close, job_id="j", config=cfg, batch=True).engine_id == "e0"
    lopsided = [cand("e0", cached=1792, in_flight=24), cand("e1", in_flight=6)]
    assert choose_engine(lopsided, job_id="j", config=cfg, batch=True).engine_id == "e1"
    # the same job's later step stays with its transcript on the busy engine
    later = choose_engine(lopsided, job_id="j", last_engine="e0", config=cfg, batch=True)
    assert (later.engine_id, later.reason) == ("e0", "sticky")


def test_a_new_batch_job_counts_the_jobs_under_way_not_only_the_steps_in_flight() -> None:
    cfg = RoutingConfig(prefill_tokens_per_s=20_000, delay_per_request_s=0.01, max_load=8)
    # e0 holds the prefix and has few steps in flight, but 20 jobs between their steps
    engines = [EngineCandidate(engine_id="e0", expected_cached_tokens=1792, in_flight=3,
                               batch_jobs=20),
               EngineCandidate(engine_id="e1", in_flight=2, batch_jobs=4)]
    assert choose_engine(engines, job_id="j", config=cfg, batch=True).engine_id == "e1"
    # an interactive step does not look at batch jobs between their steps
    assert choose_engine(engines, job_id="j", config=cfg).engine_id == "e0"


def _choose_by_sorting(candidates: list[EngineCandidate], *, job_id: str,
                       last_engine: str | None, config: RoutingConfig, policy: str,
                       batch: bool) -> tuple[str, str, dict[str, float]]:
    """``choose_engine`` as it was written before it was made linear (a full sort by
    load with every candidate's spread hash, membership tests by equality): the
    reference the linear one must decide exactly like."""
    from warmloop.workflows.routing import _spread_key, score
    ordered = sorted(candidates, key=lambda c: c.engine_id)
    by_load = sorted(ordered, key=lambda c: (c.load, c.kv_usage, _spread_key(job_id, c.engine_id)))
    if policy == "least_loaded":
        return by_load[0].engine_id, "least_loaded", {}
    continuing = last_engine is not None
    new_batch_job = batch and not continuing
    under = ordered if batch and continuing else [
        c for c in ordered if c.placement_load(new_batch_job=new_batch_job) < config.max_load
    ] or ordered
    scores = {c.engine_id: score(c, config, batch=batch, continuing=continuing) for c in under}
    best = max(scores.values())
    tied = [c for c in by_load if c in under and best - scores[c.engine_id] <= config.min_saving_s]
    if last_engine is not None and any(c.engine_id == last_engine for c in tied):
        chosen = next(c for c in tied if c.engine_id == last_engine)
    else:
        chosen = tied[0]
    if chosen.engine_id == last_engine:
        reason = "sticky"
    elif chosen.expected_cached_tokens > 0 and len(tied) < len(under):
        reason = "prefix"
    else:
        reason = "least_loaded"
    return chosen.engine_id, reason, {k: round(v, 6) for k, v in scores.items()}


_CANDIDATE = st.builds(
    EngineCandidate, engine_id=st.sampled_from([f"e{i}" for i in range(12)]),
    expected_cached_tokens=st.sampled_from([0, 0, 16, 1440, 1600, 3200]),
    running=st.integers(0, 10), waiting=st.integers(0, 3), in_flight=st.integers(0, 10),
    kv_usage=st.sampled_from([0.0, 0.25, 0.5, 0.9]), batch_jobs=st.integers(0, 9),
    prefill_tokens_per_s=st.sampled_from([None, None, 8_000.0, 50_000.0]))


@settings(max_examples=400)
@given(cands=st.lists(_CANDIDATE, min_size=1, max_size=30),
       last=st.sampled_from([None, "e0", "e3", "e11"]),
       policy=st.sampled_from(["cache_aware", "cache_aware", "least_loaded"]),
       batch=st.booleans(), job=st.sampled_from(["j1", "j2", "job-77"]))
def test_linear_choice_decides_exactly_like_the_sorting_one(
        cands: list[EngineCandidate], last: str | None, policy: str, batch: bool,
        job: str) -> None:
    """Same engine, reason and scores, duplicates and exact ties of load included; and
    ``pick_engine`` (what the fleet simulator calls) is the same decision unrecorded."""
    d = choose_engine(cands, job_id=job, last_engine=last, config=CFG,
                      policy=policy, batch=batch)  # type: ignore[arg-type]
    assert (d.engine_id, d.reason, d.scores) == _choose_by_sorting(
        cands, job_id=job, last_engine=last, config=CFG, policy=policy, batch=batch)
    chosen, reason, scores = pick_engine(cands, job_id=job, last_engine=last, config=CFG,
                                         policy=policy, batch=batch)  # type: ignore[arg-type]
    assert (chosen.engine_id, reason, {k: round(v, 6) for k, v in scores.items()}) == \
        (d.engine_id, d.reason, d.scores)
    assert chosen.expected_cached_tokens == d.expected_cached_tokens


def test_the_bounded_oracle_is_beladys_min_on_the_fleets_pool() -> None:
    trace = [{"tokens": 32, "hashes": ["a", "b"]}, {"tokens": 16, "hashes": ["c"]},
             {"tokens": 16, "hashes": ["a"]}, {"tokens": 20, "hashes": ["b"]}]
    # a, b, c miss; c is never used again, so the 2-block pool evicts it: a, b hit
    assert bounded_oracle_hit_rate(trace, 16, 2) == 32 / 84
    # one block: a comes back sooner than b, so b passes through and a stays; a hits
    assert bounded_oracle_hit_rate(trace, 16, 1) == 16 / 84
    # a pool that holds everything is the unbounded oracle
    assert abs(bounded_oracle_hit_rate(trace, 16, 10) - oracle_hit_rate(trace, 16)) < 1e-12
    assert bounded_oracle_hit_rate([], 16, 4) == 0.0


@given(st.lists(st.lists(st.sampled_from("abcdefgh"), min_size=1, max_size=4, unique=True),
                max_size=30), st.integers(1, 10))
def test_the_bounded_oracle_never_beats_the_unbounded_one(chains: list[list[str]],
                                                          capacity: int) -> None:
    trace = [{"tokens": 16 * len(c) + 3, "hashes": c} for c in chains]
    bounded = bounded_oracle_hit_rate(trace, 16, capacity)
    assert bounded <= oracle_hit_rate(trace, 16) + 1e-12
    assert bounded <= bounded_oracle_hit_rate(trace, 16, capacity + 1) + 1e-12


def test_pressure_arrivals_keep_the_jobs_in_flight_whatever_the_host_speed() -> None:
    from bench.routing import Calibration, in_flight_gap_s, scripted

    specs = workload(7, 40, 1.0)
    pauses = sum(sum(st.pause_s for st in scripted(s).steps) for s in specs) / len(specs)
    steps = sum(s.steps for s in specs) / len(specs)
    cal = Calibration(step_s=0.1, between_steps_s=0.4)
    gap = in_flight_gap_s(specs, cal, in_flight=4.0)
    # Little's law: jobs in flight = arrival rate x a job's time
    assert (pauses + steps * 0.5) / gap == pytest.approx(4.0)
    assert in_flight_gap_s(specs, cal, in_flight=2.0) == pytest.approx(2 * gap)
    # a slower host's steps lengthen the jobs, so arrivals space out to hold 4 in flight
    slow = Calibration(step_s=0.3, between_steps_s=0.4)
    assert in_flight_gap_s(specs, slow, in_flight=4.0) > gap


def test_the_paired_job_time_compares_each_job_with_its_twin() -> None:
    from bench.routing import PolicyRun, paired_job_diff_ms

    def run(policy: str, durations: list[float]) -> PolicyRun:
        return PolicyRun(policy=policy, hit_rate=0.0, prefill_tokens=0, prompt_tokens=0,
                         job_p50_s=0.0, job_p95_s=0.0, makespan_s=0.0, states={}, steps=0,
                         durations=durations)

    runs = {"warmloop": run("warmloop", [1.0, 2.0, 9.0]),
            "peer": run("peer", [1.1, 2.3, 8.5])}
    # +100, +300, -500 ms: the peer's jobs took 33 ms less on average
    assert paired_job_diff_ms(runs) == {"peer": -33.3}
    assert paired_job_diff_ms({"peer": runs["peer"]}) == {}


async def test_the_fleets_cache_geometry_comes_from_an_engines_cache_config() -> None:
    import httpx

    from bench.common import cache_geometry

    page = 'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="4096"} 1.0\n'
    transport = httpx.MockTransport(lambda req: httpx.Response(200, text=page))
    async with httpx.AsyncClient(transport=transport) as http:
        assert await cache_geometry(http, ["http://e0", "http://e1"]) == (16, 512)
    silent = httpx.MockTransport(lambda req: httpx.Response(200, text=""))
    async with httpx.AsyncClient(transport=silent) as http:
        assert await cache_geometry(http, ["http://e0"]) == (0, 0)


def test_touches_are_taken_out_of_the_steps_hit_rate() -> None:
    # Steps: 1,000 prompt tokens, 800 cached. Two touches of 300-token held prompts, each
    # computing its last token and one output token (2 tokens): 296 of their 600 hit.
    touches = {"touches": 2, "touch_prompt_tokens": 600, "touch_computed_tokens": 4}
    assert steps_hit_rate(1600, 800 + 598, touches) == pytest.approx(0.8)
    assert steps_hit_rate(1000, 800, {}) == pytest.approx(0.8)
    assert steps_hit_rate(600, 598, touches) == 0.0  # nothing but touches: no steps


def test_the_placement_bound_is_beladys_min_on_each_engines_own_pool() -> None:
    # Two engines of one block each. Together (a 2-block pool) a and b both stay; split
    # as served, e0 alternates a and b in one block and keeps neither.
    trace = [{"engine": e, "tokens": 16, "hashes": [h]}
             for e, h in [("e0", "a"), ("e0", "b"), ("e1", "c"), ("e0", "a"), ("e0", "b"),
                          ("e1", "c")]]
    assert bounded_oracle_hit_rate(trace, 16, 2) == pytest.approx(2 / 6)
    # e0: a, b, a, b in one block: Belady keeps a (used next) over b: one hit; e1: one.
    assert placement_bound_hit_rate(trace, 16, 1) == pytest.approx(2 / 6)
    assert placement_bound_hit_rate(trace, 16, 2) == pytest.approx(3 / 6)
