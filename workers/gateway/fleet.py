"""The fleet as the gateway routes by: the engine registry, read in the background.

A call's route must not wait on the registry (two round trips, and a heartbeat is a
second old anyway), so a loop refreshes a snapshot every ``refresh_s``: the live
engines (``EngineRegistry.live``) and the workflows' steps in flight on each
(``in_flight_steps``). The gateway's own calls in flight are counted here as they
start and end, fresher than any heartbeat, and written to the registry's in-flight
sets too, so that the workflows' router sees them: by the same loop, in one round
trip (a call that began and ended between two refreshes is never written; each Redis
command costs the 2-core host a context switch, and they added up to a millisecond a
call).

Hazards:

- While Redis is away the last snapshot stands, as for the routing activity; an engine
  that left meanwhile is found out by its first refused call.
- An engine that refused a call or died in one is set aside for ``cooldown_s`` (its
  worker takes it out of the registry within a heartbeat or two, but the snapshot may
  still list it); when every engine is set aside they are all tried again.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import Callable

import redis.asyncio as aioredis
import structlog

from warmloop.activities.registry import (
    GATEWAY_HELD_TTL_S,
    INFLIGHT_KEY,
    EngineHeartbeat,
    EngineRegistry,
    GatewayHeld,
    RedisOutage,
    step_key,
)

log = structlog.get_logger(__name__)
REDIS_TIMEOUT_S = 1.0
MAX_UNREMOVED = 10_000
"""Ended calls kept to take out of the registry once Redis is back (oldest go first)."""


class FleetView:
    def __init__(self, registry: EngineRegistry, redis: aioredis.Redis, *, instance: str,
                 cooldown_s: float, outage: RedisOutage,
                 clock: Callable[[], float] = time.time) -> None:
        self._registry = registry
        self._redis = redis
        self.instance = instance
        self._own_prefix = f"gw:{instance}:"
        self._cooldown_s = cooldown_s
        self._outage = outage
        self._clock = clock
        self.engines: dict[str, EngineHeartbeat] = {}
        self.refreshed_at: float | None = None
        self._others: dict[str, int] = {}
        """Steps in flight per engine in the registry, not this gateway's."""
        self.local: Counter[str] = Counter()
        """This gateway's calls in flight per engine."""
        self._failed: dict[str, float] = {}
        self._seq = 0
        self._unwritten: dict[str, tuple[str, float]] = {}
        """In-flight key -> (engine, since) of calls not yet in the registry."""
        self._ended: list[tuple[str, str]] = []
        """(engine, key) of written calls that have ended, to take out."""
        self._others_held: dict[str, int] = {}
        """Tokens the other gateways' holds keep on each engine (``GATEWAY_HELD_KEY``)."""
        self._held_published: tuple[dict[str, int], float] | None = None
        """What this gateway last published of its own holds, and when (monotonic)."""

    async def refresh(self) -> bool:
        """Write the calls in flight, read the registry; False (the last snapshot kept)
        when Redis failed."""
        await self.publish_in_flight()

        async def read() -> bool:
            live = await self._registry.live()
            steps, held = await asyncio.gather(
                self._registry.in_flight_steps([e.engine_id for e in live]),
                self._registry.gateways_held(exclude=self.instance))
            self._others = {e: sum(not k.startswith(self._own_prefix) for k in keys)
                            for e, keys in steps.items()}
            self._others_held = held
            self.engines = {e.engine_id: e for e in live}
            self.refreshed_at = self._clock()
            return True

        return await self._outage.attempt("engine registry", read, False,
                                          timeout_s=REDIS_TIMEOUT_S, probe=True)

    def engine(self, engine_id: str) -> EngineHeartbeat | None:
        return self.engines.get(engine_id)

    def live(self) -> list[EngineHeartbeat]:
        """The engines to route to: those not set aside (all, when all are)."""
        now = self._clock()
        for e, at in list(self._failed.items()):
            if now - at >= self._cooldown_s:
                del self._failed[e]
        every = sorted(self.engines.values(), key=lambda e: e.engine_id)
        fine = [e for e in every if e.engine_id not in self._failed]
        return fine or every

    def others_held(self, engine_id: str) -> int:
        """Tokens the other gateways' holds keep on the engine, as last read."""
        return self._others_held.get(engine_id, 0)

    async def publish_held(self, held: dict[str, int]) -> None:
        """This gateway's held tokens per engine, for the routers and the other gateways:
        written when they changed, or to renew the entry well within
        ``GATEWAY_HELD_TTL_S`` (an idle gateway with no holds writes nothing more).
        Best effort: while Redis is away the others count what was last written."""
        held = {e: n for e, n in held.items() if n > 0}
        now = time.monotonic()
        last = self._held_published
        if last is None and not held:
            return  # nothing held yet: nothing to say
        if last is not None and last[0] == held and \
                (not held or now - last[1] < GATEWAY_HELD_TTL_S / 3):
            return

        async def write() -> bool:
            await self._registry.publish_gateway_held(
                GatewayHeld(gateway=self.instance, engines=held, at=self._clock()))
            return True

        if await self._outage.attempt("gateway holds", write, False,
                                      timeout_s=REDIS_TIMEOUT_S):
            self._held_published = (held, now)

    async def gone(self) -> None:
        """The gateway stops: its entry goes (else it counts until it is stale)."""
        async def write() -> bool:
            await self._registry.gateway_gone(self.instance)
            return True

        # tried even while Redis seems away (once, bounded): else the others count this
        # gateway's holds until its entry expires
        await self._outage.attempt("gateway holds", write, False, timeout_s=REDIS_TIMEOUT_S,
                                   probe=True)

    def in_flight(self, engine_id: str) -> int:
        return self._others.get(engine_id, 0) + self.local[engine_id]

    def failed(self, engine_id: str) -> None:
        """The engine refused a call or died in one: set it aside for a while."""
        self._failed[engine_id] = self._clock()
        log.warning("engine_set_aside", engine=engine_id, for_s=self._cooldown_s)

    def started(self, engine_id: str, profile: str) -> str:
        """A call went to the engine; returns its in-flight key (give it to ``ended``)."""
        self._seq += 1
        key = step_key(f"{self._own_prefix}{self._seq}", 0, profile)
        self.local[engine_id] += 1
        self._unwritten[key] = (engine_id, self._clock())
        return key

    def ended(self, engine_id: str, key: str) -> None:
        self.local[engine_id] -= 1
        if self.local[engine_id] <= 0:
            del self.local[engine_id]
        if self._unwritten.pop(key, None) is None:
            self._ended.append((engine_id, key))

    async def publish_in_flight(self) -> None:
        """The calls in flight since the last refresh into the registry's in-flight
        sets, those ended out of them, in one round trip. Best effort: while Redis is
        away new ones go unwritten (load hints), ended ones wait for the next try."""
        adds, self._unwritten = self._unwritten, {}
        ended, self._ended = self._ended, []
        if not adds and not ended:
            return

        async def write() -> bool:
            pipe = self._redis.pipeline(transaction=False)
            for key, (engine_id, since) in adds.items():
                pipe.zadd(INFLIGHT_KEY.format(engine_id), {key: since})
            for engine_id, key in ended:
                pipe.zrem(INFLIGHT_KEY.format(engine_id), key)
            await pipe.execute()
            return True

        if not await self._outage.attempt("in-flight calls", write, False,
                                          timeout_s=REDIS_TIMEOUT_S):
            self._ended = [*ended, *self._ended][-MAX_UNREMOVED:]
