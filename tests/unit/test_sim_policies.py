"""The simulator runs warmloop's own policies, never a copy of them."""

from __future__ import annotations

import ast
import inspect
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

import warmloop.sim as sim_package
from warmloop.sim import fleet as sim_fleet
from warmloop.sim import scenarios
from warmloop.sim.engine import Request
from warmloop.sim.fleet import Fleet, FleetConfig
from warmloop.sim.run import simulate
from warmloop.workflows import holding, lanes, routing
from warmloop.workflows.contracts import Lane
from warmloop.workflows.holding import HoldConfig

SIM = Path(sim_package.__file__).resolve().parent
"""The simulator's sources (the package's ``__init__``: ``sim_fleet`` may be a compiled
build's, ``warmloop.sim.compiled``)."""
POLICY_NAMES = {
    name for module in (routing, holding, lanes)
    for name, obj in vars(module).items()
    if inspect.isfunction(obj) and obj.__module__ == module.__name__
} | {"score", "choose_engine", "pick_engine", "decide_hold", "expected_hold_usd",
     "next_batch_limit", "kv_fit_limit", "adapt_window", "hold_usd_per_s", "reprefill_usd"}


def _defined_functions() -> list[tuple[str, str]]:
    out = []
    for path in SIM.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                out.append((path.name, node.name))
    return out


def test_sim_defines_no_function_named_like_a_policy() -> None:
    clashes = [(f, n) for f, n in _defined_functions() if n.lstrip("_") in POLICY_NAMES]
    assert not clashes, f"sim/ carries its own copy of a policy: {clashes}"


def test_sim_does_not_restate_the_score_formula() -> None:
    """No arithmetic over the routing score's or the hold model's inputs in sim/."""
    suspicious = ("expected_cached_tokens /", "prefill_tokens_per_s -", "delay_per_request_s *",
                  "1.0 - self.kv_usage", "kv_usage / max(", "min(p, ttl", "k // 2")
    for path in SIM.glob("*.py"):
        text = path.read_text()
        for pattern in suspicious:
            assert pattern not in text, f"{path.name} restates a policy: {pattern!r}"


def test_the_fleet_calls_resolve_to_the_workflows_modules() -> None:
    assert sim_fleet.routing is routing
    assert sim_fleet.holding is holding
    assert sim_fleet.lanes is lanes
    src = inspect.getsource(sim_fleet)
    for call in ("routing.pick_engine(", "holding.decide_hold(", "lanes.next_batch_limit(",
                 "lanes.kv_fit_limit("):
        assert call in src, call


def test_router_calls_the_real_choose_engine(monkeypatch: object) -> None:
    """Through ``pick_engine``: ``choose_engine`` is it plus the record the workers keep
    (``tests/unit/test_routing.py`` checks the two agree)."""
    calls = []
    real = routing.pick_engine

    def spy(*a: object, **k: object) -> tuple[routing.EngineCandidate, str, dict[str, float]]:
        calls.append(k.get("policy"))
        return real(*a, **k)  # type: ignore[arg-type]

    import pytest
    mp = pytest.MonkeyPatch()
    mp.setattr(routing, "pick_engine", spy)
    try:
        jobs = scenarios.routing_jobs(n_jobs=4)
        simulate(jobs, scenarios.cpu_engines(16 * scenarios.MIB), "warmloop",
                 config=scenarios.CPU_FLEET)
    finally:
        mp.undo()
    assert calls and set(calls) == {"cache_aware"}


def test_cache_aware_routing_beats_round_robin_on_hit_rate() -> None:
    jobs = scenarios.routing_jobs(n_jobs=16)
    engines = scenarios.cpu_engines(16 * scenarios.MIB)
    warm = simulate(jobs, engines, scenarios.ROUTING_POLICIES["warmloop"],
                    config=scenarios.CPU_FLEET)
    rr = simulate(scenarios.routing_jobs(n_jobs=16), engines,
                  scenarios.ROUTING_POLICIES["round_robin"], config=scenarios.CPU_FLEET)
    assert warm.completed == rr.completed == 16
    assert warm.hit_rate > rr.hit_rate + 0.03
    assert warm.prefill_tokens < rr.prefill_tokens


def test_holds_keep_prefixes_through_pauses() -> None:
    release = simulate(scenarios.pauses_jobs(n_jobs=8), scenarios.cpu_engines(16 * scenarios.MIB),
                       scenarios.PAUSES_POLICIES["release"], config=scenarios.CPU_FLEET,
                       setup=lambda f: f.background(rate_per_engine_s=3.5, prompt_tokens=640,
                                                    output_tokens=4, until_s=120))
    hold = simulate(scenarios.pauses_jobs(n_jobs=8), scenarios.cpu_engines(16 * scenarios.MIB),
                    scenarios.PAUSES_POLICIES["hold"], config=scenarios.CPU_FLEET,
                    setup=lambda f: f.background(rate_per_engine_s=3.5, prompt_tokens=640,
                                                 output_tokens=4, until_s=120))
    assert hold.post_pause_recomputed < release.post_pause_recomputed


def test_the_holds_cap_counts_each_held_block_once() -> None:
    """The simulated cap bounds what ``HoldManager.held_tokens`` bounds: the union of
    the holds' blocks (a profile's shared prompt once), checked at every hold of a run
    against a plain set union; and the union lets more holds stand than a per-hold sum
    would (bench-pauses: 16 jobs of two profiles sharing ~1,400 tokens)."""
    checked, most, biggest = [0], [0], [0]
    real_pin = sim_fleet.Fleet._pin

    def pin(self: sim_fleet.Fleet, job: Any, engine: Any, ttl_s: float) -> None:
        real_pin(self, job, engine, ttl_s)
        for eid, holds in self.holds.items():
            union: set[Any] = set().union(*(h.keys for h in holds if h.active))
            assert self.held[eid].blocks == len(union)
            assert len(union) * self.block <= (self.hold_cfg.max_held_fraction
                                               * self.by_id[eid].cal.kv_pool_tokens)
            checked[0] += 1
            most[0] = max(most[0], len(holds))
            biggest[0] = max([biggest[0], *(len(h.keys) * self.block for h in holds)])

    import pytest
    mp = pytest.MonkeyPatch()
    mp.setattr(sim_fleet.Fleet, "_pin", pin)
    try:
        engines = scenarios.cpu_engines(16 * scenarios.MIB)
        simulate(scenarios.pauses_jobs(), engines, scenarios.PAUSES_POLICIES["hold"],
                 config=scenarios.CPU_FLEET)
    finally:
        mp.undo()
    assert checked[0] > 50
    cap = HoldConfig().max_held_fraction * engines[0].kv_pool_tokens
    assert cap // biggest[0] <= 1 < 3 <= most[0]  # a per-hold sum would allow one


def test_prewarms_ask_the_workflows_policy_and_skip_engines_with_a_queue(
        monkeypatch: object) -> None:
    """The simulator's prewarm asks ``holding.prewarm_worthwhile`` with the engine's
    queue, as the worker's prewarm activity does; told no, it sends nothing."""
    import pytest
    fleets: list[sim_fleet.Fleet] = []
    asked: list[int] = []
    real = holding.prewarm_worthwhile

    def run() -> int:
        fleets.clear()
        simulate(scenarios.pauses_jobs(n_jobs=8), scenarios.cpu_engines(16 * scenarios.MIB),
                 scenarios.PAUSES_POLICIES["release"], config=scenarios.CPU_FLEET,
                 setup=fleets.append)
        return fleets[0].prewarm_computed

    def spy(waiting: int) -> bool:
        asked.append(waiting)
        return real(waiting)

    mp = pytest.MonkeyPatch()
    mp.setattr(holding, "prewarm_worthwhile", spy)
    try:
        warmed = run()
        assert asked, "no prewarm asked the policy"
        mp.setattr(holding, "prewarm_worthwhile", lambda waiting: False)
        skipped = run()
    finally:
        mp.undo()
    assert warmed > 0
    assert skipped == 0


def test_bench_routing_scenario_pauses_as_the_bench_does() -> None:
    """The simulated bench-routing jobs have the bench's own steps and tool pauses, job
    by job (a job's p95 follows its slowest jobs, so equal totals are not enough)."""
    from bench.routing import scripted_pause_s, workload

    bench = workload(7, 40, 1.9)
    sim = scenarios.routing_jobs(mean_gap_s=1.9)
    assert [b.steps for b in bench] == [len(j.steps) for j in sim]
    assert [round(scripted_pause_s(b), 9) for b in bench] == [
        round(sum(st.pause_s for st in j.steps), 9) for j in sim]


def _burst_fleet(cfg: FleetConfig, jobs: int = 40) -> tuple[Fleet, list[int]]:
    """A naive burst on two CPU engines; returns the fleet and the most steps each
    engine's worker had taken at once."""
    from warmloop.sim.core import Clock

    rng = random.Random(3)
    specs = [scenarios._bundled_job(f"b{i:03d}", "ticket-triage", 3, rng, Lane.INTERACTIVE)
             for i in range(jobs)]
    clock = Clock()
    fleet = Fleet(clock, scenarios.cpu_engines(24 * scenarios.MIB),
                  scenarios.BURST_POLICIES["naive"], cfg)
    peak = [0, 0]
    real_submit = [e.submit for e in fleet.engines]

    def watch(i: int) -> Callable[[Request], None]:
        def submit(req: Request) -> None:
            peak[i] = max(peak[i], fleet.slots_in_use[i])
            real_submit[i](req)
        return submit

    for i, e in enumerate(fleet.engines):
        e.submit = watch(i)  # type: ignore[method-assign,assignment]
    fleet.add_jobs(specs)
    clock.run()
    assert all(j.steps == 3 for j in fleet.jobs) and len(fleet.jobs) == jobs
    return fleet, peak


def test_an_engines_worker_takes_no_more_steps_than_its_step_slots() -> None:
    """The simulated workers take steps as ``workers.step_slots`` says (24 MiB pools
    hold 6 reference prompts: 12 slots, raised to the floor of 16); the rest wait."""
    from warmloop.workers import step_slots as slots_module

    fleet, peak = _burst_fleet(scenarios.CPU_FLEET)
    limit = fleet._slot_limit(fleet.engines[0])
    assert limit == slots_module.StepSlotConfig().floor == 16
    assert max(peak) == limit


def test_the_fleet_reads_the_workers_step_slots(monkeypatch: object) -> None:
    import pytest

    from warmloop.sim import fleet as fleet_module
    from warmloop.workers.step_slots import StepSlots

    mp = pytest.MonkeyPatch()
    mp.setattr(fleet_module, "step_slots",
               lambda hb, cfg: StepSlots(2, None, None, 0, "a test's two"))
    try:
        _, peak = _burst_fleet(scenarios.CPU_FLEET)
    finally:
        mp.undo()
    assert max(peak) == 2


def test_burst_jobs_share_whole_blocks_of_their_profile() -> None:
    """bench-burst's engines cache a profile's shared prompt in whole 128-token blocks,
    and a job's first step on a warm engine recomputes only its own tokens (~95 in the
    measured runs): sizes that put the shared prompt's end mid-block make every step
    recompute up to a block more than the bench does."""
    block = scenarios.CPU_TINY_LOADED.block_size
    rng = random.Random(0)
    for name, sizes in scenarios.BURST_PROFILES.items():
        assert sizes.shared_prefix % block == 0, name
        job = scenarios._bundled_job("j", name, 2, rng, Lane.BATCH)
        own = job.task_tokens + job.tail_tokens
        assert 0 < own < block, (name, own)
        assert job.prefix_tokens + own == sizes.first_prompt


def test_simulated_burst_recomputes_what_a_warm_first_step_should() -> None:
    """The naive burst's first steps on engines already warm for their profile compute
    their own tokens and nothing of the shared prompt."""
    fleets: dict[str, Fleet] = {}
    scenarios.bench_burst(n_jobs=20, on_fleet=fleets.__setitem__)
    naive = fleets["naive"]
    firsts = [s for s in naive.steps if s.job_id.startswith("b") and s.step == 1]
    warm = [s for s in firsts if s.cached_tokens]
    assert len(warm) >= len(firsts) - 4  # the first of each profile on each engine: cold
    for s in warm:
        family = "ticket-triage" if int(s.job_id[1:]) < 10 else "invoice-reconciliation"
        assert s.cached_tokens == scenarios.BURST_PROFILES[family].shared_prefix, s


def test_jobs_block_keys_never_overlap(monkeypatch: Any) -> None:
    """Each job's own blocks are a run of keys reserved when it starts, as long as its
    last transcript: no two jobs' chains share a key but their family's, the family's
    keys come first (negative) and a chain's keys ascend (``_HeldBlocks._split`` reads
    the family's blocks off that way). Reserving too few would let a long job's later
    blocks hit another job's cached ones."""
    from warmloop.sim.core import Clock
    from warmloop.sim.workload import agentic_mix, bundled_mix, poisson_jobs

    chains: dict[str, list[int]] = {}
    real_chain = Fleet._chain

    def recorded(self: Fleet, job: Any) -> list[Any]:
        chain = real_chain(self, job)
        chains[job.spec.job_id] = list(chain)
        return chain

    monkeypatch.setattr(Fleet, "_chain", recorded)
    rng = random.Random(5)
    specs = poisson_jobs(bundled_mix() + agentic_mix(), rate_per_s=4.0, duration_s=20.0,
                         rng=rng)
    clock = Clock()
    fleet = Fleet(clock, scenarios.cpu_engines(24 * scenarios.MIB),
                  sim_fleet.POLICIES["warmloop"])
    fleet.add_jobs(specs)
    clock.run(until=400.0)
    by_id = {s.job_id: s for s in specs}
    owner: dict[int, str] = {}
    family_keys: dict[str, list[int]] = {}
    finished = 0
    for job_id, chain in chains.items():
        spec = by_id[job_id]
        assert chain == sorted(chain) and len(set(chain)) == len(chain), job_id
        shared = [k for k in chain if k < 0]
        assert len(shared) == min(len(chain), spec.prefix_tokens // fleet.block), job_id
        seen = family_keys.setdefault(spec.family, shared)
        n = min(len(seen), len(shared))
        assert seen[:n] == shared[:n], job_id
        for k in chain[len(shared):]:
            assert owner.setdefault(k, job_id) == job_id, (k, job_id, owner[k])
        last_prompt = (spec.prefix_tokens + spec.task_tokens
                       + sum(st.result_tokens for st in spec.steps[:-1])) // fleet.block
        assert len(chain) <= last_prompt, job_id
        finished += len(chain) == last_prompt
    assert finished > 20  # jobs ran to their last step
    firsts = [keys[0] for keys in family_keys.values() if keys]
    assert len(set(firsts)) == len(firsts) > 1


def test_only_a_router_that_reads_the_block_index_keeps_it() -> None:
    """The fleet's block index is the router's: round-robin, which never reads it, runs
    without one (and routes the same: the recorded digests), cache-aware keeps it up to
    date with every engine's cache."""
    from warmloop.sim.core import Clock
    from warmloop.sim.workload import bundled_mix, poisson_jobs

    specs = poisson_jobs(bundled_mix(), rate_per_s=2.0, duration_s=10.0,
                         rng=random.Random(2))
    for policy, keeps in (("round_robin_lru", False), ("cache_aware_no_holds", True)):
        clock = Clock()
        fleet = Fleet(clock, scenarios.cpu_engines(24 * scenarios.MIB),
                      sim_fleet.POLICIES[policy])
        fleet.add_jobs(specs)
        clock.run(until=30.0)
        assert all((e.cache.index is not None) == keeps for e in fleet.engines), policy
        cached = {k for e in fleet.engines for k in e.cache.ref}
        assert cached, policy
        assert set(fleet.block_index) == (cached if keeps else set()), policy


def test_a_request_short_of_room_takes_the_hold_touched_longest_ago() -> None:
    """Held blocks are pinned in the simulator, touched in vLLM's free queue: when a
    request does not fit beside the holds, vLLM evicts held blocks, least recently
    touched first, rather than queue it. The fleet lets that hold go (counted in
    ``holds_lost``) and never one touched later than another still standing; a fleet
    that holds nothing never asks."""
    import pytest

    from bench.fleet import workload_jobs
    from warmloop.workflows.calibration import preset

    h100 = preset("h100-llama-3.1-8b-bf16")  # with 15 % of its pool: full within minutes
    cal = h100.with_kv_pool_bytes(int(h100.kv_pool_tokens * h100.kv_bytes_per_token * 0.15))
    jobs = workload_jobs(1, 0.9, cal, 400.0, False, 1, "agentic")  # 12 holds lost
    lost: list[float] = []
    choices: list[int] = []  # holds standing at each loss
    real = sim_fleet.Fleet._reclaim

    def reclaim(self: sim_fleet.Fleet, engine: Any) -> bool:
        standing = [h for h in self.holds[engine.engine_id] if h.active]
        touched = {id(h): self._last_touch(h) for h in standing}
        went = real(self, engine)
        gone = [h for h in standing if not h.active]
        assert went == bool(standing) and len(gone) == int(went)
        if went:
            assert touched[id(gone[0])] == min(touched.values())
            lost.append(touched[id(gone[0])])
            choices.append(len(standing))
        return went

    fleets: list[sim_fleet.Fleet] = []
    mp = pytest.MonkeyPatch()
    mp.setattr(sim_fleet.Fleet, "_reclaim", reclaim)
    try:
        simulate(jobs, [cal], "warmloop", until_s=400.0, setup=fleets.append)
        simulate(jobs, [cal], "cache_aware_no_holds", until_s=400.0, setup=fleets.append)
    finally:
        mp.undo()
    warm, plain = fleets
    assert warm.holds_lost == len(lost) > 0 and max(choices) > 1
    assert all(e.reclaim is None for e in plain.engines) and plain.holds_lost == 0


def test_an_opening_prewarm_whose_hold_the_cap_would_let_go_first_is_not_sent() -> None:
    """The simulator's opening pre-warm asks ``holding.hold_lasts_the_wait``, as the
    worker's does, with the engine's held tokens, its oldest hold's age and the learned
    wait from opening to decision; told no, it sends nothing and counts a decline. Where
    the decision comes minutes after the opening and the cap is full, that saves what
    such pre-warms computed and lost."""
    import pytest

    from bench.fleet import workload_jobs
    from warmloop.workflows.calibration import preset

    h100 = preset("h100-llama-3.1-8b-bf16")  # 15 % of its pool: the cap fills
    cal = h100.with_kv_pool_bytes(int(h100.kv_pool_tokens * h100.kv_bytes_per_token * 0.15))
    jobs = workload_jobs(2, 0.8, cal, 300.0, False, 1, "bundled")
    kinds = {holding.viewed_kind(st.pause_kind) for j in jobs for st in j.steps if st.approval}
    learned = [(k, 240.0) for k in kinds for _ in range(30)]  # decided minutes after
    answers: list[bool] = []
    real = holding.hold_lasts_the_wait

    def spy(*args: Any, **kwargs: Any) -> bool:
        answers.append(real(*args, **kwargs))
        return answers[-1]

    def run() -> sim_fleet.Fleet:
        fleets: list[sim_fleet.Fleet] = []

        def setup(f: sim_fleet.Fleet) -> None:
            fleets.append(f)
            f.learn_pauses(learned)

        simulate(jobs, [cal, cal], "warmloop", until_s=300.0, setup=setup)
        return fleets[0]

    mp = pytest.MonkeyPatch()
    mp.setattr(holding, "hold_lasts_the_wait", spy)
    try:
        asked = run()
        mp.setattr(holding, "hold_lasts_the_wait", lambda *a, **k: True)
        always = run()
    finally:
        mp.undo()
    assert answers.count(False) > 0  # its other answers: tests/unit/test_prewarm_on_opening.py
    assert asked.prewarms_declined >= answers.count(False)
    assert asked.prewarm_computed < always.prewarm_computed
