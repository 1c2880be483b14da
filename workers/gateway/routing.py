"""A call's engine, by the workflows' own routing policy.

The gateway keeps no policy of its own: it gathers what the routing activity gathers
(the live engines and their load, how much of the prompt's chain each engine holds in
the prefix directory, the batch jobs under way for a new batch session) and asks
``warmloop.workflows.routing.choose_engine``, the pure scoring the workflows use,
with the session as the job and its last engine for stickiness. Which engines may
serve a model is ``eligible_engines``, as for a job's profile.

Hazard: the directory lookup is the one Redis round trip on a call's path (about a
millisecond on the loaded 2-core dev host, most of the gateway's overhead). Its
answer for a chain is reused for ``fresh_s`` (the registry snapshot's age, the
staleness routing already accepts) until the gateway itself records a prompt
(``forget_recent``), so a burst of calls sharing a prompt pays it once.
While Redis is away it is skipped (``RedisOutage``): calls then go by stickiness and
load.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable

from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.registry import (
    EngineHeartbeat,
    EngineRegistry,
    RedisOutage,
    calibrated_prefill_rate,
)
from warmloop.workers.gateway.calls import BadCall
from warmloop.workers.gateway.fleet import FleetView
from warmloop.workers.gateway.sessions import Chain
from warmloop.workflows.routing import (
    EngineCandidate,
    RouteDecision,
    RoutingConfig,
    UnservableStepError,
    choose_engine,
    eligible_engines,
)

REDIS_BUDGET_S = 0.5
"""Longest a call waits on the prefix directory before routing without it."""
MAX_RECENT = 1024
"""Directory answers kept for reuse (least recently used go)."""


class NoEngineError(Exception):
    """No live engine may take the call (503)."""


class GatewayRouter:
    def __init__(self, fleet: FleetView, registry: EngineRegistry, directory: PrefixDirectory,
                 *, config: RoutingConfig, outage: RedisOutage, fresh_s: float = 0.25,
                 clock: Callable[[], float] = time.monotonic,
                 gateways_held_tokens: Callable[[str], int] = lambda engine_id: 0) -> None:
        """``gateways_held_tokens``: what the gateways' holds (this one's and its
        replicas') keep on an engine (the worker's are in its heartbeat); the router
        counts both as taken (``EngineHeartbeat.kv_taken``)."""
        self._fleet = fleet
        self._gateways_held = gateways_held_tokens
        self._registry = registry
        self._dir = directory
        self._config = config
        self._outage = outage
        self._fresh_s, self._clock = fresh_s, clock
        self._recent: OrderedDict[tuple[str, tuple[str, ...]], tuple[float, dict[str, int]]] \
            = OrderedDict()

    async def route(self, *, job_id: str, chain: Chain | None, model: str | None,
                    last_engine: str | None, exclude: set[str], failover: bool,
                    batch: bool, on_last_engine: int = 0
                    ) -> tuple[RouteDecision, EngineHeartbeat]:
        """The engine for the call (``choose_engine``) and its heartbeat. Raises
        ``BadCall`` (404) when no engine serves ``model``, ``NoEngineError`` when none
        is live (or all are excluded). ``on_last_engine``: prompt tokens known to be on
        ``last_engine`` beyond what the directory says (see ``Gateway._send``)."""
        live = self.servable(model, exclude)
        expected = await self._expected(chain, live)
        if last_engine in expected:
            expected[last_engine] = max(expected[last_engine], on_last_engine)
        resident = await self._batch_jobs(live) if batch and last_engine is None else {}
        candidates = [
            EngineCandidate(engine_id=e.engine_id, expected_cached_tokens=expected[e.engine_id],
                            running=e.running, waiting=e.waiting,
                            in_flight=self._fleet.in_flight(e.engine_id),
                            kv_usage=e.kv_taken(also_held=self._gateways_held(e.engine_id)),
                            batch_jobs=resident.get(e.engine_id, 0),
                            prefill_tokens_per_s=calibrated_prefill_rate(
                                e, chain.blocks * chain.block_size if chain else None))
            for e in live
        ]
        decision = choose_engine(candidates, job_id=job_id, last_engine=last_engine,
                                 failover=failover, config=self._config, batch=batch)
        return decision, next(e for e in live if e.engine_id == decision.engine_id)

    def servable(self, model: str | None, exclude: set[str]) -> list[EngineHeartbeat]:
        """The live engines serving ``model`` (any, when None), less ``exclude``."""
        live = self._fleet.live()
        try:
            fit = set(eligible_engines([e.offer() for e in live], model=model,
                                       require_price=False))
        except UnservableStepError as e:
            raise BadCall(str(e), status=404, param="model", code="model_not_found") from None
        out = [e for e in live if e.engine_id in fit and e.engine_id not in exclude]
        if not out:
            which = f" serving model {model}" if model else ""
            tried = f" (failed: {', '.join(sorted(exclude))})" if exclude else ""
            raise NoEngineError(f"no live engine{which}{tried}")
        return out

    async def _expected(self, chain: Chain | None, live: list[EngineHeartbeat]
                        ) -> dict[str, int]:
        """Prompt tokens each engine holds of ``chain``, by the prefix directory."""
        expected = {e.engine_id: 0 for e in live}
        if chain is None or not chain.blocks:
            return expected
        same = [e for e in live if e.block_size == chain.block_size]
        matched = await self._matched(chain, tuple(e.engine_id for e in same))
        for e in same:
            expected[e.engine_id] = matched.get(e.engine_id, 0) * e.block_size
        return expected

    def forget_recent(self) -> None:
        """The directory changed (a prompt recorded): reuse no earlier answer."""
        self._recent.clear()

    async def _matched(self, chain: Chain, engine_ids: tuple[str, ...]) -> dict[str, int]:
        """``PrefixDirectory.matched_blocks``, or its answer of under ``fresh_s`` ago."""
        key, now = (chain.packed, engine_ids), self._clock()
        recent = self._recent.get(key)
        if recent is not None and now - recent[0] < self._fresh_s:
            return recent[1]
        hashes = chain.hashes()
        matched = await self._outage.attempt(
            "prefix directory", lambda: self._dir.matched_blocks(hashes, list(engine_ids)),
            None, timeout_s=REDIS_BUDGET_S)
        if matched is None:
            return {}
        self._recent[key] = (now, matched)
        self._recent.move_to_end(key)
        while len(self._recent) > MAX_RECENT:
            self._recent.popitem(last=False)
        return matched

    async def _batch_jobs(self, live: list[EngineHeartbeat]) -> dict[str, int]:
        ids = [e.engine_id for e in live]
        got = await self._outage.attempt("batch jobs", lambda: self._registry.batch_jobs(ids),
                                         None, timeout_s=REDIS_BUDGET_S)
        return got or {}
