"""The routing activity: gathers what the router needs (live engines and their load
from the registry, how much of the step's prefix each holds from the prefix directory)
and asks the pure scoring function in ``warmloop.workflows.routing`` for the engine."""

from __future__ import annotations

import time

import redis.asyncio as aioredis
import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.registry import EngineHeartbeat, EngineRegistry, step_key, step_key_profile
from warmloop.workflows.contracts import EngineChoice, Lane, PickEngineRequest, RouteRequest
from warmloop.workflows.routing import (
    EngineCandidate,
    RouteDecision,
    RoutingConfig,
    UnservableStepError,
    choose_engine,
    eligible_engines,
    prefix_family,
)

log = structlog.get_logger(__name__)
ROUND_ROBIN_KEY = "warmloop:route:rr"


class RoutingActivities:
    def __init__(self, registry: EngineRegistry, redis: aioredis.Redis, *,
                 directory: PrefixDirectory | None = None,
                 config: RoutingConfig | None = None) -> None:
        self._registry = registry
        self._redis = redis
        self._dir = directory or PrefixDirectory(redis)
        self._config = config or RoutingConfig()

    async def _live(self, exclude: list[str], *, model: str | None = None,
                    require_price: bool = False) -> list[EngineHeartbeat]:
        """The live engines that may serve the job's step, less ``exclude``."""
        every = await self._registry.live()
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
                type="NoLiveEngine")
        return live

    @activity.defn(name="route_step")
    async def route_step(self, req: RouteRequest) -> RouteDecision:
        started = time.perf_counter()
        live = await self._live(req.exclude, model=req.model, require_price=req.require_price)
        ids = [e.engine_id for e in live]
        steps = await self._registry.in_flight_steps(ids)
        batch = req.lane == Lane.BATCH
        # only a batch job's first step weighs the jobs under way (warmloop.workflows.routing)
        resident = (await self._registry.batch_jobs(ids) if batch and req.last_engine is None
                    else dict.fromkeys(ids, 0))
        expected = {e: 0 for e in ids}
        if req.policy == "cache_aware":
            job = await self._dir.job_chain(req.job_id)
            if job is not None:
                matched = await self._dir.matched_blocks(job[0], ids)
                expected = {e.engine_id: matched[e.engine_id] * e.block_size for e in live}
            else:
                # A new job: its profile's stable prefix is warm where it is cached, or
                # where a step of the same profile is being served right now.
                family = prefix_family(req.profile, req.tools)
                stable = await self._dir.profile_chain(family) or []
                matched = await self._dir.matched_blocks(stable, ids)
                for e in live:
                    warming = any(step_key_profile(k) == req.profile for k in steps[e.engine_id])
                    blocks = len(stable) if warming else matched[e.engine_id]
                    expected[e.engine_id] = blocks * e.block_size
        candidates = [
            EngineCandidate(engine_id=e.engine_id, expected_cached_tokens=expected[e.engine_id],
                            running=e.running, waiting=e.waiting,
                            in_flight=len(steps[e.engine_id]), kv_usage=e.kv_usage,
                            batch_jobs=resident[e.engine_id])
            for e in live
        ]
        turn = await self._redis.incr(ROUND_ROBIN_KEY) if req.policy == "round_robin" else 0
        decision = choose_engine(candidates, job_id=req.job_id, last_engine=req.last_engine,
                                 failover=bool(req.exclude), config=self._config,
                                 policy=req.policy, turn=turn,
                                 batch=batch)
        await self._registry.step_routed(decision.engine_id,
                                         step_key(req.job_id, req.step, req.profile))
        if batch:
            await self._registry.batch_job_routed(decision.engine_id, req.job_id)
        decision.took_ms = (time.perf_counter() - started) * 1000
        log.info("step_routed", job_id=req.job_id, step=req.step, engine=decision.engine_id,
                 reason=decision.reason, expected_cached=decision.expected_cached_tokens)
        return decision

    @activity.defn(name="pick_engine")
    async def pick_engine(self, req: PickEngineRequest) -> EngineChoice:
        """Placement for workflows started before per-step routing (replay only)."""
        live = await self._live(req.exclude, model=req.model, require_price=req.require_price)
        n = await self._redis.incr(ROUND_ROBIN_KEY)
        chosen = live[n % len(live)]
        return EngineChoice(engine_id=chosen.engine_id,
                            reason="failover" if req.exclude else "round_robin")
