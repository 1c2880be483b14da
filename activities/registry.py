"""Engine registry in Redis: each inference worker heartbeats its engine with a TTL.

An engine whose worker stops leaves the registry by itself when its key expires; a
worker that comes back rejoins with its next heartbeat.
"""

from __future__ import annotations

import asyncio
import random
import re
import time
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass
from typing import Any, TypeVar

import redis.asyncio as aioredis
import structlog
from pydantic import BaseModel
from redis.exceptions import RedisError, WatchError

from warmloop.workflows.calibration import EngineCalibration
from warmloop.workflows.routing import EngineOffer, kv_taken
from warmloop.workflows.tenants import HOUR_S, hour_window

log = structlog.get_logger(__name__)
T = TypeVar("T")

REDIS_ERRORS: tuple[type[Exception], ...] = (RedisError, OSError)
"""What a Redis call raises when Redis is away: redis-py's own errors, and the socket's
(``OSError``, which includes ``TimeoutError``, the ``asyncio.timeout`` of a hung one)."""


def stop_if_cancelled() -> None:
    """Raise ``CancelledError`` when this task was asked to stop and the request got lost.

    Hazard: redis-py (8.1 here) sometimes swallows a task's cancellation when it lands
    inside a command (the gateway measured a few in a hundred). A loop that goes on then
    never stops, and a worker's task group waits on it for good at shutdown, skipping
    its clean-up (the registry's leave, the steps' bookkeeping). The request is still
    counted (``Task.cancelling``) after the error was eaten, so loops that call Redis
    call this once a turn."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


class RedisOutage:
    """One process's view of whether Redis is away, for the callers to whom it is an
    optimisation (the registry, the prefix directory, holds, statistics).

    An outage is logged once when it starts and once when it ends, not once per failing
    call (a worker makes several a second). While it lasts, callers on a step's path
    ask ``should_try`` first: a hung Redis costs a socket timeout per call, so they skip
    it and try again only every ``probe_s`` (doubling up to ``max_probe_s``). Loops that
    run on their own clock (heartbeats) try every time and so notice its return.
    """

    def __init__(self, *, probe_s: float = 1.0, max_probe_s: float = 10.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._probe_s, self._max_probe_s = probe_s, max_probe_s
        self._since: float | None = None
        self._next_try = 0.0
        self._wait = probe_s
        self.failures = 0
        """Failed calls in the current outage."""

    @property
    def away(self) -> bool:
        return self._since is not None

    @property
    def away_s(self) -> float:
        """How long the current outage has lasted (0 while Redis answers)."""
        return 0.0 if self._since is None else self._clock() - self._since

    def should_try(self) -> bool:
        """False while Redis is away and its next probe is not due."""
        return self._since is None or self._clock() >= self._next_try

    def failed(self, error: BaseException, *, what: str) -> None:
        now = self._clock()
        self.failures += 1
        if self._since is None:
            self._since, self._wait = now, self._probe_s
            log.warning("redis_unavailable", what=what, error=str(error) or type(error).__name__)
        else:
            self._wait = min(self._max_probe_s, self._wait * 2)
        self._next_try = now + self._wait

    def ok(self) -> None:
        if self._since is not None:
            log.info("redis_back", away_s=round(self._clock() - self._since, 1),
                     failed_calls=self.failures)
            self._since, self.failures = None, 0

    async def attempt(self, what: str, call: Callable[[], Awaitable[T]], default: T, *,
                      timeout_s: float | None = None, probe: bool = False) -> T:
        """``call()``, or ``default`` when Redis is away (skipped while no probe is due,
        unless ``probe``) or fails; ``timeout_s`` bounds a hung one."""
        if not probe and not self.should_try():
            return default
        try:
            async with asyncio.timeout(timeout_s):
                result = await call()
        except REDIS_ERRORS as e:
            self.failed(e, what=what)
            return default
        self.ok()
        return result

ENGINE_KEY = "warmloop:engine:{}"
ENGINE_SET = "warmloop:engines"


class EngineHeartbeat(BaseModel):
    """What an inference worker says about its engine, about once a second."""

    engine_id: str
    task_queue: str
    model: str
    """The served model: a job whose profile names a model is routed only to its engines."""
    url: str
    healthy: bool
    priced: bool = False
    """Whether the engine declares a price (its worker prices every step); a job with a
    cost cap is routed only to priced engines. Heartbeats from before prices: False."""
    running: int = 0
    waiting: int = 0
    kv_usage: float = 0.0
    """Fraction of the KV pool in use, from vllm:kv_cache_usage_perc."""
    block_size: int = 16
    """Tokens per KV block: the unit of prefix caching (vllm:cache_config_info)."""
    kv_capacity_tokens: int = 0
    """Size of the KV pool in tokens (vllm:cache_config_info); 0 if not reported."""
    precise: bool = False
    """Whether the prefix directory follows this engine's KV events (else it estimates)."""
    held_tokens: int = 0
    """Prefix tokens the worker keeps warm for paused jobs."""
    prefill_computed_total: float = 0.0
    """Cumulative prompt tokens the engine computed (not from cache): its churn."""
    batch_limit: int | None = None
    """Batch steps the engine admits at once (K after the KV fit; 0: the lane is
    stopped here; adapted to interactive TTFT); None without batch admission."""
    batch_kv_fit: int | None = None
    """Batch jobs whose own tokens fit in the pool's batch share at the batch steps
    served lately (``lanes.kv_fit_limit``): what a batch asking the fleet for its window
    adds up. None before a batch step or without batch admission."""
    batch_active: int = 0
    batch_waiting: int = 0
    interactive_ttft_p95_ms: float | None = None
    room_regret: list[tuple[int, float]] | None = None
    """(room tokens, tokens a second): what the engine computed again that that much
    more room in its pool would have kept, at rooms doubling from 256
    (``EvictionRegret.curve``, from its KV events): the hold rent of holders that do not
    follow the events themselves (the gateway). None: not measured."""
    calibration: EngineCalibration | None = None
    """The figures the engine is priced, held and routed by: measured by ``warmloop
    calibrate`` or its preset (``source`` says which). None from workers before it."""
    at: float
    """Unix time of the heartbeat."""
    worker: str = ""
    """``host-pid`` of the inference worker that sent it: a key left by a worker killed
    moments ago (not yet expired) is told apart from a live one."""

    def offer(self) -> EngineOffer:
        return EngineOffer(engine_id=self.engine_id, model=self.model, priced=self.priced)

    def kv_taken(self, *, also_held: int = 0) -> float:
        """The KV usage the router compares (``workflows.routing.kv_taken``): vLLM's plus
        the worker's held tokens, and ``also_held`` (a gateway's own holds here)."""
        return kv_taken(self.kv_usage, held_tokens=self.held_tokens + also_held,
                        capacity_tokens=self.kv_capacity_tokens)


def calibrated_prefill_rate(hb: EngineHeartbeat, prompt_tokens: int | None) -> float | None:
    """The engine's calibrated prefill rate at ``prompt_tokens`` (its reference length
    when unknown); None for an engine that heartbeats without a calibration."""
    cal = hb.calibration
    if cal is None:
        return None
    return cal.prefill_tokens_per_s(prompt_tokens or cal.reference_prompt_tokens)


INFLIGHT_KEY = "warmloop:inflight:{}"
INFLIGHT_MAX_AGE_S = 600.0
"""A routed step not finished after this long is not counted (its worker died)."""
BATCH_JOBS_KEY = "warmloop:batchjobs:{}"
BATCH_JOB_RESIDENT_S = 30.0
"""A batch job counts as under way on an engine this long after its last step there."""
BATCH_CLAIMS_KEY = "warmloop:batchwindows"
"""Hash: batch id -> the window the fleet last gave it (``BatchClaim`` JSON)."""
BATCH_CLAIM_S = BATCH_JOB_RESIDENT_S
"""A batch's claimed window counts against others this long: until its jobs' first
steps make them count as under way."""


GATEWAY_HELD_KEY = "warmloop:gateway:held:{}"
"""Per gateway instance: what its holds keep on each engine (``GatewayHeld`` JSON), with
a Redis expiry of ``GATEWAY_HELD_TTL_S``. The inference workers' held tokens are in
their heartbeats; a gateway's holds are in none, so each gateway publishes its own for
the routers and the other gateways."""
GATEWAY_SET = "warmloop:gateways"
"""Sorted set: the gateway instances that published, by when they last did (the
readers' way to the keys; members silent for ``GATEWAY_FORGET_S`` are dropped)."""
GATEWAY_HELD_TTL_S = 30.0
"""A gateway's entry expires this long after it was written (the gateway died); live
gateways renew theirs well within it. Redis decides, so no two hosts' clocks are
compared."""
GATEWAY_FORGET_S = 3600.0
"""A gateway silent this long leaves ``GATEWAY_SET`` (its entry expired long before)."""


_UNREADABLE: set[str] = set()
"""Gateways whose entry did not parse, told once."""


def redis_text(value: Any, *, errors: str = "strict") -> str:
    """A value as Redis answered it, as text: clients built without
    ``decode_responses`` (the project's) answer bytes, others str. ``errors``: as
    ``bytes.decode``'s (strict: undecodable bytes raise ``UnicodeDecodeError``)."""
    return value.decode(errors=errors) if isinstance(value, bytes) else str(value)


class GatewayHeld(BaseModel):
    """Tokens one gateway's holds keep warm on each engine, for the routers (it is taken
    KV they cannot see: vLLM counts a held block as free) and the other gateways (the
    30 % hold cap is per engine, whoever holds)."""

    gateway: str
    engines: dict[str, int]
    at: float
    """Unix time it was published."""


class BatchClaim(BaseModel):
    """The window a batch was given, for batches that ask after it."""

    window: int
    model: str | None = None
    at: float

_METRIC = re.compile(r"^(vllm:[a-z_]+)(?:\{[^}]*\})?\s+([0-9.eE+-]+|NaN)\s*$")


def parse_vllm_metrics(text: str) -> dict[str, float]:
    """Sum each ``vllm:*`` sample across label sets (one engine, one model)."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line)
        if m and m.group(2) != "NaN":
            out[m.group(1)] = out.get(m.group(1), 0.0) + float(m.group(2))
    return out


async def nothing() -> None:
    """A no-op awaitable: the slot of an ``asyncio.gather`` of Redis calls (sent in one
    round) that has nothing to send this time."""


async def write_field_watched(
        redis: aioredis.Redis, key: str, field: str,
        decide: Callable[[dict[Any, Any]], tuple[str | None, list[str], T]], *,
        attempts: int = 12, expire_s: int | None = None) -> T:
    """Read the hash ``key`` and write its ``field`` as ``decide`` says, as one optimistic
    transaction (WATCH), retried on a conflict after a short random wait: of two callers
    deciding at once, the later to write decides again on what the earlier wrote.
    ``decide`` answers (the value to write, None to write nothing; fields to drop; what
    to return). After ``attempts`` conflicts it raises ``WatchError`` (a RedisError):
    it never writes unguarded, which under a burst let many callers decide on the same
    stale read. ``expire_s``: the hash's TTL, set with each write."""
    async with redis.pipeline(transaction=True) as pipe:
        for attempt in range(attempts):
            try:
                await pipe.watch(key)
                value, dead, answer = decide(await pipe.hgetall(key))
                if value is None:
                    return answer  # leaving the block unwatches
                pipe.multi()
                pipe.hset(key, field, value)
                if dead:
                    pipe.hdel(key, *dead)
                if expire_s is not None:
                    pipe.expire(key, expire_s)
                await pipe.execute()
                return answer
            except WatchError:
                await pipe.reset()
                await asyncio.sleep(random.uniform(0, 0.005 * (attempt + 1)))
    raise WatchError(f"{key}: {attempts} conflicting writers in a row; try again")


_CLAIM_START = """
local now, window, expire = tonumber(ARGV[1]), tonumber(ARGV[2]), tonumber(ARGV[3])
local me, limit, nrun = ARGV[4], tonumber(ARGV[5]), tonumber(ARGV[6])
local running, ended = {}, {}
for i = 7, 6 + nrun do running[ARGV[i]] = true end
for i = 7 + nrun, #ARGV do ended[ARGV[i]] = true end
local flat = redis.call('HGETALL', KEYS[1])
local count, mine = nrun, 0
for i = 1, #flat, 2 do
  local id, at = flat[i], tonumber(flat[i + 1])
  if at == nil or now - at > window or ended[id] then
    redis.call('HDEL', KEYS[1], id)
  elseif id == me then
    mine = 1
  elseif not running[id] then
    count = count + 1
  end
end
if count >= limit then return {0, count, mine} end
if mine == 0 then redis.call('HSET', KEYS[1], me, ARGV[1]) end
redis.call('EXPIRE', KEYS[1], expire)
return {1, count, mine}
"""
"""``TenantUsage.claim_start`` in one step on the server: count the tenant's jobs in
flight (the running ones the caller saw, plus the recorded starts it did not, less the
ended), and record this start if there is room."""


@dataclass(frozen=True)
class StartClaim:
    """What ``TenantUsage.claim_start`` decided, and on what count."""

    admitted: bool
    in_flight: int
    """The tenant's jobs counted in flight, this one not included."""
    recorded_before: bool
    """The workflow id had a recent start already (a repeated submit): it was kept, not
    written again, and is not this submit's to drop."""


def step_key(job_id: str, step: int, profile: str) -> str:
    """In-flight key of a routed step; the profile tells the router which prefixes an
    engine is computing right now (a burst's shared prefix is computed once per engine)."""
    return f"{job_id}:{step}|{profile}"


def step_key_profile(key: str) -> str:
    return key.rpartition("|")[2]


TENANT_TOKENS = "warmloop:tenant:{}:tokens:{}"
"""Tokens (prompt plus completion) a tenant's steps used in one clock hour: tenant,
hour window (``warmloop.workflows.tenants.hour_window``). Expires after the next hour."""
TENANT_STARTS = "warmloop:tenant:{}:starts"
"""A hash per tenant: the workflow ids a submit let start under ``max_jobs_in_flight``
(field) and when (epoch seconds). Temporal's visibility shows a start a little after it,
so two submits racing for a tenant's last slot would both see it free; each counts the
other's entry instead."""
TENANT_START_CLAIM_S = 300.0
"""How long a start's entry counts (beside visibility, not instead of it): far beyond
visibility's lag, so a job is never counted by neither."""


class TenantUsage:
    """Each tenant's tokens per clock hour, counted by the inference workers as steps
    end and read by the router (and a submit) against the tenant's ``tokens_per_hour``;
    and the jobs its submits started lately, which a submit counts beside Temporal's
    visibility against ``max_jobs_in_flight`` (``claim_start``).

    Fixed windows, one key each, that expire by themselves: a counter is one INCRBY per
    step, and a quota check one GET. Callers treat a Redis error as "unknown" and let
    the job go on (the quota fails open, logged by their RedisOutage)."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    async def add(self, tenant: str, tokens: int, now: float | None = None) -> None:
        if tokens <= 0:
            return
        key = TENANT_TOKENS.format(tenant, hour_window(time.time() if now is None else now))
        pipe = self._redis.pipeline(transaction=False)
        pipe.incrby(key, tokens)
        pipe.expire(key, 2 * HOUR_S)
        await pipe.execute()

    async def used(self, tenant: str, now: float | None = None) -> int:
        """The tenant's tokens in the window ``now`` falls in."""
        raw = await self._redis.get(
            TENANT_TOKENS.format(tenant, hour_window(time.time() if now is None else now)))
        return int(raw) if raw is not None else 0

    async def recent_starts(self, tenant: str) -> dict[str, float]:
        """The workflow ids the tenant's submits let start within
        ``TENANT_START_CLAIM_S`` (``claim_start``), with when (epoch seconds)."""
        raw = await self._redis.hgetall(TENANT_STARTS.format(tenant))
        return _live_starts(raw, time.time())

    async def claim_start(self, tenant: str, workflow_id: str, *, limit: int,
                          running: Collection[str], ended: Collection[str] = ()
                          ) -> StartClaim:
        """Record that ``workflow_id`` starts now if the tenant's jobs in flight leave room
        under ``limit``: ``running`` (visibility's), plus the starts recorded within
        ``TENANT_START_CLAIM_S`` that are neither running nor ``ended`` (Temporal says so;
        they are dropped). One Lua script, so submits racing for the last slot are
        counted one after another however many there are (a WATCH loop gave way under a
        burst of them)."""
        run = sorted(running)
        raw = await self._redis.eval(  # type: ignore[misc]
            _CLAIM_START, 1, TENANT_STARTS.format(tenant), repr(time.time()),
            str(TENANT_START_CLAIM_S), str(int(TENANT_START_CLAIM_S) + 60), workflow_id,
            str(limit), str(len(run)), *run, *sorted(ended))
        admitted, counted, mine = (int(v) for v in raw)
        return StartClaim(admitted=bool(admitted), in_flight=counted,
                          recorded_before=bool(mine))

    async def drop_start(self, tenant: str, workflow_id: str) -> None:
        """Forget ``workflow_id``'s start (its start failed: it holds no slot)."""
        await self._redis.hdel(TENANT_STARTS.format(tenant), workflow_id)


def _live_starts(raw: dict[Any, Any], now: float) -> dict[str, float]:
    """The starts within ``TENANT_START_CLAIM_S`` (workflow id: when); older ones, and
    values that are not a time, are left out (``claim_start`` drops them)."""
    live: dict[str, float] = {}
    for k, v in raw.items():
        try:
            at = float(v)
        except ValueError:
            continue
        if now - at <= TENANT_START_CLAIM_S:
            live[k.decode() if isinstance(k, bytes) else k] = at
    return live


_LABEL = re.compile(r'(\w+)="([^"]*)"')


def parse_cache_config(text: str) -> tuple[int, int]:
    """(block_size, KV pool size in tokens) from vLLM's ``vllm:cache_config_info`` labels;
    (0, 0) when the engine does not report them."""
    for line in text.splitlines():
        if line.startswith("vllm:cache_config_info{"):
            labels = dict(_LABEL.findall(line))
            bs = int(labels.get("block_size", "0") or 0)
            size = labels.get("kv_cache_size_tokens", "")
            if size.isdigit():
                return bs, int(size)
            blocks = labels.get("num_gpu_blocks", "")
            return bs, bs * int(blocks) if blocks.isdigit() else 0
    return 0, 0


def _live_claims(raw: dict[Any, Any], now: float) -> tuple[dict[str, BatchClaim], list[str]]:
    """The claims given within ``BATCH_CLAIM_S``, and the fields to drop (older, or not a
    claim this version can read)."""
    live: dict[str, BatchClaim] = {}
    dead: list[str] = []
    for k, v in raw.items():
        batch = k.decode() if isinstance(k, bytes) else k
        try:
            claim = BatchClaim.model_validate_json(v)
        except ValueError:  # pydantic's ValidationError is a ValueError
            dead.append(batch)
            continue
        if now - claim.at <= BATCH_CLAIM_S:
            live[batch] = claim
        else:
            dead.append(batch)
    return live, dead


class EngineRegistry:
    def __init__(self, redis: aioredis.Redis, *, ttl_s: float) -> None:
        self._redis = redis
        self._ttl_ms = int(ttl_s * 1000)

    async def heartbeat(self, hb: EngineHeartbeat) -> None:
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(ENGINE_KEY.format(hb.engine_id), hb.model_dump_json(), px=self._ttl_ms)
        pipe.sadd(ENGINE_SET, hb.engine_id)
        await pipe.execute()

    async def step_routed(self, engine_id: str, step_key: str, now: float | None = None) -> None:
        await self._redis.zadd(INFLIGHT_KEY.format(engine_id),
                               {step_key: time.time() if now is None else now})

    async def batch_job_routed(self, engine_id: str, job_id: str,
                               now: float | None = None) -> None:
        await self._redis.zadd(BATCH_JOBS_KEY.format(engine_id),
                               {job_id: time.time() if now is None else now})

    async def batch_jobs(self, engine_ids: list[str], now: float | None = None) -> dict[str, int]:
        """Batch jobs under way on each engine: a step routed there within
        ``BATCH_JOB_RESIDENT_S``. Between its steps a job has nothing in flight, but its
        transcript is cached there and its next step will come back."""
        since = (time.time() if now is None else now) - BATCH_JOB_RESIDENT_S
        pipe = self._redis.pipeline(transaction=False)
        for e in engine_ids:
            pipe.zremrangebyscore(BATCH_JOBS_KEY.format(e), "-inf", since)
            pipe.zcard(BATCH_JOBS_KEY.format(e))
        res = await pipe.execute()
        return {e: int(res[2 * i + 1]) for i, e in enumerate(engine_ids)}

    async def batch_job_ids(self, engine_ids: list[str], now: float | None = None
                            ) -> dict[str, list[str]]:
        """The batch jobs under way on each engine (as ``batch_jobs`` counts them), by id."""
        since = (time.time() if now is None else now) - BATCH_JOB_RESIDENT_S
        return await self._members_since(BATCH_JOBS_KEY, engine_ids, since)

    async def claim_batch_window(
            self, batch_id: str,
            decide: Callable[[dict[str, BatchClaim]], tuple[BatchClaim, T]], *,
            attempts: int = 5) -> T:
        """Read the windows other batches were given within ``BATCH_CLAIM_S`` and write
        ``batch_id``'s, ``decide``d from them (with what else ``decide`` answers, which is
        returned), as one optimistic transaction (WATCH): two
        batches asking at the same moment must not both decide on claims that lack the
        other's. Stale entries, and entries that do not parse (another version's), are
        dropped on the way. After ``attempts`` conflicts it raises ``WatchError``
        (``write_field_watched``)."""
        def write(raw: dict[Any, Any]) -> tuple[str | None, list[str], T]:
            live, dead = _live_claims(raw, time.time())
            live.pop(batch_id, None)
            claim, answer = decide(live)
            return claim.model_dump_json(), dead, answer

        return await write_field_watched(self._redis, BATCH_CLAIMS_KEY, batch_id, write,
                                         attempts=attempts)

    async def _members_since(self, key: str, engine_ids: list[str], since: float
                             ) -> dict[str, list[str]]:
        """Each engine's members of the sorted set ``key`` scored after ``since``, the
        older ones dropped from it on the way (one round trip)."""
        pipe = self._redis.pipeline(transaction=False)
        for e in engine_ids:
            pipe.zremrangebyscore(key.format(e), "-inf", since)
            pipe.zrange(key.format(e), 0, -1)
        res = await pipe.execute()
        return {e: [k.decode() if isinstance(k, bytes) else k for k in res[2 * i + 1]]
                for i, e in enumerate(engine_ids)}

    async def step_done(self, engine_id: str, step_key: str) -> None:
        await self._redis.zrem(INFLIGHT_KEY.format(engine_id), step_key)

    async def steps_done(self, done: list[tuple[str, str]]) -> None:
        """``step_done`` for several (engine id, step key) pairs, in one round trip."""
        pipe = self._redis.pipeline(transaction=False)
        for engine_id, key in done:
            pipe.zrem(INFLIGHT_KEY.format(engine_id), key)
        await pipe.execute()

    async def in_flight(self, engine_ids: list[str], now: float | None = None) -> dict[str, int]:
        """Steps routed to each engine and not finished (fresher than its heartbeat)."""
        return {e: len(keys) for e, keys in (await self.in_flight_steps(engine_ids, now)).items()}

    async def in_flight_steps(self, engine_ids: list[str],
                              now: float | None = None) -> dict[str, list[str]]:
        """The step keys routed to each engine and not finished."""
        since = (time.time() if now is None else now) - INFLIGHT_MAX_AGE_S
        return await self._members_since(INFLIGHT_KEY, engine_ids, since)

    async def publish_gateway_held(self, held: GatewayHeld) -> None:
        """Write ``held`` (expiring in ``GATEWAY_HELD_TTL_S``), and drop from
        ``GATEWAY_SET`` the gateways silent for ``GATEWAY_FORGET_S``: the writers keep
        the set, so that its readers (every route, every gateway's refresh) only read."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.set(GATEWAY_HELD_KEY.format(held.gateway), held.model_dump_json(),
                 px=int(GATEWAY_HELD_TTL_S * 1000))
        pipe.zadd(GATEWAY_SET, {held.gateway: held.at})
        pipe.zremrangebyscore(GATEWAY_SET, "-inf", held.at - GATEWAY_FORGET_S)
        await pipe.execute()

    async def gateway_gone(self, gateway: str) -> None:
        """The gateway stopped: its holds end with it, and no router should count them."""
        pipe = self._redis.pipeline(transaction=False)
        pipe.delete(GATEWAY_HELD_KEY.format(gateway))
        pipe.zrem(GATEWAY_SET, gateway)
        await pipe.execute()

    async def gateways(self, now: float | None = None) -> list[str]:
        """The gateway instances that published within ``GATEWAY_FORGET_S``."""
        since = (time.time() if now is None else now) - GATEWAY_FORGET_S
        return [redis_text(g, errors="replace")
                for g in await self._redis.zrangebyscore(GATEWAY_SET, since, "+inf")]

    async def gateways_held(self, *, exclude: str | None = None,
                            names: list[str] | None = None) -> dict[str, int]:
        """Tokens every gateway's holds keep on each engine (but ``exclude``'s, a
        gateway's own), from the entries not expired; ``names``: the gateways, as
        ``gateways()`` gave them lately (default: read them now). An entry that does not parse
        (another version's, or garbage) counts for nothing (logged once); it expires
        like any other.

        Hazard: a prompt's blocks held by two gateways are counted by each (each counts
        its own holds' blocks once), so with replicas sharing a profile the routers and
        the cap see more taken than is: holds go early, never over the cap."""
        names = [g for g in (await self.gateways() if names is None else names)
                 if g != exclude]
        if not names:
            return {}
        total: dict[str, int] = {}
        for name, value in zip(names, await self._redis.mget(
                [GATEWAY_HELD_KEY.format(g) for g in names]), strict=True):
            if value is None:
                continue  # expired: that gateway died, or is away from Redis
            try:
                held = GatewayHeld.model_validate_json(value)
            except ValueError:
                if name not in _UNREADABLE:
                    _UNREADABLE.add(name)
                    log.warning("gateway_held_unreadable", gateway=name)
                continue
            for engine_id, tokens in held.engines.items():
                total[engine_id] = total.get(engine_id, 0) + max(0, tokens)
        return total

    async def leave(self, engine_id: str) -> None:
        await self._redis.delete(ENGINE_KEY.format(engine_id))

    async def live(self, *, now: float | None = None) -> list[EngineHeartbeat]:
        """Healthy engines with an unexpired heartbeat, sorted by id."""
        ids = sorted(i.decode() if isinstance(i, bytes) else i
                     for i in await self._redis.smembers(ENGINE_SET))
        if not ids:
            return []
        raw = await self._redis.mget([ENGINE_KEY.format(i) for i in ids])
        now = time.time() if now is None else now
        live = []
        for r in raw:
            if r is None:
                continue
            hb = EngineHeartbeat.model_validate_json(r)
            if hb.healthy and now - hb.at <= self._ttl_ms / 1000:
                live.append(hb)
        return live
