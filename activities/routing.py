"""Picks the engine a job runs on. The job then stays there (sticky) so its
transcript's prefix stays cached; the full cache-aware router replaces this."""

from __future__ import annotations

import redis.asyncio as aioredis
import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.registry import EngineRegistry
from workflows.contracts import EngineChoice, PickEngineRequest

log = structlog.get_logger(__name__)
ROUND_ROBIN_KEY = "warmloop:route:rr"


class RoutingActivities:
    def __init__(self, registry: EngineRegistry, redis: aioredis.Redis) -> None:
        self._registry = registry
        self._redis = redis

    @activity.defn(name="pick_engine")
    async def pick_engine(self, req: PickEngineRequest) -> EngineChoice:
        live = [e for e in await self._registry.live() if e.engine_id not in req.exclude]
        if not live:
            # Retryable: an engine may rejoin before the activity's retries run out.
            raise ApplicationError(
                f"no live engine (excluded: {req.exclude or 'none'})", type="NoLiveEngine"
            )
        # Spread new jobs in turn, not by the heartbeats' load figures: a burst of jobs
        # all starts before any heartbeat shows the load it adds.
        n = await self._redis.incr(ROUND_ROBIN_KEY)
        chosen = live[n % len(live)]
        reason = "failover" if req.exclude else "round_robin"
        log.info("engine_picked", job_id=req.job_id, engine=chosen.engine_id, reason=reason)
        return EngineChoice(engine_id=chosen.engine_id, reason=reason)
