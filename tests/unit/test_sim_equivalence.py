"""The simulator's speed-ups change nothing it simulates.

``BASELINE`` was recorded with the simulator as it was before it was made fast (issue
19's bench-fleet work), with one fix applied to both: batch admission broke ties by
``id(req)`` (a memory address, so bench-burst's lanes run differed from run to run) and
now breaks them first come, first served. Each case must give exactly the same figures
and, for the fleet cases, the same per-step and per-job record (``digest``). Then the
fast paths (binary searches, bulk block updates, the fleet's block index, candidates
compared by identity) are checked against the plain walks they replace.

Re-recorded once since, for a change of what is simulated (not of speed): on 2026-12-04
the holds' cap counts each held block once, as the worker's ``HoldManager.held_tokens``
does (a profile's shared prompt once for all its jobs' holds); ``pauses/hold``,
``pauses/warmloop`` and the warmloop fleet cases changed with it, every other case
stayed as recorded. And on 2026-12-05 the cost model's hold rent became the pool's
measured evictions where it has them (``EvictionRegret``): ``pauses/warmloop`` changed
(26,368 -> 25,344 prefill tokens; 71 -> 76 holds of 80), every other case stayed as
recorded (the fleet cases' 20 simulated seconds end before the regret's first measure).
And later that day a hold let go (for room, at its TTL, when its job ends or moves)
releases its own blocks as last used at its last touch (``Fleet._last_touch``), not
now: ``pauses/hold`` 24,576 -> 25,984 and ``pauses/warmloop`` 25,344 -> 26,624 prefill
tokens; every other case, the fleet cases' digests included, stayed as recorded. Then
the touch interval's churn came from a probe of every engine each second, as the
workers' heartbeats (``Fleet._probe_churn``), not from the rate since a lazy probe at
holds: ``pauses/hold`` 25,344 and ``pauses/warmloop`` 26,112 prefill tokens, and the
fleets that hold count the probes as events (the warmloop fleet cases' digests stayed).
And on 2026-12-06 an engine's pool caches one block fewer than it has, as vLLM's keeps
its first block as the null block (``sim.engine.NULL_BLOCKS``): on the CPU cases' 64-block
pools ``pauses/release`` 60,928 -> 61,696, ``pauses/hold`` 25,344 -> 25,600,
``pauses/warmloop`` 26,112 -> 26,368, ``routing/round_robin`` 93,876 -> 94,004,
``routing/least_loaded`` 87,476 -> 87,604 and ``burst/naive`` 273,975 -> 274,231 prefill
tokens; the rest, the fleet cases' digests included (H100 pools of 24,747 blocks), stayed
as recorded.
(``HoldConfig.cut_for_room``, off by default, cuts the oldest hold short for room
instead of letting it go: with it ``pauses/hold`` gives 25,472 and ``pauses/warmloop``
26,112 prefill tokens; 24,192 and 24,960 before the touch age.)
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
import random
from typing import Any

import pytest

from warmloop.sim import scenarios
from warmloop.sim.core import Clock
from warmloop.sim.engine import PrefixCache
from warmloop.sim.fleet import POLICIES, Fleet, _Candidate
from warmloop.sim.run import summarize
from warmloop.sim.workload import bundled_mix, burst_jobs, poisson_jobs
from warmloop.workflows import routing
from warmloop.workflows.calibration import preset
from warmloop.workflows.routing import EngineCandidate

RATE = {0.8: 35.8786042733777, 0.95: 42.605842574636014}
"""Jobs a second: 80 % / 95 % of 4 H100s' perfect-cache capacity (bench/fleet.py's
``capacity_jobs_per_s`` when the baseline was recorded), fixed here."""

FIELDS = ("completed", "steps", "prompt_tokens", "cached_tokens", "prefill_tokens",
          "job_p95_s", "ttft_p99_ms", "interactive_ttft_p99_ms", "cost_p95_usd",
          "post_pause_recomputed", "events", "hold_decisions")

BASELINE: dict[str, dict[str, Any]] = {
    'burst/lanes': {'completed': 136, 'steps': 608, 'prompt_tokens': 994999, 'cached_tokens': 872448, 'prefill_tokens': 122551, 'job_p95_s': 26.062262, 'ttft_p99_ms': 135.8319, 'interactive_ttft_p99_ms': 86.616547, 'cost_p95_usd': 0.000298, 'post_pause_recomputed': 640, 'events': 4071, 'hold_decisions': {}},  # noqa: E501
    'burst/naive': {'completed': 129, 'steps': 587, 'prompt_tokens': 994999, 'cached_tokens': 720768, 'prefill_tokens': 274231, 'job_p95_s': 55.257617, 'ttft_p99_ms': 1900.40662, 'interactive_ttft_p99_ms': 1900.40662, 'cost_p95_usd': 0.000308, 'post_pause_recomputed': 110208, 'events': 3192, 'hold_decisions': {}},  # noqa: E501
    'cache_aware_no_holds/4/0.8/20.0/True': {'completed': 556, 'steps': 6356, 'prompt_tokens': 13148164, 'cached_tokens': 12117680, 'prefill_tokens': 1030484, 'job_p95_s': 14.616177, 'ttft_p99_ms': 434.30027, 'interactive_ttft_p99_ms': 389.834598, 'cost_p95_usd': 0.000118, 'post_pause_recomputed': 90080, 'events': 23599, 'hold_decisions': {}, 'digest': 'd8a996f5ea066535'},  # noqa: E501
    'cache_aware_no_holds/4/0.95/20.0/False': {'completed': 277, 'steps': 2639, 'prompt_tokens': 5595262, 'cached_tokens': 5133088, 'prefill_tokens': 462174, 'job_p95_s': 12.803999, 'ttft_p99_ms': 66.612702, 'interactive_ttft_p99_ms': 66.612702, 'cost_p95_usd': 0.00017, 'post_pause_recomputed': 57184, 'events': 15078, 'hold_decisions': {}, 'digest': '7f503c11cb5d5669'},  # noqa: E501
    'pauses/hold': {'completed': 16, 'steps': 96, 'prompt_tokens': 171888, 'cached_tokens': 150272, 'prefill_tokens': 25600, 'job_p95_s': 103.012455, 'ttft_p99_ms': 126.195478, 'interactive_ttft_p99_ms': 126.195478, 'cost_p95_usd': 7.2e-05, 'post_pause_recomputed': 5136, 'events': 4305, 'hold_decisions': {}},  # noqa: E501
    'pauses/release': {'completed': 16, 'steps': 96, 'prompt_tokens': 171888, 'cached_tokens': 131200, 'prefill_tokens': 61696, 'job_p95_s': 103.227684, 'ttft_p99_ms': 138.573841, 'interactive_ttft_p99_ms': 138.573841, 'cost_p95_usd': 8.9e-05, 'post_pause_recomputed': 36496, 'events': 3545, 'hold_decisions': {}},  # noqa: E501
    'pauses/warmloop': {'completed': 16, 'steps': 96, 'prompt_tokens': 171888, 'cached_tokens': 150272, 'prefill_tokens': 26368, 'job_p95_s': 103.012455, 'ttft_p99_ms': 126.195478, 'interactive_ttft_p99_ms': 126.195478, 'cost_p95_usd': 7.2e-05, 'post_pause_recomputed': 5904, 'events': 7292, 'hold_decisions': {'hold': 76, 'release': 4}},  # noqa: E501
    'round_robin_lru/4/0.8/20.0/True': {'completed': 272, 'steps': 4455, 'prompt_tokens': 8865589, 'cached_tokens': 7950720, 'prefill_tokens': 914869, 'job_p95_s': 14.758151, 'ttft_p99_ms': 653.584303, 'interactive_ttft_p99_ms': 638.360598, 'cost_p95_usd': 0.00012, 'post_pause_recomputed': 275936, 'events': 19054, 'hold_decisions': {}, 'digest': '5dfa31eb678b5e43'},  # noqa: E501
    'round_robin_lru/4/0.95/20.0/False': {'completed': 264, 'steps': 2566, 'prompt_tokens': 5416469, 'cached_tokens': 4724576, 'prefill_tokens': 691893, 'job_p95_s': 13.100302, 'ttft_p99_ms': 81.115902, 'interactive_ttft_p99_ms': 81.115902, 'cost_p95_usd': 0.000213, 'post_pause_recomputed': 298160, 'events': 14956, 'hold_decisions': {}, 'digest': 'e18468f7544e3159'},  # noqa: E501
    'routing/least_loaded': {'completed': 40, 'steps': 315, 'prompt_tokens': 593716, 'cached_tokens': 506112, 'prefill_tokens': 87604, 'job_p95_s': 6.579033, 'ttft_p99_ms': 106.193029, 'interactive_ttft_p99_ms': 106.193029, 'cost_p95_usd': 0.000117, 'post_pause_recomputed': 12416, 'events': 1622, 'hold_decisions': {}},  # noqa: E501
    'routing/round_robin': {'completed': 40, 'steps': 315, 'prompt_tokens': 593716, 'cached_tokens': 499712, 'prefill_tokens': 94004, 'job_p95_s': 6.459656, 'ttft_p99_ms': 108.629297, 'interactive_ttft_p99_ms': 108.629297, 'cost_p95_usd': 0.000116, 'post_pause_recomputed': 15744, 'events': 1631, 'hold_decisions': {}},  # noqa: E501
    'routing/warmloop': {'completed': 40, 'steps': 315, 'prompt_tokens': 593716, 'cached_tokens': 531840, 'prefill_tokens': 61876, 'job_p95_s': 6.518537, 'ttft_p99_ms': 103.678026, 'interactive_ttft_p99_ms': 103.678026, 'cost_p95_usd': 0.000103, 'post_pause_recomputed': 0, 'events': 1686, 'hold_decisions': {}},  # noqa: E501
    'warmloop/4/0.8/20.0/True': {'completed': 436, 'steps': 4166, 'prompt_tokens': 8739523, 'cached_tokens': 8064688, 'prefill_tokens': 674835, 'job_p95_s': 14.195715, 'ttft_p99_ms': 54.58331, 'interactive_ttft_p99_ms': 62.952031, 'cost_p95_usd': 0.000161, 'post_pause_recomputed': 52464, 'events': 22056, 'hold_decisions': {'hold': 3476, 'release': 254}, 'digest': '296db490877c83bb'},  # noqa: E501
    'warmloop/4/0.95/20.0/False': {'completed': 276, 'steps': 2638, 'prompt_tokens': 5592729, 'cached_tokens': 5131952, 'prefill_tokens': 460777, 'job_p95_s': 12.831238, 'ttft_p99_ms': 78.557654, 'interactive_ttft_p99_ms': 78.557654, 'cost_p95_usd': 0.000177, 'post_pause_recomputed': 57440, 'events': 15186, 'hold_decisions': {'hold': 2358, 'release': 4}, 'digest': '0e86ea9f1f63ceed'},  # noqa: E501
}

FLEET_CASES = [k for k in BASELINE if k.count("/") == 4]


def digest(fleet: Fleet) -> str:
    """Every step's and job's record, hashed (floats by repr: bit for bit)."""
    h = hashlib.sha256()
    for s in fleet.steps:
        h.update(repr((s.job_id, s.step, s.engine, s.prompt_tokens, s.cached_tokens,
                       s.output_tokens, s.ttft_s, s.cost_usd)).encode())
    for j in fleet.jobs:
        h.update(repr((j.job_id, j.end_s, j.cost_usd, j.steps)).encode())
    return h.hexdigest()[:16]


def run_fleet_case(key: str) -> dict[str, Any]:
    """bench-fleet's workload (H100 preset, the bundled mix, the 10x batch burst) on 4
    GPUs for 20 s."""
    policy, gpus, load, horizon, burst = key.split("/")
    g, h = int(gpus), float(horizon)
    rate = RATE[float(load)]
    mix = bundled_mix()
    rng = random.Random(1)
    jobs = poisson_jobs(mix, rate_per_s=rate, duration_s=h, rng=rng)
    if burst == "True":
        jobs += burst_jobs(mix, n=int(10 * rate * h / 5), at_s=h / 5, over_s=h / 5, rng=rng)
    clock = Clock()
    # Recorded when batch admission capped K at AdmissionConfig.k_max (16) on every
    # engine; the preset's batch_k_max (64) came later and changes what a burst does.
    cal = preset("h100-llama-3.1-8b-bf16").model_copy(update={"batch_k_max": None})
    fleet = Fleet(clock, [cal] * g, POLICIES[policy])
    fleet.add_jobs(jobs)
    clock.run(h)
    return {**summarize(fleet, clock).as_dict(), "digest": digest(fleet)}


AS_RECORDED = dataclasses.replace(scenarios.CPU_FLEET, host_sharing=None)
"""The CPU fleet as ``BASELINE`` was recorded: each engine stepping as if alone on the
host (``CPU_HOST`` came later)."""


def _routing_as_recorded() -> dict[str, Any]:
    return scenarios.bench_routing(fleet=AS_RECORDED)


def _burst_as_recorded() -> dict[str, Any]:
    """bench-burst's configuration with the job sizes it had when ``BASELINE`` was
    recorded (they have since been matched to the measured bench)."""
    return scenarios.bench_burst(profiles=scenarios.BURST_PROFILES_BEFORE, fleet=AS_RECORDED)


def _pauses_as_recorded() -> dict[str, Any]:
    """bench-pauses' configuration as it was when ``BASELINE`` was recorded: each policy
    starting from the profiles' priors (it now starts from the plans' pauses learned)
    and 640-token background prompts (now the bench's measured 532), bench-routing's
    prompt sizes and the approvals' pre-warms sending the next step's whole prompt (now
    the bench's own sizes and the transcript as it stands), and the reviewer noticing
    each approval at once (now as late as the bench's reviewer did)."""
    return scenarios.bench_pauses(learned=False, bg_rate=3.5, bg_tokens=640,
                                  sizes=scenarios.PAUSES_SIZES_BEFORE,
                                  approval_notice_s=(0.0, 0.0), fleet=AS_RECORDED)


def _scenario_figures() -> dict[str, dict[str, Any]]:
    out = {}
    for name, fn in (("routing", _routing_as_recorded), ("pauses", _pauses_as_recorded),
                     ("burst", _burst_as_recorded)):
        for pol, s in fn().items():
            out[f"{name}/{pol}"] = s.as_dict()
    return out


def _same(got: dict[str, Any], want: dict[str, Any]) -> list[str]:
    return [f"{f}: {got[f]!r} != {want[f]!r}" for f in want
            if got[f] != want[f] and not (isinstance(want[f], float) and math.isnan(want[f])
                                          and math.isnan(got[f]))]


@pytest.mark.parametrize("key", FLEET_CASES)
def test_fleet_case_matches_the_recorded_baseline(key: str) -> None:
    got = run_fleet_case(key)
    assert not _same(got, BASELINE[key]), _same(got, BASELINE[key])


def test_fidelity_scenarios_match_the_recorded_baseline() -> None:
    got = _scenario_figures()
    diffs = {k: _same(got[k], v) for k, v in BASELINE.items() if k not in FLEET_CASES}
    assert not any(diffs.values()), diffs


def test_plain_walks_simulate_the_same(monkeypatch: pytest.MonkeyPatch) -> None:
    """The block-level fast paths against the one-key-at-a-time walks: every cache
    lookup, use and release, and the fleet's warm-engine search."""
    monkeypatch.setattr(PrefixCache, "hit_blocks", PrefixCache.hit_blocks_walk)
    monkeypatch.setattr(PrefixCache, "acquire", PrefixCache.acquire_walk)
    monkeypatch.setattr(PrefixCache, "release", PrefixCache.release_walk)

    def warm(self: Fleet, chain: list[Any]) -> dict[int, int]:
        hits = {e.owner: e.cache.hit_blocks_walk(chain) for e in self.engines}
        return {i: n for i, n in hits.items() if n}

    monkeypatch.setattr(Fleet, "_warm", warm)
    key = "warmloop/4/0.8/20.0/True"
    assert run_fleet_case(key)["digest"] == BASELINE[key]["digest"]


def walked(cache: PrefixCache, chain: list[Any], own_from: int = -1) -> int:
    """``hit_blocks`` the plain way: the shared part walked a key at a time in ``ref``,
    then the job's own run's cached blocks (its record: those blocks are not in
    ``ref``; ``check_runs`` checks the records)."""
    if not 0 <= own_from < len(chain):
        return cache.hit_blocks_walk(chain)
    n = cache.hit_blocks_walk(chain[:own_from])
    if n < own_from:
        return n
    run = cache.runs.get(chain[own_from])
    return n + (min(run.cached, len(chain) - own_from) if run is not None else 0)


def test_fast_lookups_agree_with_the_walks_along_a_run() -> None:
    """Checked at every lookup of a run with holds, prewarms, lanes and evictions."""
    checks = [0]
    real_warm = Fleet._warm
    real_hit = PrefixCache.hit_blocks

    def hit(self: PrefixCache, chain: Any, own_from: int = -1) -> int:
        n = real_hit(self, chain, own_from)
        assert n == walked(self, chain, own_from)
        checks[0] += 1
        if checks[0] % 97 == 0:
            self.check_runs()
        return n

    def warm(self: Fleet, chain: list[Any], own_from: int = -1) -> dict[int, int]:
        got = real_warm(self, chain, own_from)
        want = {e.owner: walked(e.cache, chain, own_from) for e in self.engines}
        assert list(got.items()) == [(i, n) for i, n in want.items() if n]
        return got

    mp = pytest.MonkeyPatch()
    mp.setattr(PrefixCache, "hit_blocks", hit)
    mp.setattr(Fleet, "_warm", warm)
    try:
        scenarios.bench_pauses()
        scenarios.bench_burst(n_jobs=40)
    finally:
        mp.undo()
    assert checks[0] > 1_000


def test_candidates_compared_by_identity_decide_like_validated_ones() -> None:
    rng = random.Random(3)
    cfg = preset("h100-llama-3.1-8b-bf16").routing_config()
    for trial in range(400):
        n = rng.choice([1, 2, 5, 40, 130])
        fields = [dict(engine_id=f"e{i:03d}",
                       expected_cached_tokens=rng.choice([0, 0, 1440, 1440, 1600, 3200]),
                       running=rng.randint(0, 12), waiting=rng.randint(0, 2),
                       in_flight=rng.randint(0, 12), kv_usage=rng.choice([0.5, rng.random()]),
                       batch_jobs=rng.randint(0, 3)) for i in range(n)]
        rng.shuffle(fields)
        kw: dict[str, Any] = dict(
            job_id=f"j{trial}", last_engine=rng.choice([None, "e001", f"e{n - 1:03d}"]),
            config=cfg, policy=rng.choice(["cache_aware", "cache_aware", "least_loaded"]),
            batch=rng.random() < 0.3)
        plain = routing.choose_engine([EngineCandidate(**f) for f in fields], **kw)  # type: ignore[arg-type]
        fast = routing.choose_engine(
            [_Candidate.model_construct(**f) for f in fields], **kw)  # type: ignore[arg-type]
        assert fast == plain


def test_pruned_candidates_decide_like_all_of_them() -> None:
    """At every routing decision of runs with holds, prewarms, lanes and a batch burst
    (new batch jobs' placement load), ``choose_engine`` over the pruned candidates picks
    what it picks over every warm engine and the ``FleetConfig.candidates`` coldest."""
    checked = {"all": 0, "pruned_away": 0, "batch_first": 0, "cold_pruned_away": 0}
    real = Fleet.route

    def route(self: Fleet, job_id: str, chain: list[Any], last_engine: str | None,
              batch: bool, own_from: int = -1) -> Any:
        if self.policy.routing != "round_robin":
            first = batch and last_engine is None
            kw: dict[str, Any] = dict(job_id=job_id, last_engine=last_engine,
                                      config=self.routing_cfg, policy=self.policy.routing,
                                      batch=batch)
            full = [c.model_copy() for c in self._candidates(chain, first, last_engine,
                                                            prune=False, own_from=own_from)]
            pruned = [c.model_copy() for c in self._candidates(chain, first, last_engine,
                                                              own_from=own_from)]
            want = routing.choose_engine(full, **kw).engine_id  # type: ignore[arg-type]
            assert routing.choose_engine(pruned, **kw).engine_id == want  # type: ignore[arg-type]
            checked["all"] += 1
            checked["pruned_away"] += len(full) - len(pruned)
            checked["cold_pruned_away"] += (sum(c.expected_cached_tokens == 0 for c in full)
                                            - sum(c.expected_cached_tokens == 0 for c in pruned))
            checked["batch_first"] += first
        return real(self, job_id, chain, last_engine, batch, own_from)

    mp = pytest.MonkeyPatch()
    mp.setattr(Fleet, "route", route)
    try:
        for key in ("warmloop/4/0.8/20.0/True", "cache_aware_no_holds/4/0.8/20.0/True"):
            assert run_fleet_case(key)["digest"] == BASELINE[key]["digest"]
        scenarios.bench_burst(n_jobs=40)
    finally:
        mp.undo()
    assert checked["all"] > 5_000 and checked["batch_first"] > 100
    assert checked["pruned_away"] > 0 and checked["cold_pruned_away"] > 0
