"""The routing activity: gathers what the router needs (live engines and their load
from the registry, how much of the step's prefix each holds from the prefix directory)
and asks the pure scoring function in ``warmloop.workflows.routing`` for the engine.

Redis is advice here too. While it is away (or hung), a step is routed by the last
registry snapshot this worker saw: sticky to the job's last engine, else the least
loaded as last known. With no snapshot at all, ``route_step`` fails with the retryable
``REDIS_UNAVAILABLE``, for the workflow to wait and route again rather than end the job.

Tenants: a step sees only its own tenant's cached prefixes (the directory's chains are
salted per tenant, and a profile's stable prefix is kept under the tenant's name), and
a step of a tenant whose tokens for the hour are spent (``tokens_per_hour``) is refused
here, before it costs an engine anything: ``TENANT_QUOTA_EXCEEDED``, with the seconds
until the window resets, for the workflow to wait on a timer. The quota fails open:
with Redis away the step is routed (by the snapshot) unchecked.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, deque
from collections.abc import Callable, Mapping
from typing import TypeVar

import redis.asyncio as aioredis
import structlog
from redis.exceptions import WatchError
from temporalio import activity
from temporalio.exceptions import ApplicationError

from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.registry import (
    REDIS_ERRORS,
    BatchClaim,
    EngineHeartbeat,
    EngineRegistry,
    RedisOutage,
    TenantUsage,
    calibrated_prefill_rate,
    nothing,
    step_key,
    step_key_profile,
)
from warmloop.workflows.contracts import (
    EngineAliveRequest,
    EngineChoice,
    Lane,
    PickEngineRequest,
    RouteRequest,
)
from warmloop.workflows.lanes import (
    BatchWindow,
    BatchWindowRequest,
    EngineBatchRoom,
    batch_of,
    default_batch_window,
    fleet_batch_window,
)
from warmloop.workflows.routing import (
    REDIS_UNAVAILABLE,
    EngineCandidate,
    RouteDecision,
    RouteReason,
    RoutingConfig,
    UnservableStepError,
    choose_engine,
    eligible_engines,
    prefix_family,
)
from warmloop.workflows.tenants import TENANT_QUOTA_EXCEEDED, TenantQuota, over_tokens, scoped

T = TypeVar("T")

log = structlog.get_logger(__name__)
ROUND_ROBIN_KEY = "warmloop:route:rr"
NO_LIVE_ENGINE = "NoLiveEngine"
"""ApplicationError type of route_step (retryable): no engine, of those that could serve
the job, is live (or, while Redis is away, last known) and not excluded."""
REDIS_BUDGET_S = 1.5
"""route_step's time for Redis. The workflow runs it as a local activity with a 5 s
timeout; a hung Redis then leaves time to route by the snapshot."""
GATEWAY_NAMES_FRESH_S = 1.0
"""How long the routing activity reuses the list of gateways that publish held tokens
(a gateway that starts holding is counted within this long)."""
AWAY_LOAD_WINDOW_S = 30.0
"""While routing by the snapshot (its loads frozen), steps sent to an engine in this
window count as its load, so that new jobs spread instead of all going to one."""


class RoutingActivities:
    def __init__(self, registry: EngineRegistry, redis: aioredis.Redis, *,
                 directory: PrefixDirectory | None = None,
                 config: RoutingConfig | None = None,
                 outage: RedisOutage | None = None,
                 redis_budget_s: float = REDIS_BUDGET_S,
                 clock: Callable[[], float] = time.monotonic,
                 quotas: Mapping[str, TenantQuota] | None = None,
                 usage: TenantUsage | None = None) -> None:
        self._registry = registry
        self._quotas = dict(quotas or {})
        """Tenants' quotas (``WARMLOOP_TENANTS``); a tenant not here has none."""
        self._usage = usage or (TenantUsage(redis) if self._quotas else None)
        self._redis = redis
        self._dir = directory or PrefixDirectory(redis)
        self._config = config or RoutingConfig()
        self._outage = outage or RedisOutage()
        self._budget_s = redis_budget_s
        self._clock = clock
        self._snapshot: list[EngineHeartbeat] = []
        """The last non-empty list of live engines read from the registry."""
        self._snapshot_at: float | None = None
        self._gateways_held: dict[str, int] = {}
        """What the gateways' holds kept on each engine at the last route with Redis."""
        self._gateway_names_cached: list[str] = []
        self._gateway_names_at: float | None = None
        self._routed_away: deque[tuple[float, str]] = deque()
        """(when, engine) of steps routed by the snapshot, within AWAY_LOAD_WINDOW_S."""
        self._turn = 0

    async def _gateway_names(self) -> list[str]:
        """The gateways that publish held tokens, read at most every
        ``GATEWAY_NAMES_FRESH_S`` (they come and go rarely; a fleet without gateways then
        costs a route no Redis command for them)."""
        now = self._clock()
        if self._gateway_names_at is None or now - self._gateway_names_at >= \
                GATEWAY_NAMES_FRESH_S:
            self._gateway_names_cached = await self._registry.gateways()
            self._gateway_names_at = now
        return self._gateway_names_cached

    async def _live(self, exclude: list[str], *, model: str | None = None,
                    require_price: bool = False) -> list[EngineHeartbeat]:
        """The live engines that may serve the job's step, less ``exclude``."""
        every = await self._registry.live()
        if every:
            self._snapshot, self._snapshot_at = every, time.time()
        return _servable(every, exclude, model=model, require_price=require_price)

    @activity.defn(name="engine_alive")
    async def engine_alive(self, req: EngineAliveRequest) -> bool | None:
        """Whether the engine's worker heartbeats a healthy engine; None when Redis is
        away and nobody can tell (the workflow then fails the step over, as before)."""
        if not self._outage.should_try():
            return None
        try:
            async with asyncio.timeout(self._budget_s):
                live = await self._registry.live()
        except REDIS_ERRORS as e:
            self._outage.failed(e, what="engine_alive")
            return None
        self._outage.ok()
        return any(hb.engine_id == req.engine_id for hb in live)

    @activity.defn(name="batch_window")
    async def batch_window(self, req: BatchWindowRequest) -> BatchWindow:
        """How many of a batch's jobs to keep in progress (``lanes.fleet_batch_window``),
        from the live engines serving its model and the other batches on them (their jobs
        under way, or the windows they were given within ``BATCH_CLAIM_S``); the answer is
        claimed for the batches that ask after. Never fails for the fleet's state: with
        Redis away or no engine serving the model it answers the default and says why."""
        try:
            async with asyncio.timeout(self._budget_s):
                live = await self._registry.live()
                try:
                    ok = set(eligible_engines([e.offer() for e in live], model=req.model,
                                              require_price=False))
                except UnservableStepError:
                    ok = set()
                live = [e for e in live if e.engine_id in ok]
                ids = [e.engine_id for e in live]
                if not live:
                    which = f" serving model {req.model}" if req.model else ""
                    return default_batch_window(req.max_window, f"no live engine{which}")
                resident = await self._registry.batch_job_ids(ids)
                rooms = [EngineBatchRoom(engine_id=e.engine_id, kv_fit=e.batch_kv_fit,
                                         batch_limit=e.batch_limit) for e in live]

                def decide(claims: dict[str, BatchClaim]) -> tuple[BatchClaim, BatchWindow]:
                    answer = fleet_batch_window(rooms, max_window=req.max_window,
                                                others=_other_batches(req, resident, claims))
                    # claim what the page will run, not more
                    window = answer.window if req.records is None \
                        else min(answer.window, max(1, req.records))
                    return BatchClaim(window=window, model=req.model, at=time.time()), answer

                answer = await self._registry.claim_batch_window(req.batch_id, decide)
        except WatchError:  # Redis answered: too many batches asking at once, not an outage
            return default_batch_window(req.max_window, "too many batches asking at once")
        except REDIS_ERRORS as e:
            self._outage.failed(e, what="batch_window")
            return default_batch_window(req.max_window,
                                        f"registry unreadable ({type(e).__name__})")
        self._outage.ok()
        log.info("batch_window", batch_id=req.batch_id, window=answer.window, fit=answer.fit,
                 others=answer.others, why=answer.why)
        return answer

    @activity.defn(name="route_step")
    async def route_step(self, req: RouteRequest) -> RouteDecision:
        started = time.perf_counter()
        decision: RouteDecision | None = None
        if self._outage.should_try():
            try:
                async with asyncio.timeout(self._budget_s):
                    await self._check_quota(req)
                    decision = await self._decide(req)
            except REDIS_ERRORS as e:
                self._outage.failed(e, what="route_step")
            except ApplicationError:
                self._outage.ok()  # Redis answered: the fleet cannot serve the step
                raise
            else:
                self._outage.ok()
        if decision is not None:
            routed, left = decision, max(0.1, self._budget_s - (time.perf_counter() - started))
            await self._outage.attempt("route_step", lambda: self._record(req, routed),
                                       None, timeout_s=left)
        else:
            decision = self._by_snapshot(req)
        decision.took_ms = (time.perf_counter() - started) * 1000
        # the scores that kept the job on its last engine or moved it (a move is meant
        # to happen only when another engine scores better by more than a near-tie)
        scores = decision.scores
        log.info("step_routed", job_id=req.job_id, step=req.step, engine=decision.engine_id,
                 reason=decision.reason, expected_cached=decision.expected_cached_tokens,
                 last_engine=req.last_engine,
                 best_score=max(scores.values()) if scores else None,
                 last_score=scores.get(req.last_engine) if req.last_engine else None,
                 redis_away=self._outage.away)
        return decision

    async def _check_quota(self, req: RouteRequest) -> None:
        """Refuse the step when its tenant's tokens for this hour are spent (one GET, for
        tenants with a ``tokens_per_hour`` quota only)."""
        quota = self._quotas.get(req.tenant)
        if quota is None or quota.tokens_per_hour is None or self._usage is None:
            return
        now = time.time()
        refused = over_tokens(req.tenant, quota, await self._usage.used(req.tenant, now), now)
        if refused is not None:
            why, wait = refused
            log.info("step_refused_for_quota", job_id=req.job_id, step=req.step,
                     tenant=req.tenant, retry_after_s=wait)
            raise ApplicationError(why, {"retry_after_s": wait}, type=TENANT_QUOTA_EXCEEDED,
                                   non_retryable=True)

    async def _decide(self, req: RouteRequest) -> RouteDecision:
        """The engine for the step from the registry and the directory (Redis)."""
        # Two rounds of Redis reads, each sent at once: what does not depend on the live
        # engines goes with the registry read (a step's route is on its critical path).
        cache_aware = req.policy == "cache_aware"
        batch = req.lane == Lane.BATCH
        family = scoped(req.tenant, prefix_family(req.profile, req.tools))
        live, job, stable, gateway_names = await asyncio.gather(
            self._live(req.exclude, model=req.model, require_price=req.require_price),
            self._dir.job_chain(req.job_id) if cache_aware else nothing(),
            # the profile's prefix matters to a job with no chain yet: its first step
            self._dir.profile_chain(family) if cache_aware and req.last_engine is None
            else nothing(),
            self._gateway_names())
        ids = [e.engine_id for e in live]
        if cache_aware and job is None and stable is None and req.last_engine is not None:
            stable = await self._dir.profile_chain(family)  # its chain expired: rare
        chain = (job[0] if job is not None else stable or []) if cache_aware else []
        steps, resident, matched, gateways = await asyncio.gather(
            self._registry.in_flight_steps(ids),
            # only a batch job's first step weighs the jobs under way
            # (warmloop.workflows.routing)
            self._registry.batch_jobs(ids) if batch and req.last_engine is None
            else _value(dict.fromkeys(ids, 0)),
            self._dir.matched_blocks(chain, ids) if cache_aware
            else _value(dict.fromkeys(ids, 0)),
            # the gateways' holds are in no heartbeat; taken KV all the same
            self._registry.gateways_held(names=gateway_names) if gateway_names
            else _value({}))
        self._gateways_held = gateways
        expected = {e: 0 for e in ids}
        if cache_aware:
            if job is not None:
                expected = {e.engine_id: matched[e.engine_id] * e.block_size for e in live}
            else:
                # A new job: its profile's stable prefix is warm where it is cached, or
                # where a step of the same profile (and tenant) is being served right now.
                mine = scoped(req.tenant, req.profile)
                for e in live:
                    warming = any(step_key_profile(k) == mine for k in steps[e.engine_id])
                    blocks = len(chain) if warming else matched[e.engine_id]
                    expected[e.engine_id] = blocks * e.block_size
        candidates = [
            EngineCandidate(engine_id=e.engine_id, expected_cached_tokens=expected[e.engine_id],
                            running=e.running, waiting=e.waiting,
                            in_flight=len(steps[e.engine_id]),
                            kv_usage=e.kv_taken(also_held=gateways.get(e.engine_id, 0)),
                            batch_jobs=resident[e.engine_id],
                            prefill_tokens_per_s=calibrated_prefill_rate(
                                e, expected[e.engine_id] or None))
            for e in live
        ]
        turn = await self._redis.incr(ROUND_ROBIN_KEY) if req.policy == "round_robin" else 0
        return choose_engine(candidates, job_id=req.job_id, last_engine=req.last_engine,
                             failover=bool(req.exclude), config=self._config,
                             policy=req.policy, turn=turn, batch=batch)

    async def _record(self, req: RouteRequest, decision: RouteDecision) -> None:
        """The step is in flight on its engine (the router's load signal); a step routed
        ahead, during its job's pause, is counted by its worker when it starts."""
        if req.mark_in_flight:
            await self._registry.step_routed(decision.engine_id, step_key(
                req.job_id, req.step, scoped(req.tenant, req.profile)))
        if req.lane == Lane.BATCH:
            await self._registry.batch_job_routed(decision.engine_id, req.job_id)

    def _by_snapshot(self, req: RouteRequest) -> RouteDecision:
        """Route without Redis: the job's last engine if it is among the last known
        (its transcript is cached there), else the least loaded as last known plus
        what this worker sent there since. Nothing is recorded; an engine that is gone
        fails the step's pickup and the workflow fails it over, as with Redis."""
        if not self._snapshot:
            raise ApplicationError(
                "Redis is away and this worker has not yet seen the engine registry; "
                "retry when Redis is back", type=REDIS_UNAVAILABLE)
        try:
            live = _servable(self._snapshot, req.exclude, model=req.model,
                             require_price=req.require_price)
        except ApplicationError as e:
            if e.type == NO_LIVE_ENGINE:
                raise
            # not "no engine serves this job": that verdict waits for a fresh registry
            raise ApplicationError(f"{e.message} among the last known engines; Redis is "
                                   "away", type=REDIS_UNAVAILABLE) from None
        now = self._clock()
        while self._routed_away and now - self._routed_away[0][0] > AWAY_LOAD_WINDOW_S:
            self._routed_away.popleft()
        sent = {e.engine_id: 0 for e in live}
        for _, engine_id in self._routed_away:
            if engine_id in sent:
                sent[engine_id] += 1
        held = self._gateways_held
        by_load = sorted(live, key=lambda e: (
            e.running + e.waiting + sent[e.engine_id],
            e.kv_taken(also_held=held.get(e.engine_id, 0)), e.engine_id))
        ids = [e.engine_id for e in live]
        reason: RouteReason
        if req.policy == "round_robin":
            self._turn += 1
            chosen, reason = ids[self._turn % len(ids)], "round_robin"
        elif req.policy == "cache_aware" and req.last_engine in ids:
            chosen, reason = req.last_engine, "sticky"
        else:
            chosen, reason = by_load[0].engine_id, "least_loaded"
        self._routed_away.append((now, chosen))
        age = time.time() - self._snapshot_at if self._snapshot_at is not None else None
        log.info("routed_by_snapshot", job_id=req.job_id, step=req.step, engine=chosen,
                 snapshot_age_s=None if age is None else round(age, 1))
        return RouteDecision(engine_id=chosen, reason="failover" if req.exclude else reason)

    @activity.defn(name="pick_engine")
    async def pick_engine(self, req: PickEngineRequest) -> EngineChoice:
        """Placement for workflows started before per-step routing (replay only)."""
        if self._outage.should_try():
            try:
                async with asyncio.timeout(self._budget_s):
                    live = await self._live(req.exclude, model=req.model,
                                            require_price=req.require_price)
                    n = await self._redis.incr(ROUND_ROBIN_KEY)
            except REDIS_ERRORS as e:
                self._outage.failed(e, what="pick_engine")
            else:
                self._outage.ok()
                chosen = live[n % len(live)]
                return EngineChoice(engine_id=chosen.engine_id,
                                    reason="failover" if req.exclude else "round_robin")
        decision = self._by_snapshot(RouteRequest(
            job_id="", step=0, profile="", policy="round_robin", exclude=req.exclude,
            model=req.model, require_price=req.require_price))
        return EngineChoice(engine_id=decision.engine_id, reason=decision.reason)


def _servable(every: list[EngineHeartbeat], exclude: list[str], *, model: str | None,
              require_price: bool) -> list[EngineHeartbeat]:
    """Of ``every``, the engines that may serve the job's step, less ``exclude``."""
    try:
        fit = set(eligible_engines([e.offer() for e in every], model=model,
                                   require_price=require_price))
    except UnservableStepError as e:
        # Engines are up but none can serve this job: no retry changes that, and the
        # workflow ends the job with the reason (INVALID_INPUT).
        raise ApplicationError(str(e), type=e.error_type, non_retryable=True) from None
    live = [e for e in every if e.engine_id in fit and e.engine_id not in exclude]
    if not live:
        # Retryable: an engine may rejoin before the activity's retries run out.
        which = (f" serving model {model}" if model else "") + (
            " with a price" if require_price else "")
        raise ApplicationError(
            f"no live engine{which} (excluded: {', '.join(exclude) or 'none'})",
            type=NO_LIVE_ENGINE)
    return live


def _other_batches(req: BatchWindowRequest, resident: dict[str, list[str]],
                   claims: dict[str, BatchClaim]) -> dict[str, int]:
    """Each other batch on the engines: its jobs under way there, or the window it was
    given lately if more (its jobs have not reached an engine yet)."""
    others = Counter(batch_of(job) for jobs in resident.values() for job in jobs)
    for b, c in claims.items():
        # a claim counts where its batch has jobs here, or serves the same model
        if b in others or c.model is None or req.model is None or c.model == req.model:
            others[b] = max(others[b], c.window)
    others.pop(req.batch_id, None)
    return dict(others)


async def _value(v: T) -> T:
    return v
