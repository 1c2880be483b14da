"""What the fleet offers a job before it starts: whether any engine serves the model its
profile needs and, for a job with a cost cap, declares a price (``warmloop submit``)."""

from __future__ import annotations

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from warmloop.activities.registry import EngineRegistry
from warmloop.workers.clients import redis_options
from warmloop.workers.settings import Settings
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.routing import EngineOffer, UnservableStepError, eligible_engines


async def fleet_offers(settings: Settings) -> list[EngineOffer]:
    """The live engines in the registry; the configured ones (``WARMLOOP_ENGINES``) when
    none is live or Redis cannot be reached; nothing when neither is known."""
    r = aioredis.Redis.from_url(settings.redis_url, socket_connect_timeout=2,
                                socket_timeout=2, **redis_options(settings))
    try:
        live = await EngineRegistry(r, ttl_s=settings.engine_ttl_s).live()
    except (RedisError, OSError):
        live = []
    finally:
        await r.aclose()
    if live:
        return [hb.offer() for hb in live]
    if settings.engines is None:
        # No live engine and none configured: the embedded defaults say nothing about
        # the fleet the job will meet, so there is nothing to check against.
        return []
    return [EngineOffer(engine_id=e.id, model=e.model, priced=e.price is not None)
            for e in settings.engine_endpoints]


async def check_fleet_serves(model: str | None, limits: JobLimits, settings: Settings) -> None:
    """Raise ValueError, with what to change, when no engine can serve a job that needs
    ``model`` (None: any) under ``limits`` (a cost cap needs a priced engine)."""
    require_price = limits.max_cost_usd is not None
    if model is None and not require_price:
        return
    offers = await fleet_offers(settings)
    if not offers:
        return
    try:
        eligible_engines(offers, model=model,
                         require_price=require_price)
    except UnservableStepError as e:
        raise ValueError(str(e)) from None
