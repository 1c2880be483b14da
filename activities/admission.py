"""Batch admission on one engine: at most K batch-lane steps run at once.

vLLM's priority scheduling lets an interactive request jump the queue, but it does not
preempt running batch requests, and every running sequence slows each decode
iteration. So the worker beside the engine caps the batch steps it lets through, and
adapts the cap (``warmloop.workflows.lanes.next_batch_limit``) to the interactive TTFT it sees.

Who goes first matters as much as how many: a waiting step of a job already under way
goes before the first step of a new job (oldest job first). A burst then runs about K
jobs to completion at a time, and their prefixes stay in the engine's KV between
steps, instead of every job of the burst taking turns and each step finding its
prefix evicted by the others'. K is also held to what fits in the KV pool at the
batch steps' observed prompt size.

K is the engine's, not one process's: its inference worker and every gateway replica
admit batch calls to it, so with ``AdmissionConfig.shared_slots`` each slot is also a
lease in Redis (``SharedBatchSlots``), and N processes together run at most K. The
order above holds within each process; across them, whoever asks first when a slot
frees gets it.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import os
import socket
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Coroutine
from typing import Any, Protocol

import redis.asyncio as aioredis
import structlog

from warmloop.activities.registry import (
    REDIS_ERRORS,
    RedisOutage,
    redis_text,
    stop_if_cancelled,
)
from warmloop.workflows.calibration import EngineCalibration
from warmloop.workflows.lanes import (
    AdmissionConfig,
    calibrated_k_start,
    kv_fit_limit,
    next_batch_limit,
)

log = structlog.get_logger(__name__)

# Jobs remembered as "under way" (their first admission time); the oldest are forgotten.
_MAX_TRACKED_JOBS = 10_000

BATCH_SLOTS_KEY = "warmloop:batch-slots:{}"
"""An engine's batch slots in use, fleet-wide: a sorted set of slot tokens (one per
batch call admitted, ``<holder>:<run>:<n>``) scored by when their lease ends, in Redis's
own clock (``TIME``), so no two hosts' clocks are compared."""
SHARED_POLL_S = 0.1
"""How often a process's next call for a fleet slot asks again. One call a process
asks at a time (the first its own order admitted), the others wait behind it."""
SHARED_REDIS_TIMEOUT_S = 1.0
LOCAL_AFTER_S = 5.0
"""How long Redis must have been away before a process admits batch calls on its own
K alone: a blip must not let every call waiting for a fleet slot in at once."""

# KEYS[1]: the engine's slots; ARGV: limit, token, lease seconds. 1: taken (or already
# held: a retry of a take whose answer was lost finds its own token).
_TAKE_SLOT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
if redis.call('ZSCORE', KEYS[1], ARGV[2]) then return 1 end
if redis.call('ZCARD', KEYS[1]) >= tonumber(ARGV[1]) then return 0 end
local lease = tonumber(ARGV[3])
redis.call('ZADD', KEYS[1], now + lease, ARGV[2])
local want = math.ceil(lease * 1000)
if redis.call('PTTL', KEYS[1]) < want then redis.call('PEXPIRE', KEYS[1], want) end
return 1
"""

# KEYS[1]: the engine's slots; ARGV: lease seconds, then the tokens held. Every token
# gets a new lease; the answer is how many had lapsed (a holder away longer than a
# lease, a flushed Redis) and are counted again.
_RENEW_SLOTS = """
local t = redis.call('TIME')
local lease = tonumber(ARGV[1])
local until_ = tonumber(t[1]) + tonumber(t[2]) / 1000000 + lease
local lapsed = 0
for i = 2, #ARGV do
  lapsed = lapsed + redis.call('ZADD', KEYS[1], until_, ARGV[i])
end
local want = math.ceil(lease * 1000)
if redis.call('PTTL', KEYS[1]) < want then redis.call('PEXPIRE', KEYS[1], want) end
return lapsed
"""


async def batch_slots_in_use(redis: aioredis.Redis, engine_ids: list[str]) -> dict[str, int]:
    """Each engine's batch slots in use fleet-wide (every holder's; leases ended not
    counted): Redis's clock, then one pipelined count per engine."""
    t = await redis.time()
    now = t[0] + t[1] / 1e6
    pipe = redis.pipeline(transaction=False)
    for e in engine_ids:
        pipe.zcount(BATCH_SLOTS_KEY.format(e), f"({now}", "+inf")
    return {e: int(n) for e, n in zip(engine_ids, await pipe.execute(), strict=True)}


class SharedBatchSlots:
    """One process's side of an engine's fleet-wide batch slots (``BATCH_SLOTS_KEY``).

    Each slot is a lease: a process that dies (or stalls past ``lease_s``) with calls
    admitted loses their slots when the leases end, so a crashed gateway cannot shrink
    an engine's K for good. The holder renews its leases (``renew_if_due``) from a loop
    of its own: the inference worker's heartbeat, the gateway's fleet refresh; a renewal
    also counts again the slots whose leases lapsed while Redis was away.

    Redis away: a take waits (``take`` answers False) until Redis has been away
    ``local_after_s``; after that, slots are the process's own alone (``take`` admits
    at its local K, as before shared slots): a fleet that cannot coordinate keeps its
    batch lane running rather than stopped. Its own ``RedisOutage``: a failed call of
    another part of the process (the directory, the holds) does not let it in.

    Hazard: a holder's name must be its own (a restarted worker clears what its
    predecessor of the same name left, ``forget_predecessors``)."""

    def __init__(self, redis: aioredis.Redis, engine_id: str, *, holder: str | None = None,
                 lease_s: float = 30.0, local_after_s: float = LOCAL_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``holder``: this process, in its tokens (``host-pid`` unless given)."""
        self._redis = redis
        self.engine_id = engine_id
        self.key = BATCH_SLOTS_KEY.format(engine_id)
        self.holder = holder or f"{socket.gethostname()}-{os.getpid()}"
        self.lease_s = lease_s
        self.local_after_s = local_after_s
        self._outage = RedisOutage(clock=clock)
        self._clock = clock
        self._serial = itertools.count()
        # a restarted holder of the same name must not take its predecessor's tokens
        self._run = os.urandom(3).hex()
        self.tokens: list[str] = []
        """This process's slots now, a token each (one taken while Redis was away is
        recorded too: it may have reached Redis, and giving it back costs nothing)."""
        self._renewed_at = clock()
        self._take = redis.register_script(_TAKE_SLOT)
        self._renew = redis.register_script(_RENEW_SLOTS)
        self._turn = asyncio.Lock()
        """One call of this process asks for a slot at a time, in the order the process
        admitted them (``asyncio.Lock`` is first come, first served)."""
        self._background: set[asyncio.Task[None]] = set()

    @classmethod
    def for_engine(cls, redis: aioredis.Redis, engine_id: str, config: AdmissionConfig, *,
                   holder: str | None = None) -> SharedBatchSlots | None:
        """The engine's shared slots as ``config`` sets them (``shared_slots``,
        ``slot_lease_s``); None with shared slots off."""
        if not config.shared_slots:
            return None
        return cls(redis, engine_id, holder=holder, lease_s=config.slot_lease_s)

    def new_token(self) -> str:
        return f"{self.holder}:{self._run}:{next(self._serial)}"

    async def take(self, limit: int, token: str) -> bool:
        """``token``'s slot if fewer than ``limit`` are in use fleet-wide (or Redis has
        been away ``local_after_s``). Asked again with the same token after a lost
        answer, it finds the slot it took."""
        if self._outage.should_try():
            try:
                async with asyncio.timeout(SHARED_REDIS_TIMEOUT_S):
                    taken = await self._take(keys=[self.key], args=[limit, token, self.lease_s])
            except REDIS_ERRORS as e:
                self._outage.failed(e, what="batch slots")
            else:
                self._outage.ok()
                if taken:
                    self.tokens.append(token)
                return bool(taken)
        if self._outage.away_s >= self.local_after_s:
            self.tokens.append(token)
            return True
        return False

    async def wait(self, limit: Callable[[], int], *,
                   on_wait: Callable[[], None] | None = None) -> None:
        """Wait for a slot, behind this process's calls that asked before; ``limit``
        read at each try (K moves); ``on_wait`` about every second while waiting."""
        token = self.new_token()
        try:
            async with self._turn:
                beat_at = self._clock() + 1.0
                while not await self.take(limit(), token):
                    stop_if_cancelled()
                    await asyncio.sleep(SHARED_POLL_S)
                    if on_wait is not None and self._clock() >= beat_at:
                        on_wait()
                        beat_at = self._clock() + 1.0
        except BaseException:
            if token in self.tokens:
                self.tokens.remove(token)
            # cancelled while Redis ran the take: its slot may be there, unrecorded
            self._in_background(self._remove([token]))
            raise

    async def give_back(self) -> None:
        """One of this process's slots (they are alike: any will do)."""
        if self.tokens:
            await self._remove([self.tokens.pop()])

    async def renew_if_due(self) -> None:
        """Renew this process's leases when a third of a lease has passed since the last
        renewal that reached Redis (after a failed one: at every call)."""
        now = self._clock()
        if not self.tokens or now - self._renewed_at < self.lease_s / 3:
            return
        held = list(self.tokens)
        lapsed = await self._outage.attempt(
            "batch slots", lambda: self._renew(keys=[self.key], args=[self.lease_s, *held]),
            None, timeout_s=SHARED_REDIS_TIMEOUT_S, probe=True)
        if lapsed is None:
            return
        self._renewed_at = now
        # a slot given back while the renewal was on its way may have been put back by it
        if gone := [t for t in held if t not in self.tokens]:
            await self._remove(gone)
        if lapsed:
            log.warning("batch_slots_lapsed", engine=self.engine_id, slots=int(lapsed),
                        why="leases ended while their calls ran (Redis away or this "
                            "process stalled); counted again")

    async def forget_predecessors(self) -> int:
        """Give back the slots an earlier process of this holder's name left (a worker
        restarted after a crash: its engine's one worker), instead of waiting out their
        leases; how many. Were another process of the name alive, its renewal would
        count its slots again (a renewal puts lapsed tokens back)."""
        mine = f"{self.holder}:"
        ours = f"{mine}{self._run}:"
        async def members() -> list[str]:
            raw: list[Any] = await self._redis.zrange(self.key, 0, -1)
            return [redis_text(x) for x in raw]

        none: list[str] = []
        found = await self._outage.attempt("batch slots", members, none,
                                           timeout_s=SHARED_REDIS_TIMEOUT_S, probe=True)
        left = [m for m in found if m.startswith(mine) and not m.startswith(ours)]
        await self._remove(left)
        return len(left)

    async def in_use(self) -> int:
        """Slots in use fleet-wide, leases ended not counted."""
        return (await batch_slots_in_use(self._redis, [self.engine_id]))[self.engine_id]

    async def clear(self) -> None:
        """Give back every slot (the process is stopping)."""
        live, self.tokens = self.tokens, []
        await self._remove(live)

    async def _remove(self, tokens: list[str]) -> None:
        if tokens:
            await self._outage.attempt("batch slots", lambda: self._redis.zrem(self.key, *tokens),
                                       0, timeout_s=SHARED_REDIS_TIMEOUT_S, probe=True)

    def _in_background(self, coro: Coroutine[Any, Any, None]) -> None:
        task = asyncio.ensure_future(coro)
        self._background.add(task)
        task.add_done_callback(self._background.discard)


class KvPool(Protocol):
    """An engine's KV pool as its heartbeat describes it (``EngineHeartbeat``)."""

    @property
    def kv_capacity_tokens(self) -> int: ...

    @property
    def block_size(self) -> int: ...


class BatchAdmission:
    def __init__(self, config: AdmissionConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic,
                 kv_pool: Callable[[], KvPool | None] | None = None,
                 shared: SharedBatchSlots | None = None,
                 ceiling: Callable[[], int | None] | None = None) -> None:
        """``kv_pool``: the engine's KV pool and its block size, read at each decision
        (its latest heartbeat; None or 0 tokens: unknown, no KV fit). ``shared``: the
        engine's fleet-wide slots, which every batch call admitted here also takes
        (None: this process's K is the engine's). ``ceiling``: K as the engine's own
        admission sets it (its inference worker's heartbeat, for a gateway): this
        process's K is never above it, so every sharer asks Redis with one K (the
        worker's, which sees the engine's batch steps and interactive TTFT); None
        while unknown."""
        self.config = config or AdmissionConfig()
        self.limit = min(self.config.k_max, max(self.config.k_min, self.config.k_start))
        """K as adapted to interactive TTFT (before the KV fit)."""
        self.active = 0
        self.waiting = 0
        self._ttfts: deque[float] = deque(maxlen=self.config.window)
        self._prompt_tokens: deque[tuple[int, int]] = deque(maxlen=self.config.window)
        self._last_interactive: float | None = None
        self._last_adjust = clock()
        self._clock = clock
        self._kv_pool = kv_pool or (lambda: None)
        # (order, arrival, future): a min-heap of waiters, continuing jobs first
        self._waiters: list[tuple[tuple[int, float], int, asyncio.Future[None]]] = []
        self._arrivals = itertools.count()
        self._started: OrderedDict[str, float] = OrderedDict()
        self._fleet_p95: float | None = None
        self.shared = shared
        self._ceiling = ceiling or (lambda: None)
        self.fleet_waiting = 0
        """Calls admitted here waiting for one of the engine's shared slots (counted in
        ``active``, not in ``waiting``)."""

    def calibrate(self, calibration: EngineCalibration) -> None:
        """Start K where the engine's calibration says interactive TTFT holds
        (``calibrated_k_start`` at its reference prompt). Only before any interactive
        step is measured here: after that, AIMD on what the engine does rules. Only
        with ``AdmissionConfig.k_start_from_calibration``. The calibration's
        ``batch_k_max`` becomes K's ceiling unless the settings set ``k_max``."""
        self.config = calibration.admission_config(self.config)
        if not self.config.k_start_from_calibration or self._ttfts \
                or self._last_interactive is not None:
            return
        ref = calibration.reference_prompt_tokens

        def worst_ttft_s(k: int) -> float:
            return (calibration.step_overhead_s + (k + 1) * calibration.prefill_seconds(ref)
                    + calibration.decode_step_seconds(k + 1))

        k = calibrated_k_start(worst_ttft_s, self.config)
        if k != self.limit:
            self._set(k, why=f"calibration ({calibration.source[:40]})")

    @property
    def kv_fit(self) -> int | None:
        """Batch jobs whose own blocks fit in ``kv_share`` of the pool at the batch
        steps seen lately (``kv_fit_limit``); None before any (or the pool unknown)."""
        pool = self._kv_pool()
        if pool is None:
            return None
        return kv_fit_limit(pool.kv_capacity_tokens, list(self._prompt_tokens), self.config,
                            block_tokens=max(1, pool.block_size)) or None

    @property
    def effective_limit(self) -> int:
        """K after the KV fit (and under the ``ceiling``): the batch steps admitted at
        once."""
        fit = self.kv_fit
        k = max(self.config.k_min, min(self.limit, fit)) if fit else self.limit
        ceiling = self._ceiling()
        return k if ceiling is None else min(k, ceiling)

    def interactive_p95_ms(self) -> float | None:
        if not self._ttfts:
            return None
        s = sorted(self._ttfts)
        return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]

    def recent_interactive_p95_ms(self) -> float | None:
        """This engine's interactive TTFT p95, or None when it has seen no interactive
        step for ``idle_grow_s`` (what it publishes for its neighbours)."""
        last = self._last_interactive
        if last is None or self._clock() - last > self.config.idle_grow_s:
            return None
        return self.interactive_p95_ms()

    def observe_fleet(self, others_p95_ms: list[float]) -> None:
        """The other engines' recent interactive TTFT p95s (each heartbeat). Over target
        anywhere: K halves (at most once per ``idle_grow_s``) and does not grow while
        idle here; the neighbours' interactive steps share this engine's host."""
        if not self.config.fleet_signal:
            return
        worst = max(others_p95_ms, default=None)
        self._fleet_p95 = worst
        if worst is not None and worst > self.config.interactive_ttft_target_ms \
                and self._clock() - self._last_adjust > self.config.idle_grow_s:
            self._set(max(self.config.k_min, self.limit // 2), why="neighbour over target")

    def _order(self, job_id: str | None) -> tuple[int, float]:
        started = self._started.get(job_id) if job_id else None
        return (0, started) if started is not None else (1, 0.0)

    def _mark_started(self, job_id: str | None) -> None:
        if job_id and job_id not in self._started:
            self._started[job_id] = self._clock()
            while len(self._started) > _MAX_TRACKED_JOBS:
                self._started.popitem(last=False)

    def _wake(self) -> None:
        limit = self.effective_limit
        while self._waiters and self.active < limit:
            _, _, fut = heapq.heappop(self._waiters)
            if fut.done():  # its step was cancelled while waiting
                continue
            self.active += 1
            fut.set_result(None)

    async def acquire(self, job_id: str | None = None,
                      on_wait: Callable[[], None] | None = None) -> None:
        """Wait for a batch slot; ``on_wait`` runs every second while waiting (heartbeat).

        ``job_id`` orders the waiters: steps of jobs admitted before go first, oldest job
        first; a new job's first step waits its turn (arrival order). With ``shared``
        slots, a call admitted here then waits for one of the engine's fleet-wide."""
        await self._acquire_here(job_id, on_wait)
        if self.shared is not None:
            try:
                await self._acquire_shared(on_wait)
            except BaseException:
                self.active -= 1  # cancelled waiting for the fleet: the slot goes on here
                self._wake()
                raise
        # under way from here (not while it waited: one cancelled then has not begun)
        self._mark_started(job_id)

    async def _acquire_shared(self, on_wait: Callable[[], None] | None) -> None:
        shared = self.shared
        assert shared is not None
        self.fleet_waiting += 1
        try:
            await shared.wait(lambda: self.effective_limit, on_wait=on_wait)
        finally:
            self.fleet_waiting -= 1

    async def _acquire_here(self, job_id: str | None,
                            on_wait: Callable[[], None] | None) -> None:
        if not self._waiters and self.active < self.effective_limit:
            self.active += 1
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        heapq.heappush(self._waiters, (self._order(job_id), next(self._arrivals), fut))
        self.waiting += 1
        try:
            while True:
                try:
                    await asyncio.wait_for(asyncio.shield(fut), timeout=1.0)
                    break
                except TimeoutError:
                    self._grow_if_idle()
                    self._wake()
                    if on_wait is not None:
                        on_wait()
        except asyncio.CancelledError:
            if fut.done() and not fut.cancelled():
                self.active -= 1  # the slot came with the cancellation: hand it on
                self._wake()
            else:
                fut.cancel()
            raise
        finally:
            self.waiting -= 1

    async def release(self) -> None:
        try:
            if self.shared is not None:
                await self.shared.give_back()
        finally:
            self.active -= 1
            self._grow_if_idle()
            self._wake()

    def observe_batch(self, prompt_tokens: int, shared_tokens: int = 0) -> None:
        """A batch step's prompt size, and how much of it every job of its profile
        shares: K is held to the jobs that fit in the KV pool."""
        self._prompt_tokens.append((prompt_tokens, min(shared_tokens, prompt_tokens)))

    async def observe_interactive(self, ttft_ms: float) -> None:
        """An interactive step's TTFT: K halves at once when p95 is over target, and
        grows by one at most once per window of observations."""
        self._ttfts.append(ttft_ms)
        self._last_interactive = self._clock()
        p95 = self.interactive_p95_ms()
        if p95 is not None and self._fleet_p95 is not None:
            p95 = max(p95, self._fleet_p95)  # grow only when the neighbours are fine too
        new = next_batch_limit(self.limit, p95, self.config)
        if new < self.limit or (new > self.limit and len(self._ttfts) >= self.config.window
                                and self._clock() - self._last_adjust > 1.0):
            self._set(new)

    def _grow_if_idle(self) -> None:
        now = self._clock()
        if self.limit == 0 and now - self._last_adjust > self.config.idle_grow_s:
            # k_min 0: a stopped lane tries one step again after a pause, or a host busy
            # for other reasons (p95 between 0.6x and 1x target) would stop it for good
            self._set(1, why="retry after a pause")
            return
        idle = (self._last_interactive is None
                or now - self._last_interactive > self.config.idle_grow_s) and \
            (self._fleet_p95 is None
             or self._fleet_p95 < 0.6 * self.config.interactive_ttft_target_ms)
        if idle and now - self._last_adjust > self.config.idle_grow_s \
                and self.limit < self.config.k_max:
            self.limit = next_batch_limit(self.limit, None, self.config)
            self._last_adjust = now
            self._ttfts.clear()
            log.info("batch_limit", k=self.limit, effective=self.effective_limit,
                     why="no interactive steps", fleet_p95_ms=self._fleet_p95)

    def _set(self, k: int, why: str = "interactive TTFT here") -> None:
        p95 = self.interactive_p95_ms()
        if k < self.limit:
            # judge the smaller K on fresh samples, not on the ones that cut it
            self._ttfts.clear()
        self.limit = k
        self._last_adjust = self._clock()
        log.info("batch_limit", k=k, effective=self.effective_limit,
                 interactive_ttft_p95_ms=p95, fleet_p95_ms=self._fleet_p95, why=why)
        self._wake()
