"""Pauses without a workflow: sessions' pauses measured, their prefixes held warm.

Between two calls of a session, the session is paused: on the caller's tool when the
last response asked for one (``tool:<name>``), else on the caller's own turn
(``approval:reply``: a person, usually). The gateway measures each pause into the
pause statistics the workers use (``PauseStats``, under the profile name
``gateway:<session kind>``), and at the end of each response decides, with the
inference workers' own ``HoldManager.after_step`` (the cost model
``warmloop.workflows.holding.decide_hold``), whether to hold the session's prefix on
its engine. Holds are kept warm by the same touches, end at their TTL, when the
session's next call comes, or at once on its final call, and live within the same cap
on held tokens per engine (``HoldConfig.max_held_fraction``).

Hazards:

- The inference worker beside each engine rewrites its own hold table
  (``warmloop:holds:<engine>``) whole at every tick; each gateway keeps its holds in
  its own table (``GATEWAY_HOLDS_KEY``, by engine and gateway instance) so that none
  erases another's. ``warmloop engines`` adds them all to show them.
- The cap is shared one way: a gateway counts the worker's held tokens (its
  heartbeat's ``held_tokens``) and the other gateways' (``GATEWAY_HELD_KEY``, as of its
  last fleet refresh) and gives way to them at every tick; the worker does not count
  the gateways'. Two gateways over the cap at once may both let holds go (under it
  afterwards, never over).
- Holds live in this process: a gateway restart drops them (the engine's LRU then
  lets their blocks go; nothing else is lost). A session whose next call reaches
  another gateway replica is announced by it (``SESSIONS_STREAM``, a Redis stream),
  and the first ends its hold and forgets it. An announcement Redis did not take is
  sent again, with its age, once Redis is back, and a replica cut off reads on from
  where it left off; one read after the session came back to that replica is stale and
  ignored. The first replica measures the session's pause across the move (it saw it
  begin; the announcement places the next call's start in time).
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
from collections.abc import Callable
from typing import Any

import httpx
import redis.asyncio as aioredis
import structlog
from pydantic import BaseModel, ConfigDict

from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.holds import REDIS_TIMEOUT_S, HoldManager
from warmloop.activities.pauses import PauseStats, approval_kind, tool_kind
from warmloop.activities.registry import EngineHeartbeat, RedisOutage
from warmloop.workers.gateway.tasks import stop_task
from warmloop.workflows.holding import HoldConfig, PauseDistribution, TtlCacheEndpoint
from warmloop.workflows.profiles import Profile
from warmloop.workflows.profiles.base import ToolSpec

log = structlog.get_logger(__name__)

GATEWAY_HOLDS_KEY = "warmloop:gateway:holds:{}:{}"
"""Hash per engine and gateway instance: session key -> the hold (JSON), as the workers'
``HOLDS_KEY``."""


async def gateway_hold_records(redis: aioredis.Redis, engine_ids: list[str],
                               gateways: list[str]) -> dict[str, list[dict[str, Any]]]:
    """Every gateway's holds on each engine (each replica's table), as records with the
    ``gateway`` and ``session`` they belong to: ``gateways`` as
    ``EngineRegistry.gateways`` lists them, their tables in one round trip."""
    pairs = [(e, g) for e in engine_ids for g in gateways]
    pipe = redis.pipeline(transaction=False)
    for e, g in pairs:
        pipe.hgetall(GATEWAY_HOLDS_KEY.format(e, g))
    out: dict[str, list[dict[str, Any]]] = {e: [] for e in engine_ids}
    for (e, g), table in zip(pairs, await pipe.execute() if pairs else [], strict=True):
        for session, v in table.items():
            out[e].append({**json.loads(v), "gateway": g,
                           "session": session.decode() if isinstance(session, bytes)
                           else session})
    return out


TABLE_TTL_S = 30
"""The table is rewritten every tick; left by a gateway that died, it expires."""
REPLY_KIND = approval_kind("reply")
"""What a session waits on after a response without tool calls: its caller's turn."""
MAX_KIND_CHARS = 64


def pause_kind_of(tool_names: list[str]) -> str:
    """What the session waits on after a response asking for ``tool_names``."""
    if not tool_names:
        return REPLY_KIND
    names = "+".join(sorted({n.replace("|", "_") for n in tool_names if n}))
    return tool_kind(names[:MAX_KIND_CHARS] or "unnamed")


class _NoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


_END = ToolSpec(name="end_session", description="The session's last call.", args=_NoArgs,
                finishes_job=True)


@functools.lru_cache(maxsize=4096)
def kind_profile(kind: str) -> Profile:
    """The profile a session kind's pauses are kept under (``gateway:<kind>``): it has
    no tools, so every pause kind starts from the statistics' defaults (a tool: median
    1 s; the caller's turn: 10 min) until ``PauseStats`` has samples."""
    return Profile(name=f"gateway:{kind}", system_prompt="", task_model=_NoArgs,
                   tools=(_END,))


class RecentPauseStats(PauseStats):
    """``PauseStats`` whose distributions are read at most every ``fresh_s`` per kind:
    every session of a kind asks for the same one at the end of each call, and a few
    seconds' more samples do not change a hold decision."""

    def __init__(self, redis: aioredis.Redis, *, fresh_s: float = 5.0,
                 outage: RedisOutage | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(redis, outage=outage)
        self._fresh_s, self._clock = fresh_s, clock
        self._recent: dict[tuple[str, str], tuple[float, PauseDistribution]] = {}

    async def distribution(self, profile: Profile, kind: str) -> PauseDistribution:
        key, now = (profile.name, kind), self._clock()
        cached = self._recent.get(key)
        if cached is not None and now - cached[0] < self._fresh_s:
            return cached[1]
        dist = await super().distribution(profile, kind)
        if len(self._recent) > 4096:
            self._recent.clear()
        self._recent[key] = (now, dist)
        return dist


class GatewayHolds(HoldManager):
    """``HoldManager`` for the gateway's sessions on one engine (see the module's
    hazards: its own table, the worker's held tokens counted in the cap).

    Its table is written by the tick, when it changed (or to renew its expiry), not at
    each decision: a call's after-call work then costs one Redis transaction less, and
    an idle gateway writes nothing. The table lags the holds by at most one tick."""

    def __init__(self, *args: Any, instance: str = "gateway",
                 others_held: Callable[[], int] = lambda: 0, **kwargs: Any) -> None:
        """``instance``: the gateway's (its table's key); ``others_held``: what the other
        gateways' holds keep on this engine (counted in the cap)."""
        super().__init__(*args, **kwargs)
        self._table_key = GATEWAY_HOLDS_KEY.format(self._engine, instance)
        self._others_held = others_held
        self._ticking = False
        # One tick at a time: the pool's loop and a caller (a test, a final call's
        # bookkeeping) may tick at once, and a tick ending must not clear the flag of
        # one still running (its table would then go unwritten).
        self._tick_lock = asyncio.Lock()
        self._published: dict[str, str] | None = None
        self._published_at = 0.0

    @property
    def held_tokens(self) -> int:
        info = self._info()
        return self.own_held_tokens + (info.held_tokens if info is not None else 0) \
            + self._others_held()

    @property
    def own_held_tokens(self) -> int:
        """The gateway's holds' blocks, each once (``HoldManager.held_tokens``); blocks
        a worker's hold keeps too are counted on both sides (an overestimate)."""
        return super().held_tokens

    async def tick(self) -> None:
        async with self._tick_lock:
            self._ticking = True
            try:
                await super().tick()
            finally:
                self._ticking = False
            if self.holds:
                await self._make_room()  # the worker's holds may have grown since

    async def end(self, session: str) -> bool:
        """The session's final call: its hold (if any) ends now."""
        hold = self.holds.get(session)
        if hold is None or not self._forget(hold):
            return False
        await self._count(released_final=1)
        await self._write_table()
        return True

    async def abandon(self) -> None:
        """The engine left the fleet: its holds are gone with it."""
        n = len(self.holds)
        self.holds.clear()
        if n:
            await self._count(released_lost=n)
        await self._write_table()

    async def clear(self) -> None:
        """The gateway stops: its holds end with it (their blocks age out of the LRU)."""
        self.holds.clear()
        await self._write_table()

    async def _publish(self) -> None:
        if not self._ticking:
            return  # a decision's: the next tick writes the table
        records = {j: h.record() for j, h in self.holds.items()}
        if records != self._published or \
                time.monotonic() - self._published_at > TABLE_TTL_S / 3:
            await self._write_table(records)

    async def _write_table(self, records: dict[str, str] | None = None) -> None:
        key = self._table_key
        table = records if records is not None else {
            j: h.record() for j, h in self.holds.items()}

        async def write() -> bool:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            if table:
                pipe.hset(key, mapping={k: v for k, v in table.items()})
                pipe.expire(key, TABLE_TTL_S)
            await pipe.execute()
            return True

        if await self._outage.attempt("hold table", write, False, timeout_s=REDIS_TIMEOUT_S):
            self._published, self._published_at = table, time.monotonic()


class HoldPool:
    """One ``GatewayHolds`` per live engine, each ticking in its own task."""

    def __init__(self, *, http: httpx.AsyncClient, redis: aioredis.Redis, pauses: PauseStats,
                 config: HoldConfig, directory: PrefixDirectory, outage: RedisOutage,
                 engine_info: Callable[[str], EngineHeartbeat | None],
                 ttl_cache: Callable[[str], TtlCacheEndpoint | None] = lambda _: None,
                 others_held: Callable[[str], int] = lambda _: 0,
                 instance: str = "gateway", tick_s: float = 0.25) -> None:
        """``others_held``: what the other gateways' holds keep on an engine;
        ``instance``: this gateway's (its hold tables are its own)."""
        self._http, self._redis, self._pauses = http, redis, pauses
        self._others_held, self._instance = others_held, instance
        self._config, self._dir, self._outage = config, directory, outage
        self._info, self._ttl_cache, self._tick_s = engine_info, ttl_cache, tick_s
        self.managers: dict[str, GatewayHolds] = {}
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._seen_at: dict[str, float] = {}

    def manager(self, engine_id: str) -> GatewayHolds | None:
        return self.managers.get(engine_id)

    def held(self) -> dict[str, int]:
        """Tokens this gateway's holds keep on each engine (``GatewayHolds.own_held_tokens``)."""
        return {e: m.own_held_tokens for e, m in self.managers.items()}

    async def sync(self, engines: dict[str, EngineHeartbeat]) -> None:
        """Follow the fleet: a manager for each new engine, the engine's churn fed from
        each new heartbeat, the holds of an engine that left dropped."""
        for engine_id, hb in engines.items():
            m = self.managers.get(engine_id)
            if m is None:
                m = self._start(hb)
            if self._seen_at.get(engine_id) != hb.at:
                self._seen_at[engine_id] = hb.at
                m.observe_engine(hb.prefill_computed_total)
        for engine_id in [e for e in self.managers if e not in engines]:
            await self._stop(engine_id)

    def resume(self, session: str) -> None:
        """The session's next call is here: its hold has done its work."""
        for m in self.managers.values():
            m.resume(session)

    async def end(self, session: str) -> None:
        for m in list(self.managers.values()):
            await m.end(session)

    async def close(self) -> None:
        """Stop ticking and take the tables down."""
        for task in self._tasks.values():
            task.cancel()
        for task in self._tasks.values():
            await stop_task(task)
        self._tasks.clear()
        for m in self.managers.values():
            await m.clear()

    def _start(self, hb: EngineHeartbeat) -> GatewayHolds:
        engine_id = hb.engine_id
        m = GatewayHolds(engine_id=engine_id, base_url=hb.url, model=hb.model, http=self._http,
                         redis=self._redis, pauses=self._pauses,
                         engine_info=functools.partial(self._info, engine_id),
                         config=self._config, directory=self._dir,
                         ttl_cache=self._ttl_cache(engine_id), outage=self._outage,
                         instance=self._instance,
                         others_held=functools.partial(self._others_held, engine_id))
        self.managers[engine_id] = m
        self._tasks[engine_id] = asyncio.ensure_future(m.run(self._tick_s))
        return m

    async def _stop(self, engine_id: str) -> None:
        m = self.managers.pop(engine_id, None)
        if m is None:  # another sync stopped it meanwhile
            return
        self._seen_at.pop(engine_id, None)
        task = self._tasks.pop(engine_id, None)
        if task is not None:
            await stop_task(task)
        log.info("engine_holds_dropped", engine=engine_id, holds=len(m.holds))
        await m.abandon()
