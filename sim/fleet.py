"""The Temporal-like layer: jobs step through route -> generate -> pause -> ... on a fleet
of simulated engines, with warmloop's own policies deciding.

Per step, as ``AgentJob`` and the workers do: the route local activity and the workflow
task (``pre_step_s``), ``workflows.routing.choose_engine`` over the live engines (the
engines' exact cache contents stand in for the precise prefix directory), the engine's
worker taking as many steps at once as ``workers.step_slots`` gives it (the rest wait
in its task queue, in order), the batch lane's admission on that worker
(``workflows.lanes``: AIMD ``next_batch_limit`` on interactive TTFT and
``kv_fit_limit``), the engine, the result's return
(``post_step_s``), the step's price (the engine calibration's ``EnginePrice``), then the
pause: a tool or a human approval. After a step that pauses, the engine's hold manager
asks ``workflows.holding.decide_hold`` (costs from the engine calibration, the pause
kind's observed durations or the profile's prior) and holds the prefix for the chosen
TTL (touches keep the blocks recently used; here, they stay in use), within the 30 %
cap, oldest first. An approval opened half-way, and its decision, prewarm the prompt.
"""

from __future__ import annotations

import heapq
import math
import random
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Final, cast

from warmloop.activities.registry import EngineHeartbeat
from warmloop.sim.core import Clock
from warmloop.sim.engine import BlockKey, Engine, Host, HostSharing, Request
from warmloop.sim.workload import JobSpec
from warmloop.workers.step_slots import StepSlotConfig, step_slots
from warmloop.workflows import holding, lanes, routing
from warmloop.workflows.calibration import EngineCalibration
from warmloop.workflows.contracts import Lane
from warmloop.workflows.holding import HoldConfig, PauseDistribution
from warmloop.workflows.lanes import AdmissionConfig
from warmloop.workflows.routing import EngineCandidate, RoutingConfig


@dataclass(frozen=True)
class Policy:
    """What the fleet does around the engines."""

    name: str
    routing: routing.RoutingPolicy
    hold: holding.HoldPolicy
    lanes: bool
    """Batch steps at vLLM priority 10 behind interactive ones, and admitted K at a time."""
    prewarm: bool
    """Prewarm on an approval's view and decision (the workflow's behaviour)."""


POLICIES: dict[str, Policy] = {
    "round_robin_lru": Policy("round_robin_lru", "round_robin", "never", False, False),
    "cache_aware_no_holds": Policy("cache_aware_no_holds", "cache_aware", "never", False, False),
    "warmloop": Policy("warmloop", "cache_aware", "cost_model", True, True),
}
"""round-robin + vLLM LRU (plain vLLM behind a balancer); cache-aware routing without
holds (the best peer's behaviour); warmloop (routing, holds, lanes, prewarms)."""


@dataclass(slots=True, init=False)
class StepStat:
    """One step as it ran. (Its ``__init__`` is written out: the one ``dataclass``
    writes runs interpreted in the compiled build, once a step.)"""

    job_id: str
    step: int
    engine: str
    lane: Lane
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    ttft_s: float
    cost_usd: float
    keepable_tokens: int
    """What the pause before this step could have kept (the previous prompt's full blocks
    but its last): bench-pauses' measure."""

    def __init__(self, job_id: str, step: int, engine: str, lane: Lane, prompt_tokens: int,
                 cached_tokens: int, output_tokens: int, ttft_s: float, cost_usd: float,
                 keepable_tokens: int) -> None:
        self.job_id = job_id
        self.step = step
        self.engine = engine
        self.lane = lane
        self.prompt_tokens = prompt_tokens
        self.cached_tokens = cached_tokens
        self.output_tokens = output_tokens
        self.ttft_s = ttft_s
        self.cost_usd = cost_usd
        self.keepable_tokens = keepable_tokens


@dataclass(slots=True)
class JobStat:
    job_id: str
    family: str
    lane: Lane
    arrival_s: float
    end_s: float = math.nan
    cost_usd: float = 0.0
    steps: int = 0


@dataclass(slots=True)
class _Job:
    spec: JobSpec
    stat: JobStat
    key: int = 0
    """Base of the job's own block keys (``Fleet._chain``)."""
    shared: int = 0
    """Its family's shared blocks: where its own blocks start in its chain (the caches'
    ``own_from``)."""
    step: int = 0
    transcript: int = 0
    chain: list[BlockKey] = field(default_factory=list)
    last_engine: str | None = None
    hold: _Hold | None = None
    prev_prompt: int = 0
    started_s: float = 0.0
    pending: Engine | None = None
    """The engine serving the job's step under way."""
    unsent: int = -1
    """While an approval waits: the transcript's tokens its opening's pre-warm leaves
    out (the tool's result, not yet run; the decision's sends it); -1: the pre-warm
    sends the transcript and the tail."""


@dataclass(eq=False, slots=True)
class _Hold:
    engine: Engine
    keys: list[BlockKey]
    job: _Job
    active: bool = True
    created: float = 0.0
    used_at: float = 0.0
    """When the held blocks were last used, as far as the fleet has worked out: made,
    touched (``Fleet._last_touch``), or used by one of the job's own requests (a
    pre-warm). It only moves forward: the blocks a hold cut short let go were that old,
    and the rest of it cannot be older when it ends."""
    own_from: int = 0
    """Where its job's own blocks start in its chain (its family's shared blocks)."""


class _HeldBlocks:
    """The blocks an engine's holds keep, each counted once (what the holds' cap
    bounds, as ``HoldManager.held_tokens`` counts them): a job's own blocks are its
    alone, and a family's shared prefix is one chain, so the holds of a family keep
    its longest held run of it."""

    __slots__ = ("own", "shared")

    def __init__(self) -> None:
        self.own = 0
        self.shared: dict[BlockKey, dict[int, int]] = {}
        """Family (its first block's key) -> {shared blocks a hold keeps: holds}."""

    @staticmethod
    def _split(hold: _Hold) -> tuple[int, int]:
        """(shared blocks, own blocks) of the hold's keys (its chain's first blocks)."""
        n = len(hold.keys)
        shared = hold.own_from if hold.own_from < n else n
        return shared, n - shared

    def add(self, hold: _Hold) -> None:
        shared, own = self._split(hold)
        self.own += own
        if shared:
            runs = self.shared.setdefault(hold.keys[0], {})
            runs[shared] = runs.get(shared, 0) + 1

    def remove(self, hold: _Hold) -> None:
        shared, own = self._split(hold)
        self.own -= own
        if shared:
            family = hold.keys[0]
            runs = self.shared[family]
            if runs[shared] > 1:
                runs[shared] -= 1
            else:
                del runs[shared]
                if not runs:
                    del self.shared[family]

    @property
    def blocks(self) -> int:
        return self.own + sum(max(runs) for runs in self.shared.values())


@dataclass
class _Admission:
    k: int
    cfg: AdmissionConfig
    """The fleet's admission settings with this engine's calibration applied
    (``EngineCalibration.admission_config``), as the engine's worker applies them."""
    running: int = 0
    seq: int = 0
    queue: list[tuple[int, float, int, _Job, Request]] = field(default_factory=list)
    ttfts: deque[float] = field(default_factory=lambda: deque(maxlen=20))
    fresh: int = 0
    last_interactive_s: float = 0.0
    last_grow_s: float = 0.0
    samples: deque[tuple[int, int]] = field(default_factory=lambda: deque(maxlen=50))
    version: int = 0
    """Samples taken so far (``fit`` is ``kv_fit_limit`` of the samples at ``fit_version``)."""
    fit: int = 0
    fit_version: int = -1


class _RecentJobs:
    """Batch jobs routed to an engine and when each was last (the registry's batch jobs
    under way): ``count`` is how many were seen within ``recent_s`` of ``now``, the same
    as testing each job's last time, but amortised O(1) (times only grow, so jobs leave
    the window oldest first)."""

    def __init__(self) -> None:
        self.last: dict[str, float] = {}
        self.order: deque[tuple[float, str]] = deque()

    def saw(self, job_id: str, t: float) -> None:
        self.last[job_id] = t
        self.order.append((t, job_id))

    def count(self, now: float, recent_s: float) -> int:
        order, last = self.order, self.last
        while order and now - order[0][0] > recent_s:
            t, job_id = order.popleft()
            if last.get(job_id) == t:
                del last[job_id]
        return len(last)


class _Candidate(EngineCandidate):
    """An ``EngineCandidate`` the fleet fills in place, step after step, without
    validation (its figures are valid by construction), and compares by identity
    (pydantic's field-by-field ``__eq__`` gives the same answer among candidates of
    distinct engine ids, at a Python call each; ``tests/unit/test_sim_equivalence.py``
    checks the decisions against validated ``EngineCandidate`` objects)."""

    __eq__ = object.__eq__


class _EngineName:
    """An engine's id alone: a round-robin candidate (``Fleet._rr_candidates``)."""

    __slots__ = ("engine_id",)

    def __init__(self, engine_id: str) -> None:
        self.engine_id = engine_id


DISPLACED_REFRESH_S = 5.0
"""How long a hold decision reuses an engine's rent measure (``EvictionRegret``): the
workers read theirs at every decision, a sum over up to minutes of recomputes, which a
fleet deciding hundreds of holds a second cannot afford."""
CHURN_PROBE_S = 1.0
"""How often the fleet reads its engines' churn for the holds' touch interval (the
inference workers' heartbeat period)."""
PREWARM_TAIL_TOKENS = 6
"""An approval's pre-warm ends in an empty user turn (``tail=""``) and the generation
prompt: their chat-template tokens on the CPU engines' tiny model."""
FAMILY_KEY_STRIDE = 1_000_003
"""Block keys are ints: family ``f``'s shared blocks ``-(f + 1) * FAMILY_KEY_STRIDE + i``
(negative, so a chain's keys ascend, the family's before the job's own), a job's own
blocks a run of positive ints reserved when it starts (``Fleet._reserve_keys``). Any
distinct keys simulate the same, but an int hashes to itself, so the keys place the
caches' and the index's dict entries: dense runs of consecutive ints spread over a
dict's slots with no collisions and walk a chain through neighbouring memory, where
keys ``job << 32 | i`` (before 2026-12-05) all started their probes at slot ``i`` and
shared their first probes (a lookup 382 against 214 ns over 3.2 million keys). The
stride is odd, so the few families' blocks do not share slots either; a family may
share up to this many blocks."""


_BYTE_BITS: Final = [tuple([k for k in range(8) if b >> k & 1]) for b in range(256)]
"""The bits set in each byte value, ascending (``Fleet._members``)."""


@dataclass
class FleetConfig:
    pre_step_s: float = 0.02
    """Route local activity + workflow task + schedule-to-start + pickup."""
    post_step_s: float = 0.01
    """Work after the last token and the result's return to the workflow."""
    between_steps_s: float = 0.0
    """The workflow's own time from a step's result to the next step's start beyond the
    pause itself: its workflow tasks around the pause and the pause timer's lateness
    (bench-routing measures it: a job's wall time less its stages and scripted pauses)."""
    approval_notice_s: tuple[float, float] = (0.0, 0.0)
    """From an approval's request to its reviewer's clock starting, drawn uniformly from
    this range for each approval (seeded by its job and step): the view and the decision,
    so their pre-warms and the next step, come this much later than the plan's times. A
    reviewer that polls for work notices late (bench-pauses' polls every half second, a
    query a job: its pre-warms came 0.6-2.4 s after the plan's times, 1.3 s at the
    median), and whether an approval's prefix outlives the pool's churn turns on it."""
    approval_notice_seed: int = 0
    """Seeds ``approval_notice_s``' draws with each approval's job and step: runs with one
    seed draw the same lateness for the same approval, whatever their policy or the
    order of their events; another seed, another reviewer's."""
    host_sharing: HostSharing | None = None
    """Engines that share a machine's cores (the CPU benches' two engines on two cores);
    None: each engine its own machine, as GPUs are."""
    routing: RoutingConfig | None = None
    """None: from the engines' calibration (``EngineCalibration.routing_config``)."""
    hold: HoldConfig | None = None
    """None: from the engines' calibration (``EngineCalibration.hold_config``)."""
    admission: AdmissionConfig = field(default_factory=AdmissionConfig)
    batch_recent_s: float = 30.0
    candidates: int = 4
    """Cold engines offered to the router besides those caching the prompt: the least
    loaded (the rest can only lose to them, but for exact ties of load)."""
    step_slots: StepSlotConfig | None = field(default_factory=StepSlotConfig)
    """The inference workers' step slots (``workers.step_slots``): how many steps an
    engine's worker takes at once; the rest wait in its task queue, in order. None: no
    limit (every routed step goes to the engine at once)."""
    decision_refresh: int = 1000
    """Pause samples between refreshes of a kind's distribution, once it has this many
    (before: at every doubling from 20)."""
    hold_pricing: Sequence[EngineCalibration] | None = None
    """Per engine, the calibration the workers' hold model prices re-prefill by: what
    ``warmloop calibrate`` measured on the idle engine, where the engines' own curves say
    how fast they run under the run's load (the CPU benches: an engine calibrates at
    50-105k tokens/s alone; its steps under bench-routing's load show ~26k). None: the
    engines' own."""

    def __post_init__(self) -> None:
        low, high = self.approval_notice_s
        if not 0.0 <= low <= high:
            raise ValueError(f"approval_notice_s must be (low, high) with 0 <= low <= high "
                             f"seconds, got {self.approval_notice_s}: give (s, s) for a "
                             "constant lateness, (0, 0) for none")


class Fleet:
    """Engines, jobs and the policies between them."""

    def __init__(self, clock: Clock, calibrations: Sequence[EngineCalibration], policy: Policy,
                 config: FleetConfig | None = None) -> None:
        self.clock = clock
        self.policy = policy
        self.cfg = config or FleetConfig()
        self.block_index: dict[BlockKey, int] = {}
        """Each cached block key: a bit mask of the engines caching it. The router's
        alone (``_candidates``): under round-robin routing, which never reads it, the
        engines keep none (a fifth of a 128-GPU round-robin run was its upkeep)."""
        self.run_index: dict[int, dict[int, int]] = {}
        """Each job's own run (by its first key): engine number -> its blocks cached
        there (``PrefixCache.run_index``); the router's, beside ``block_index``."""
        cal = calibrations[0]
        self.hold_cfg = self.cfg.hold or cal.hold_config()
        # The cost model's holds price their rent by each pool's evictions, as workers
        # following their engines' KV events do (unless told to price by the model).
        measured = policy.hold == "cost_model" and self.hold_cfg.rent == "measured"
        sharing = self.cfg.host_sharing
        if sharing is not None and sharing.slowdown == 1.0:
            sharing = None  # engines that do not slow each other: as if each had a host
        hosts = ([Host(sharing.slowdown)
                  for _ in range(-(-len(calibrations) // sharing.engines_per_host))]
                 if sharing is not None else [])
        index = None if policy.routing == "round_robin" else self.block_index
        run_index = None if index is None else self.run_index
        self.engines = [Engine(clock, f"e{i:03d}", c, index, i, regret=measured,
                               host=hosts[i // sharing.engines_per_host] if sharing else None,
                               run_index=run_index)
                        for i, c in enumerate(calibrations)]
        first_of: dict[int, Engine] = {}
        for e in self.engines:  # one memo of the curves a calibration
            first = first_of.setdefault(id(e.cal), e)
            if first is not e:
                e.share_curves(first)
        self._displaced: dict[tuple[int, int], tuple[float, float | None]] = {}
        """(engine, prefix bucket) -> (when read, the rent's measure): read at most every
        ``DISPLACED_REFRESH_S`` (a sum over the engine's recent recomputes)."""
        self.by_id = {e.engine_id: e for e in self.engines}
        if self.cfg.hold_pricing is not None and \
                len(self.cfg.hold_pricing) != len(self.engines):
            raise ValueError(f"FleetConfig.hold_pricing has {len(self.cfg.hold_pricing)} "
                             f"calibrations for {len(self.engines)} engines: give one per "
                             "engine, in order")
        self._caches = [e.cache for e in self.engines]
        """Each engine's cache, by engine number (``usage`` is its ``kv_usage``)."""
        self.block = self.engines[0].block
        self.routing_cfg = self.cfg.routing or cal.routing_config()
        self.prices = {e.engine_id: e.cal.engine_price().pricing for e in self.engines}
        self._rr_candidates = cast("list[EngineCandidate]",
                                   [_EngineName(e.engine_id) for e in self.engines])
        """Round-robin's candidates: its ``pick_engine`` orders them by engine id and reads
        nothing else, 128 attribute reads a step, each through pydantic's ``__getattr__``
        hook on an ``EngineCandidate`` (a 128-GPU decision 8.1 against 4.6 us)."""
        self._cands = [_Candidate.model_construct(engine_id=e.engine_id) for e in self.engines]
        self._bits_memo: dict[int, tuple[int, ...]] = {}
        self._families: dict[str, int] = {}
        self._family_keys: dict[int, list[BlockKey]] = {}
        """Each family's shared block keys as one set of int objects that every job's
        chain refers to: a dict lookup that finds the very object it stored compares
        no further, where an equal int elsewhere in memory costs a compare and a cache
        miss (the fleet's caches and index hold millions of keys, far beyond the CPU's
        caches)."""
        self._jobs_started = 0
        self._next_key = 1
        """The first block key no job has reserved (``_reserve_keys``)."""
        self.turn = 0
        self.in_flight = {e.engine_id: 0 for e in self.engines}
        self._load = [0] * len(self.engines)
        """Each engine's load as the router sees it (``EngineCandidate.load``: its
        requests, or the steps routed to it and not finished if more), kept up to date
        from ``_changed`` (``_sync``) instead of read off every engine at every step."""
        self._level = [(1 << len(self.engines)) - 1]
        """Bit masks of the engines at each load (``_load``): the least loaded engines
        of a set are found a level at a time."""
        self._changed: set[int] = set()
        for e in self.engines:
            e.changed = self._changed
        self.batch_seen = {e.engine_id: _RecentJobs() for e in self.engines}
        self._seen = [self.batch_seen[e.engine_id] for e in self.engines]
        """``batch_seen`` by engine number."""
        self._all_engines = (1 << len(self.engines)) - 1
        """The bit mask of every engine."""
        self.admission = {}
        for e in self.engines:
            adm_cfg = e.cal.admission_config(self.cfg.admission)
            self.admission[e.engine_id] = _Admission(k=adm_cfg.k_start, cfg=adm_cfg)
        self.slots_in_use = [0] * len(self.engines)
        """Steps each engine's worker has taken: at the engine or held by admission."""
        self.slot_queue: list[deque[tuple[_Job, Request, bool]]] = [
            deque() for _ in self.engines]
        """Steps routed to an engine waiting for a slot (its Temporal task queue)."""
        self._slot_limits: dict[tuple[int, int, int], int] = {}
        self.holds: dict[str, deque[_Hold]] = {e.engine_id: deque() for e in self.engines}
        """Each engine's holds in the order they were made, the ended ones among them
        until they reach the front (``_oldest_hold``) or outnumber the rest: finding an
        ended hold in the middle was a walk of the deque, 3 % of a large run."""
        self._active_holds = {e.engine_id: 0 for e in self.engines}
        self.held = {e.engine_id: _HeldBlocks() for e in self.engines}
        self._room_release: dict[str, tuple[float, float]] = {
            e.engine_id: (-math.inf, 0.0) for e in self.engines}
        """Per engine, when its last hold was let go for room, and that hold's age."""
        self.churn = {e.engine_id: holding.ChurnMeter() for e in self.engines}
        """Each engine's churn as its worker measures it, for the holds' touch interval."""
        self.prewarms_declined = 0
        """Approvals' openings not pre-warmed: holding to the decision did not pay."""
        self.holds_lost = 0
        """Holds whose blocks a request short of room took (``_reclaim``)."""
        if self.policy.hold != "never":  # the touch interval reads it
            self.clock.after(CHURN_PROBE_S, self._probe_churn)
            for e in self.engines:
                e.reclaim = self._reclaim
        self.pause_samples: dict[str, deque[float]] = {}
        """The last 400 pauses of each kind (all ``_distribution`` reads)."""
        self.pause_counts: dict[str, int] = {}
        self._dist: dict[str, tuple[int, PauseDistribution]] = {}
        self._decisions: dict[tuple[object, ...], holding.HoldChoice] = {}
        self.steps: list[StepStat] = []
        self.jobs: list[JobStat] = []
        self.prewarm_computed = 0
        self.prewarm_cached: list[int] = []
        """Each pre-warm's cached prompt tokens, as it ended (``bench.sim_fidelity`` sets
        them beside the workers' logged pre-warms)."""
        self.call_times: list[tuple[str, int, float]] | None = None
        """Set to a list to have every agent call's end recorded as (job id, the number
        of its step or, for a pre-warm, of the step before it, when it ended), as the
        inference workers log them (``bench.sim_fidelity`` times the approvals' pre-warms
        against the plan by it); None (default): not recorded."""
        self.hold_decisions: dict[str, int] = {}
        self.other_ttfts: list[float] = []
        self.on_job_end: list[Callable[[JobStat], None]] = []
        self.background_stopped = False

    # --- jobs ------------------------------------------------------------------------

    def add_jobs(self, specs: Sequence[JobSpec]) -> None:
        """Start each job at its arrival. The arrivals wait in a list of their own, in
        order, the next of them alone among the clock's events: a run's 100,000 jobs in
        the event heap made every push and pop of it two levels deeper (its pops were
        7 % of a 128-GPU round-robin run). Jobs of one arrival time start in the order
        given. Each arrival keeps the event number it had when all were scheduled at once
        (``Clock.reserve``), so every event runs in the same order as then."""
        if not specs:
            return
        first = self.clock.reserve(len(specs))
        order = sorted(range(len(specs)), key=lambda i: specs[i].arrival_s)  # stable
        arrivals = [(specs[i], first + i) for i in order]
        spec, number = arrivals[0]
        self.clock.at_number(spec.arrival_s, number, self._arrive, arrivals, 0)

    def _arrive(self, arrivals: list[tuple[JobSpec, int]], i: int) -> None:
        if i + 1 < len(arrivals):
            spec, number = arrivals[i + 1]
            self.clock.at_number(spec.arrival_s, number, self._arrive, arrivals, i + 1)
        self._start(arrivals[i][0])

    def _start(self, spec: JobSpec) -> None:
        stat = JobStat(spec.job_id, spec.family, spec.lane, self.clock.now)
        self.jobs.append(stat)
        self._jobs_started += 1
        shared = spec.prefix_tokens // self.block
        job = _Job(spec, stat, key=self._reserve_keys(spec, shared), shared=shared,
                   transcript=spec.prefix_tokens + spec.task_tokens, started_s=self.clock.now)
        self.clock.after(self.cfg.pre_step_s, self._route_step, job)

    def _reserve_keys(self, spec: JobSpec, shared: int) -> int:
        """The base of a new job's own block keys: block ``i`` (from the family's
        ``shared`` blocks on) is ``base + i``, one run of ints no other job's keys
        overlap, as long as the job's last transcript (every step's result added)."""
        if shared > FAMILY_KEY_STRIDE:
            raise ValueError(f"job {spec.job_id}: a prefix of {shared} blocks is more "
                             f"than the simulator's {FAMILY_KEY_STRIDE} a family")
        last = (spec.prefix_tokens + spec.task_tokens
                + sum(st.result_tokens for st in spec.steps)) // self.block
        base = self._next_key - shared
        self._next_key += max(0, last - shared)
        return base

    def _chain(self, job: _Job) -> list[BlockKey]:
        """Keys of the prompt's stable full blocks: the family's prefix blocks, then the
        job's own (append-only, so a block's key never changes once it is full)."""
        block = self.block
        spec = job.spec
        n = job.transcript // block
        chain = job.chain
        if len(chain) < n:
            shared = job.shared
            family = self._families.get(spec.family)
            if family is None:
                family = self._families[spec.family] = -(
                    (len(self._families) + 1) * FAMILY_KEY_STRIDE)
            # block i's key is family + i before ``shared``, own + i after: two ranges
            start = len(chain)
            if start < shared:
                keys = self._family_keys.setdefault(family, [])
                upto = min(n, shared)
                if len(keys) < upto:
                    keys.extend(range(family + len(keys), family + upto))
                chain.extend(keys[start:upto])
            if n > shared:
                own = job.key
                chain.extend(range(own + max(start, shared), own + n))
        return chain

    def _bits(self, mask: int) -> tuple[int, ...]:
        """Engine numbers in ``mask``, ascending."""
        got = self._bits_memo.get(mask)
        if got is None:
            got = tuple(self._members(mask))
            if len(self._bits_memo) > 4096:
                self._bits_memo.clear()
            self._bits_memo[mask] = got
        return got

    def _warm_groups(self, chain: list[BlockKey], own_from: int = -1
                     ) -> list[tuple[int, int]]:
        """The engines caching any of ``chain``, grouped by how many of its leading
        blocks they cache: (blocks, bit mask of engine numbers), fewest blocks first;
        read off the fleet's block index. A chain's cached blocks are a prefix of it on
        every engine (see ``PrefixCache``), so the engines caching block i include those
        caching block i + 1, and the masks only change at a few places a binary search
        finds. The chain's own part from ``own_from`` (a job's run) is read off
        ``run_index`` when some engine has it: those engines cache the whole shared part
        before it, and their group splits by how much of the run each caches."""
        index = self.block_index
        n = len(chain)
        runs = self.run_index.get(chain[own_from]) if 0 <= own_from < n else None
        full = n
        if runs:
            n = own_from
        cur = index.get(chain[0], 0) if n else 0
        out: list[tuple[int, int]] = []
        lo = 0
        while cur:
            a, b = lo, n  # chain[a]'s mask is cur; chain[b]'s is not (b == n: no block)
            while b - a > 1:
                mid = (a + b) >> 1
                if index.get(chain[mid], 0) == cur:
                    a = mid
                else:
                    b = mid
            nxt = index.get(chain[b], 0) if b < n else 0
            out.append((b, cur & ~nxt))
            cur, lo = nxt, b
        if runs:
            own = full - n
            # the engines caching the whole shared part: split by how much of the run
            rest = out.pop()[1] if out and out[-1][0] == n else 0
            by: dict[int, int] = {}
            for owner, cached in runs.items():
                hit = n + (cached if cached < own else own)
                by[hit] = by.get(hit, 0) | (1 << owner)
                rest &= ~(1 << owner)
            if rest:
                out.append((n, rest))
            out += sorted(by.items())
        return out

    def _warm(self, chain: list[BlockKey], own_from: int = -1) -> dict[int, int]:
        """Engine number -> leading blocks of ``chain`` it caches, for every engine that
        caches any, in engine order: each engine's ``hit_blocks`` (``_warm_groups``)."""
        groups = self._warm_groups(chain, own_from)
        out = [(i, b) for b, mask in groups for i in self._bits(mask)]
        if len(groups) > 1:
            out.sort()
        return dict(out)

    def _sync(self) -> None:
        """Bring ``_load`` and ``_level`` up to date with the engines that changed."""
        changed = self._changed
        if not changed:
            return
        engines, in_flight, loads, level = self.engines, self.in_flight, self._load, self._level
        for i in changed:
            e = engines[i]
            new = max(len(e.waiting) + len(e.prefilling) + len(e.running),
                      in_flight[e.engine_id])
            old = loads[i]
            if new != old:
                bit = 1 << i
                level[old] &= ~bit
                while len(level) <= new:
                    level.append(0)
                level[new] |= bit
                loads[i] = new
        changed.clear()

    @staticmethod
    def _members(mask: int) -> list[int]:
        """Engine numbers in ``mask``, ascending (``_bits`` without the memo: for masks
        that change at every step). A byte of the mask at a time (``_BYTE_BITS``): a
        128-engine fleet's masks are boxed ints, where taking off a bit at a time cost
        three of them an engine (a mask of 70 engines 6.7 against 0.9 us compiled)."""
        out: list[int] = []
        if not mask:
            return out
        raw = mask.to_bytes((mask.bit_length() + 7) >> 3, "little")
        for j in range(len(raw)):
            byte = raw[j]
            if byte:
                base = j << 3
                for k in _BYTE_BITS[byte]:
                    out.append(base + k)
        return out

    def _coldest(self, warm: int) -> list[int]:
        """The ``FleetConfig.candidates`` engines outside the bit mask ``warm`` of least
        (load, KV usage), ties in engine order: load level by load level, KV usage read
        only on the levels taken."""
        need = self.cfg.candidates
        out: list[int] = []
        if need <= 0:
            return out
        cold = self._all_engines & ~warm
        caches = self._caches
        for mask in self._level:
            if not mask:
                continue
            m = mask & cold
            if not m:
                continue
            # the level's ``need - len(out)`` first by (KV usage, engine number), as a
            # sort of them all would give, kept in order as the members go by (in
            # ascending number: one of equal usage goes after those kept before it)
            take = need - len(out)
            used: list[float] = []
            kept: list[int] = []
            for i in self._members(m):
                u = caches[i].usage
                n = len(used)
                if n == take:
                    if u >= used[n - 1]:
                        continue
                    used.pop()
                    kept.pop()
                    n -= 1
                while n and used[n - 1] > u:
                    n -= 1
                used.insert(n, u)
                kept.insert(n, i)
            out += kept
            if len(out) >= need:
                break
        return out

    def _candidates(self, chain: list[BlockKey], batch_first: bool,
                    last_engine: str | None = None, *, prune: bool = True,
                    own_from: int = -1) -> list[EngineCandidate]:
        """The candidates the router is offered: the engines caching the prompt and the
        ``FleetConfig.candidates`` least loaded cold ones (``prune``: of the former,
        only those that can win, ``_undominated``; ``choose_engine`` decides the same)."""
        self._sync()
        now = self.clock.now
        engines = self.engines
        in_flight = self.in_flight
        recent = self.cfg.batch_recent_s
        seen = self._seen
        last = self.by_id[last_engine].owner if last_engine is not None else -1
        if prune:
            groups = self._warm_groups(chain, own_from)
            warm_mask = 0
            for _, mask in groups:
                warm_mask |= mask
            offered, batch_jobs = self._undominated(groups, batch_first, last)
        else:
            warm = self._warm(chain, own_from)
            warm_mask = 0
            for i in warm:
                warm_mask |= 1 << i
            offered = list(warm.items())
            batch_jobs = {i: seen[i].count(now, recent)
                          for i in warm} if batch_first else {}
        cold = self._coldest(warm_mask)
        if batch_first:
            batch_jobs.update((i, seen[i].count(now, recent)) for i in cold)
        elif prune and len(cold) > 1:
            cold = self._tied_coldest(cold, last)
        out: list[EngineCandidate] = []
        cands = self._cands
        for i, blocks in [*offered, *((i, 0) for i in cold)]:
            e = engines[i]
            c = cands[i]
            d = c.__dict__
            d["expected_cached_tokens"] = blocks * e.block
            d["running"] = len(e.running) + len(e.prefilling)
            d["waiting"] = len(e.waiting)
            d["in_flight"] = in_flight[e.engine_id]
            d["kv_usage"] = min(1.0, e.cache.usage)
            d["batch_jobs"] = batch_jobs.get(i, 0)
            out.append(c)
        return out

    def _tied_coldest(self, cold: list[int], last: int) -> list[int]:
        """Of ``cold`` (``_coldest``: least (load, KV usage) first), those ``choose_engine``
        could pick: the first, any tied with it on both, and the step's last engine
        (number ``last``, -1: none; it wins near-ties). Nothing cached, their scores fall
        as their load grows, so the first scores highest of them (the best score and the
        load threshold see the same) and comes first by (load, KV usage) among the tied;
        only a new batch job's placement load, which counts batch jobs too, orders them
        otherwise (not pruned). ``tests/unit/test_sim_equivalence.py`` checks it at every
        decision."""
        loads, caches = self._load, self._caches
        first = cold[0]
        load, usage = loads[first], min(1.0, caches[first].usage)
        return [i for i in cold
                if (loads[i] == load and min(1.0, caches[i].usage) == usage) or i == last]

    def _undominated(self, groups: list[tuple[int, int]], batch_first: bool,
                     last: int) -> tuple[list[tuple[int, int]], dict[int, int]]:
        """The warm engines ``choose_engine`` could pick, as (engine number, cached
        blocks), and for a new batch job the batch jobs under way on each warm engine.

        They are the step's last engine (number ``last``, -1: none) and, among engines
        with the same cached prefix (so the same saving), those no other beats on both
        counts that decide: none has a placement load as low (so a score as high: the
        score falls as the load grows) and a lower (load, KV usage) (what breaks ties).
        Whatever the best score and the load threshold, an engine with the same saving
        that is tied, or under the threshold, has such a rival tied, or under it, too,
        and the rival comes first; the best score is among the rivals. So
        ``choose_engine`` decides the same on these as on all of them
        (``tests/unit/test_sim_equivalence.py`` checks it at every decision of runs). A
        step's placement load is its load, so the rivals are the group's least loaded
        engines of least KV usage, found a load level at a time; a new batch job's counts
        the engine's batch jobs too."""
        caches = self._caches
        loads = self._load
        keep: list[tuple[int, int]] = []
        batch_jobs: dict[int, int] = {}
        now, recent, seen = self.clock.now, self.cfg.batch_recent_s, self._seen
        last_kept = False
        for blocks, mask in groups:
            if batch_first:
                # Ranked by (placement load, load, KV usage, number), an engine is kept
                # when its (load, KV usage) is no higher than the last kept one's: of
                # each placement load, the engines of its least (load, KV usage) if no
                # higher than those kept at a lower placement load (the same, without
                # the sort: a burst's first steps find the family's prefix on most of
                # the fleet).
                low_load: dict[int, int] = {}
                low_usage: dict[int, float] = {}
                who: dict[int, list[int]] = {}
                for i in self._members(mask):
                    jobs = seen[i].count(now, recent)
                    batch_jobs[i] = jobs
                    load = loads[i]
                    usage = min(1.0, caches[i].usage)
                    placed = load if load >= jobs else jobs
                    cur = low_load.get(placed, -1)
                    if cur < 0 or load < cur or (load == cur and usage < low_usage[placed]):
                        low_load[placed] = load
                        low_usage[placed] = usage
                        who[placed] = [i]
                    elif load == cur and usage == low_usage[placed]:
                        who[placed].append(i)
                best_load, best_usage = -1, 0.0
                for placed in sorted(who):
                    load, usage = low_load[placed], low_usage[placed]
                    if best_load < 0 or load < best_load or (load == best_load
                                                            and usage <= best_usage):
                        for i in who[placed]:
                            keep.append((i, blocks))
                            last_kept = last_kept or i == last
                        best_load, best_usage = load, usage
                continue
            if mask & (mask - 1):  # more than one: the least loaded, then least used
                for level in self._level:
                    if level and level & mask:  # (most levels are empty: no boxed int)
                        mask &= level
                        break
                if mask & (mask - 1):
                    members = self._members(mask)
                    used = [min(1.0, caches[i].usage) for i in members]
                    lowest = min(used)
                    members = [i for i, u in zip(members, used, strict=True) if u == lowest]
                else:
                    members = [mask.bit_length() - 1]
            else:
                members = [mask.bit_length() - 1]
            keep += [(i, blocks) for i in members]
            last_kept = last_kept or last in members
        if last >= 0 and not last_kept:
            keep += [(last, blocks) for blocks, mask in groups if mask >> last & 1]
        return keep, batch_jobs

    def route(self, job_id: str, chain: list[BlockKey], last_engine: str | None,
              batch: bool, own_from: int = -1) -> Engine:
        """The engine ``workflows.routing.choose_engine`` picks for a step (its
        ``pick_engine``: the decision without the record the workers keep)."""
        if self.policy.routing == "round_robin":
            chosen, _, _ = routing.pick_engine(self._rr_candidates, job_id=job_id,
                                               policy="round_robin", turn=self.turn)
            self.turn += 1
        else:
            chosen, _, _ = routing.pick_engine(
                self._candidates(chain, batch and last_engine is None, last_engine,
                                 own_from=own_from),
                job_id=job_id,
                last_engine=last_engine, config=self.routing_cfg, policy=self.policy.routing,
                batch=batch)
        return self.by_id[chosen.engine_id]

    def _route_step(self, job: _Job) -> None:
        spec = job.spec
        batch = spec.lane == Lane.BATCH and self.policy.lanes
        chain = self._chain(job)
        engine = self.route(spec.job_id, chain, job.last_engine, batch, job.shared)
        if batch:
            self.batch_seen[engine.engine_id].saw(spec.job_id, self.clock.now)
        prompt = job.transcript + spec.tail_tokens
        out = spec.steps[job.step].output_tokens
        req = Request(chain=chain, prompt_tokens=prompt, output_tokens=out,
                      priority=lanes.VLLM_PRIORITY[spec.lane] if self.policy.lanes else 0,
                      on_first_token=self._first_token, on_done=self._step_done, tag=job,
                      own_from=job.shared)
        self.in_flight[engine.engine_id] += 1
        self._changed.add(engine.owner)
        job.pending = engine
        if job.hold is not None and job.hold.engine is not engine:
            self._end_hold(job.hold)
        self.slot_queue[engine.owner].append((job, req, batch))
        self._fill_slots(engine)

    # --- step slots (workers.step_slots) ------------------------------------------------

    def _slot_limit(self, engine: Engine) -> int:
        """``step_slots`` of the engine's worker as its heartbeat would describe it now
        (its calibration, KV size and batch admission), memoised on what it reads."""
        if self.cfg.step_slots is None:
            return 1 << 62
        adm = self.admission[engine.engine_id]
        batch_limit = adm.k if self.policy.lanes else None
        key = (id(engine.cal), batch_limit or 0, len(adm.queue))
        got = self._slot_limits.get(key)
        if got is None:
            hb = EngineHeartbeat(
                engine_id=engine.engine_id, task_queue="", model="", url="", healthy=True,
                block_size=engine.block, kv_capacity_tokens=engine.cal.kv_pool_tokens,
                batch_limit=batch_limit, batch_waiting=len(adm.queue),
                calibration=engine.cal, at=0.0)
            got = self._slot_limits[key] = step_slots(hb, self.cfg.step_slots).slots
            if len(self._slot_limits) > 100_000:
                self._slot_limits.clear()
        return got

    def _fill_slots(self, engine: Engine) -> None:
        """Start the engine's waiting steps while its worker has slots, in order."""
        owner = engine.owner
        waiting = self.slot_queue[owner]
        in_use = self.slots_in_use
        while waiting and in_use[owner] < self._slot_limit(engine):
            job, req, batch = waiting.popleft()
            in_use[owner] += 1
            if batch:
                self._admit_batch(engine, job, req)
            else:
                engine.submit(req)

    # --- batch admission (workflows.lanes) ----------------------------------------------

    def _limit(self, engine: Engine, adm: _Admission) -> int:
        if adm.fit_version != adm.version:  # a pure function of the samples: once each
            adm.fit = lanes.kv_fit_limit(engine.cal.kv_pool_tokens, list(adm.samples),
                                         adm.cfg, block_tokens=engine.cal.block_size)
            adm.fit_version = adm.version
        fit = adm.fit
        return min(adm.k, fit) if fit > 0 else adm.k

    def _admit_batch(self, engine: Engine, job: _Job, req: Request) -> None:
        adm = self.admission[engine.engine_id]
        # continuing jobs first (oldest job first), then new jobs in arrival order
        key = (0 if job.step > 0 else 1, job.started_s if job.step > 0 else self.clock.now)
        adm.seq += 1  # FIFO among equal keys (not id(): memory addresses vary by run)
        heapq.heappush(adm.queue, (key[0], key[1], adm.seq, job, req))
        self._drain(engine, adm)

    def _drain(self, engine: Engine, adm: _Admission) -> None:
        now = self.clock.now
        cfg = adm.cfg
        if now - adm.last_interactive_s > cfg.idle_grow_s and now - adm.last_grow_s > \
                cfg.idle_grow_s:
            adm.k = lanes.next_batch_limit(adm.k, None, cfg)
            adm.last_grow_s = now
        # The limit is never above K (``_limit``), so at K or over nothing starts, and
        # it is 0 exactly when K is: its KV fit (``lanes.kv_fit_limit``, interpreted, over
        # the last 50 samples, which change at every batch step) is worked out only
        # where it decides (a burst's lanes sit at K for most of the steps).
        while adm.queue and adm.running < adm.k and adm.running < self._limit(engine, adm):
            _, _, _, job, req = heapq.heappop(adm.queue)
            adm.running += 1
            engine.submit(req)
        if adm.queue and adm.running == 0 and adm.k == 0:
            self.clock.after(cfg.idle_grow_s, self._drain, engine, adm)

    def _interactive_ttft(self, engine: Engine, ttft_s: float) -> None:
        adm = self.admission[engine.engine_id]
        adm.ttfts.append(ttft_s * 1000)
        adm.last_interactive_s = self.clock.now
        adm.fresh += 1
        if adm.fresh >= adm.ttfts.maxlen:  # type: ignore[operator]
            adm.fresh = 0
            ordered = sorted(adm.ttfts)
            p95 = ordered[min(len(ordered) - 1, int(math.ceil(0.95 * len(ordered))) - 1)]
            adm.k = lanes.next_batch_limit(adm.k, p95, adm.cfg)

    # --- step results --------------------------------------------------------------------

    def _first_token(self, req: Request) -> None:
        job: _Job = req.tag  # type: ignore[assignment]
        if job.hold is not None:
            self._end_hold(job.hold, used_now=job.hold.engine is job.pending)
        if job.spec.lane == Lane.INTERACTIVE and self.policy.lanes and job.pending is not None:
            self._interactive_ttft(job.pending, req.ttft_s)

    def _step_done(self, req: Request) -> None:
        job: _Job = req.tag  # type: ignore[assignment]
        engine = job.pending
        assert engine is not None, "a step finished on no engine"
        self.in_flight[engine.engine_id] -= 1
        self._changed.add(engine.owner)
        self.slots_in_use[engine.owner] -= 1
        spec = job.spec
        if self.call_times is not None:
            self.call_times.append((spec.job_id, job.step + 1, self.clock.now))
        batch = spec.lane == Lane.BATCH and self.policy.lanes
        if batch:
            adm = self.admission[engine.engine_id]
            adm.running -= 1
            adm.samples.append((req.prompt_tokens, spec.prefix_tokens))
            adm.version += 1
            self._drain(engine, adm)
        self._fill_slots(engine)
        if job.hold is not None and job.hold.engine is engine:
            # held anew while the step ran (a late pre-warm's pin): it used the blocks
            # until now, so they cannot be let go as of an earlier touch
            job.hold.used_at = max(job.hold.used_at, self.clock.now)
        price = self.prices[engine.engine_id]
        cost = price.cost(prompt_tokens=req.prompt_tokens, cached_tokens=req.cached_tokens,
                          completion_tokens=req.output_tokens)
        block = engine.block
        keepable = max(0, (job.prev_prompt // block - 1) * block) if job.step > 0 else 0
        self.steps.append(StepStat(spec.job_id, job.step + 1, engine.engine_id, spec.lane,
                                   req.prompt_tokens, req.cached_tokens, req.output_tokens,
                                   req.ttft_s, cost, keepable))
        job.stat.cost_usd += cost
        job.stat.steps += 1
        job.prev_prompt = req.prompt_tokens
        job.last_engine = engine.engine_id
        step = spec.steps[job.step]
        job.transcript += step.result_tokens
        job.unsent = (step.result_tokens - step.call_tokens
                      if step.approval and step.call_tokens is not None else -1)
        job.step += 1
        if job.step >= len(spec.steps):
            self.clock.after(self.cfg.post_step_s, self._end_job, job)
            return
        notice = self._approval_notice(job) if step.approval else 0.0
        pause = step.pause_s + notice
        self._record_pause(step.pause_kind, pause)
        if step.approval and step.viewed_after_s is not None:
            # opened to decided, as the workflow records it at the decision
            self._record_pause(holding.viewed_kind(step.pause_kind),
                               max(0.0, step.pause_s - step.viewed_after_s))
        self._maybe_hold(job, engine, step.pause_kind, req)
        if step.approval and self.policy.prewarm and step.viewed_after_s is not None:
            self.clock.after(self.cfg.post_step_s + notice + step.viewed_after_s,
                             self._prewarm, job, True, step.pause_kind)
        self.clock.after(self.cfg.post_step_s + pause + self.cfg.between_steps_s, self._resume,
                         job, step.approval)

    def _approval_notice(self, job: _Job) -> float:
        """``FleetConfig.approval_notice_s`` drawn for the approval after ``job``'s step
        (seeded by ``approval_notice_seed``, the job and the step, not the order of
        events)."""
        low, high = self.cfg.approval_notice_s
        if high <= low:
            return low
        seed = f"{self.cfg.approval_notice_seed}/{job.spec.job_id}/{job.step}"
        return random.Random(seed).uniform(low, high)

    def _resume(self, job: _Job, approval: bool) -> None:
        if approval and self.policy.prewarm:
            self._prewarm(job, False, answered=True)
        self.clock.after(self.cfg.pre_step_s, self._route_step, job)

    def _end_job(self, job: _Job) -> None:
        job.stat.end_s = self.clock.now
        if job.hold is not None:
            self._end_hold(job.hold)
        for hook in self.on_job_end:
            hook(job.stat)

    def add_batch(self, specs: Sequence[JobSpec], *, window: int, at_s: float = 0.0) -> None:
        """A ``BatchRun``: ``specs`` run ``window`` at a time, the next starting as one
        ends (its arrival time is when it starts)."""
        pending = deque(specs)
        mine = {s.job_id for s in specs}

        def start_next() -> None:
            if pending:
                spec = pending.popleft()
                spec.arrival_s = self.clock.now
                self._start(spec)

        def ended(stat: JobStat) -> None:
            if stat.job_id in mine:
                start_next()

        self.on_job_end.append(ended)
        for _ in range(min(window, len(pending))):
            self.clock.at(at_s, start_next)

    # --- prewarms ----------------------------------------------------------------------

    def _prewarm(self, job: _Job, hold: bool, kind: str = "", *,
                 answered: bool = False) -> None:
        """Pre-warm the job's prompt: on its approval's decision, or (``hold``) on its
        opening, holding it to the decision. ``answered``: the decision's, which the
        workflow sends beside the approved call (``PATCH_DECISION_BESIDE_TOOL``), after
        the decision's records: a replayed job's recorded answer is in its transcript by
        then (bench-pauses'), and so is a live tool's that returns within that time.
        Under the cost model an opening's pre-warm is made only where holding from the
        opening to the decision (``kind``'s ``viewed_kind``) pays and the cap would not let
        the hold go first (``holding.hold_lasts_the_wait``); otherwise the decision's
        pre-warm computes the prompt once, where an opening's pre-warm let go before the
        decision computes it twice."""
        chain = self._chain(job)
        engine = self.route(job.spec.job_id, chain, job.last_engine,
                            job.spec.lane == Lane.BATCH and self.policy.lanes, job.shared)
        if not holding.prewarm_worthwhile(len(engine.waiting)):
            return  # the worker's prewarm activity skips it too
        hold_s = self.hold_cfg.always_hold_ttl_s
        if hold and kind and self.policy.hold == "cost_model":
            viewed = holding.viewed_kind(kind)
            choice = self._hold_choice(job, engine, viewed, counted=False)
            if choice.action != holding.HoldAction.HOLD or not self._hold_lasts(
                    job, engine, viewed):
                self.prewarms_declined += 1
                return
            hold_s = choice.ttl_s * self.hold_cfg.ttl_slack
        if job.hold is not None and job.hold.engine is not engine:
            self._end_hold(job.hold)
        if job.unsent >= 0:  # the transcript as it stands and the empty tail
            sent = job.transcript - (0 if answered else job.unsent)
            prompt = sent + PREWARM_TAIL_TOKENS
            chain = chain[:sent // self.block]
        else:
            prompt = job.transcript + job.spec.tail_tokens

        after_step = job.step

        def done(req: Request) -> None:
            self.prewarm_computed += req.computed_tokens
            self.prewarm_cached.append(req.cached_tokens)
            if self.call_times is not None:
                self.call_times.append((job.spec.job_id, after_step, self.clock.now))
            if req.first_token_at and job.hold is not None and job.hold.engine is engine:
                job.hold.used_at = self.clock.now  # the pre-warm used the held blocks
            if hold and self.policy.hold != "never" and job.step < len(job.spec.steps):
                self._pin(job, engine, hold_s)

        engine.submit(Request(chain=chain, prompt_tokens=prompt, output_tokens=1,
                              priority=0, on_done=done, tag=None, own_from=job.shared))
        job.last_engine = engine.engine_id

    def _hold_lasts(self, job: _Job, engine: Engine, kind: str) -> bool:
        """``HoldManager.lasts_the_wait``: a hold of the job's last prompt made now on
        ``engine`` would last through a pause of ``kind``."""
        if job.hold is not None and job.hold.engine is engine:
            return True
        eid = engine.engine_id
        oldest = self._oldest_hold(eid)
        now = self.clock.now
        at, age = self._room_release[eid]
        return holding.hold_lasts_the_wait(
            self.held[eid].blocks * engine.block, job.prev_prompt,
            engine.cal.kv_pool_tokens, self.hold_cfg.max_held_fraction,
            oldest_age_s=None if oldest is None else now - oldest.created,
            turnover_s=holding.cap_turnover_s(at, age, now),
            wait=self._distribution(job, kind)[1])

    # --- holds (workflows.holding) ---------------------------------------------------------

    def learn_pauses(self, pauses: Iterable[tuple[str, float]]) -> None:
        """Start from pauses already seen, ``(kind, seconds)`` each: a fleet whose
        statistics hold the workload's pauses, as a bench stack's Redis does after its
        first runs (``bench-pauses`` seeds it with the same plans)."""
        for kind, seconds in pauses:
            self._record_pause(kind, seconds)

    def _record_pause(self, kind: str, seconds: float) -> None:
        if kind:
            got = self.pause_samples.get(kind)
            if got is None:
                got = self.pause_samples[kind] = deque(maxlen=400)
            got.append(seconds)
            self.pause_counts[kind] = self.pause_counts.get(kind, 0) + 1

    def _distribution(self, job: _Job, kind: str) -> tuple[int, PauseDistribution]:
        n = self.pause_counts.get(kind, 0)
        # Refresh as the statistics grow (at 20, 40, 80, ... samples, then every
        # ``decision_refresh``): the decisions are memoised per version.
        version = 0 if n < 20 else (n.bit_length() if n < self.cfg.decision_refresh
                                    else 100 + n // self.cfg.decision_refresh)
        cached = self._dist.get(kind)
        if cached is not None and cached[0] == version:
            return cached
        median, p90 = job.spec.prior.get(
            kind, holding.VIEWED_PRIOR_S if holding.is_viewed_kind(kind) else (1.0, 5.0))
        # The last 400 observed pauses, as 99 quantiles: decide_hold's search is
        # quadratic in its points, and a fleet decides hundreds of holds a second.
        recent = sorted(self.pause_samples.get(kind, ()))
        usable = tuple(recent[min(len(recent) - 1, int((i + 0.5) / 99 * len(recent)))]
                       for i in range(99)) if n >= 20 else ()
        dist = PauseDistribution(samples=usable, prior_median_s=median,
                                 prior_p90_s=max(p90, median))
        self._dist[kind] = (version, dist)
        return version, dist

    def _maybe_hold(self, job: _Job, engine: Engine, kind: str, req: Request) -> None:
        policy = self.policy.hold
        if policy == "never" or not kind:
            return
        if policy == "always_hold":
            self._pin(job, engine, self.hold_cfg.always_hold_ttl_s)
            return
        choice = self._hold_choice(job, engine, kind)
        if choice.action == holding.HoldAction.HOLD:
            self._pin(job, engine, choice.ttl_s * self.hold_cfg.ttl_slack)

    def _hold_choice(self, job: _Job, engine: Engine, kind: str, *, counted: bool = True
                     ) -> holding.HoldChoice:
        """The cost model's decision for the job's prompt on ``engine`` through a pause
        of ``kind`` (``holding.decide_hold``, memoised by what it depends on);
        ``counted``: in ``hold_decisions`` (the steps' holds)."""
        version, dist = self._distribution(job, kind)
        cal = engine.cal if self.cfg.hold_pricing is None else \
            self.cfg.hold_pricing[engine.owner]
        prefix = len(job.chain) * engine.block
        usage = round(min(0.95, engine.kv_usage) * 20) / 20
        lane_usd = (self.hold_cfg.batch_latency_usd_per_s if job.spec.lane == Lane.BATCH
                    else self.hold_cfg.interactive_latency_usd_per_s)
        displaced = self._displaced_level(engine, prefix)
        key = (kind, version, prefix // 256, usage, lane_usd, id(cal), displaced)
        choice = self._decisions.get(key)
        if choice is None:
            costs = cal.hold_costs(prefix_tokens=max(1, prefix // 256 * 256 + 128),
                                   kv_usage=usage, latency_usd_per_s=lane_usd)
            if displaced is not None:
                costs = costs.model_copy(update={
                    "displaced_tokens_per_s": 2 ** (displaced / 4) - 1,
                    "displaced_latency_usd_per_s":
                        self.hold_cfg.interactive_latency_usd_per_s})
            choice = holding.decide_hold(costs, dist)
            if len(self._decisions) > 200_000:
                self._decisions.clear()
            self._decisions[key] = choice
        if counted:
            self.hold_decisions[choice.action.value] = self.hold_decisions.get(
                choice.action.value, 0) + 1
        return choice

    def _displaced_level(self, engine: Engine, prefix_tokens: int) -> int | None:
        """The engine's ``EvictionRegret`` for a hold of ``prefix_tokens``, in quarter
        steps of log2(1 + tokens/s) (decisions are memoised by it); None before the
        regret has a measure."""
        if engine.regret is None:
            return None
        now = self.clock.now
        key = (engine.owner, prefix_tokens // 256)
        got = self._displaced.get(key)
        if got is None or now - got[0] >= DISPLACED_REFRESH_S:
            rate = engine.regret.displaced_tokens_per_s(prefix_tokens // 256 * 256 + 128, now)
            got = self._displaced[key] = (now, rate)
        rate = got[1]
        return None if rate is None else round(math.log2(1 + rate) * 4)

    def _pin(self, job: _Job, engine: Engine, ttl_s: float) -> None:
        if job.hold is not None:
            self._end_hold(job.hold, used_now=job.hold.engine is engine)
        keys = engine.pin(self._chain(job), job.shared)
        if not keys:
            return
        now = self.clock.now
        hold = _Hold(engine, keys, job, created=now, used_at=now, own_from=job.shared)
        job.hold = hold
        eid = engine.engine_id
        self.holds[eid].append(hold)
        self._active_holds[eid] += 1
        held = self.held[eid]
        held.add(hold)
        cap = self.hold_cfg.max_held_fraction * engine.cal.kv_pool_tokens
        while held.blocks * engine.block > cap:
            # oldest first: cut its tail short if that is room enough, else let it go
            # (``HoldManager._make_room``)
            oldest = self._oldest_hold(eid)
            if oldest is None:
                break
            if self.hold_cfg.cut_for_room and self._trim(
                    oldest, math.ceil((held.blocks * engine.block - cap) / engine.block)):
                break
            self._room_release[eid] = (now, now - oldest.created)
            self._end_hold(oldest)
        self.clock.after(ttl_s, self._expire, hold)

    def _oldest_hold(self, eid: str) -> _Hold | None:
        """The engine's oldest hold still under way (None: none)."""
        holds = self.holds[eid]
        while holds and not holds[0].active:
            holds.popleft()
        return holds[0] if holds else None

    def _trim(self, hold: _Hold, excess: int) -> bool:
        """Cut ``hold``'s last blocks so the held blocks fall by ``excess``, keeping one
        at least; False (unchanged) when its tail cannot give that much. Shared prefix
        blocks another hold of the family keeps free nothing."""
        held = self.held[hold.engine.engine_id]
        shared, own = held._split(hold)
        others = 0
        if shared:
            runs = held.shared[hold.keys[0]]
            others = max((r for r, n in runs.items() if r != shared or n > 1), default=0)
        # the tail goes: its own blocks, then shared ones down to the others' longest run
        if excess > own + max(0, shared - others) or excess >= len(hold.keys):
            return False
        held.remove(hold)
        kept = len(hold.keys) - excess
        hold.engine.unpin_tail(hold.keys, kept, used_at=self._last_touch(hold),
                               aged_from=max(kept, shared),
                               own_from=hold.own_from)
        hold.keys = hold.keys[:kept]
        held.add(hold)
        return True

    def _expire(self, hold: _Hold) -> None:
        if hold.active:
            self._end_hold(hold)

    def _reclaim(self, engine: Engine) -> bool:
        """A request does not fit beside the engine's holds: vLLM would evict held
        blocks (in its free queue, last touched at the hold's last touch) rather than
        keep it waiting, so the hold touched longest ago is lost (``Engine.reclaim``)."""
        lost: _Hold | None = None
        oldest = math.inf
        for h in self.holds[engine.engine_id]:
            if h.active:
                at = self._last_touch(h)
                if at < oldest:
                    lost, oldest = h, at
        if lost is None:
            return False
        self.holds_lost += 1
        self._end_hold(lost, kick=False)
        return True

    def _end_hold(self, hold: _Hold, *, used_now: bool = False, kick: bool = True) -> None:
        """Let the hold's blocks go. They were last used at its last touch (or the last
        use by one of its job's requests), not now, unless ``used_now`` (the job's step
        or a new hold takes them at this instant): the workers keep a hold by touching
        it every ``touch_interval_s``, so a hold let go for room, at its TTL or when its
        job ends or moves is that much nearer eviction than a request just finished."""
        if not hold.active:
            return
        hold.active = False
        eid = hold.engine.engine_id
        self.held[eid].remove(hold)
        self._active_holds[eid] -= 1
        holds = self.holds[eid]
        if len(holds) > 2 * self._active_holds[eid] + 64:
            self.holds[eid] = deque(h for h in holds if h.active)
        if hold.job.hold is hold:
            hold.job.hold = None
        if used_now:
            hold.engine.unpin(hold.keys, own_from=hold.own_from, kick=kick)
        else:
            hold.engine.unpin(hold.keys, used_at=self._last_touch(hold),
                              aged_from=_HeldBlocks._split(hold)[0], own_from=hold.own_from,
                              kick=kick)

    def _last_touch(self, hold: _Hold) -> float:
        """When the workers would have touched ``hold`` last: one touch interval after
        it was made, then every interval (``HoldManager.tick``); a use by its job's own
        requests since counts as one."""
        interval = self._touch_interval(hold.engine)
        touches = (self.clock.now - hold.created) // interval
        # the interval follows the churn, so a later estimate may fall earlier: never
        # let a hold's blocks grow older than those it already let go (a cut tail)
        hold.used_at = max(hold.used_at, hold.created + touches * interval)
        return hold.used_at

    def _touch_interval(self, engine: Engine) -> float:
        """``HoldManager.touch_interval_s`` (held blocks are pinned here, so the KV usage
        counts them already)."""
        return holding.touch_interval_s(
            self.hold_cfg, free_tokens=engine.cal.kv_pool_tokens * (1 - engine.kv_usage),
            churn_tokens_per_s=self.churn[engine.engine_id].rate)

    def _probe_churn(self) -> None:
        """Every ``CHURN_PROBE_S``, each engine's computed tokens, as an inference worker
        reads its engine's counter at each heartbeat; while anything else is left to
        simulate."""
        now = self.clock.now
        for e in self.engines:
            self.churn[e.engine_id].observe(e.cache.stored_blocks * e.block, now)
        if self.clock.pending:
            self.clock.after(CHURN_PROBE_S, self._probe_churn)

    # --- other traffic -----------------------------------------------------------------

    def background(self, *, rate_per_engine_s: float, prompt_tokens: int, output_tokens: int,
                   until_s: float, phase: float = 0.0) -> None:
        """Fresh prompts (nothing to reuse) at a steady rate on every engine, the first
        ``phase`` (0-1) of an interval from now."""
        counter = [0]

        def fire(engine: Engine) -> None:
            if self.clock.now >= until_s or self.background_stopped:
                return
            counter[0] += 1
            n = counter[0]
            chain = [("bg", n, i) for i in range(prompt_tokens // engine.block)]
            engine.submit(Request(chain=chain, prompt_tokens=prompt_tokens,
                                  output_tokens=output_tokens, priority=0,
                                  on_first_token=lambda r: self.other_ttfts.append(r.ttft_s)))
            self.clock.after(1.0 / rate_per_engine_s, fire, engine)

        for e in self.engines:
            self.clock.at(self.clock.now + phase / rate_per_engine_s, fire, e)
