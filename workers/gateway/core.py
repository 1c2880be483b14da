"""The gateway's work for one call, apart from HTTP: route, send, relay, then learn.

1. The call's session (if any) ends its pause: the pause is measured into the pause
   statistics and the session's hold, which has done its work, ends.
2. Its route: the longest learned chain of its prompt's prefixes (else the session's
   last prompt chain) against the prefix directory, the engines' load, the session's
   last engine, into the workflows' ``choose_engine`` (``GatewayRouter``). A batch-lane
   call then waits for a slot in that engine's batch admission, as a batch step does.
3. The engine request: the client's body (with the lane's vLLM priority and the
   gateway's cache salt when they change it). An engine that refuses the connection,
   drops it before answering or answers 503 is set aside and the next is tried.
4. The answer, relayed unchanged (``warmloop.workers.gateway.relay``; a tenant's
   stream loses only the usage event the gateway asked for itself). An engine that
   dies after it began answering gives the client a clean error (an SSE error event, or
   a 502), and the session's next call goes elsewhere.
5. After the answer, off its path: the prompt is tokenized on the engine that served
   it, its block chain learned and recorded in the prefix directory as the workers
   record theirs, and the session's hold decided (``HoldManager.after_step``). This
   work starts ``learn_delay_s`` after the answer, is dropped when the session's next
   call came meanwhile, and gives way to calls being routed (it waits while one is),
   so that back-to-back calls are not slowed by the bookkeeping of the calls before.

Hazard: a call whose engine died after it began is not retried, streamed or not: the
engine may have died of the call itself, and a retry would take the next engine down
with it. The client (or its agent framework) decides.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import time
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, cast

import httpx
import redis.asyncio as aioredis
import structlog

from warmloop.activities.admission import BatchAdmission, SharedBatchSlots
from warmloop.activities.directory import (
    MAX_WALK_BLOCKS,
    PrefixDirectory,
    PromptChain,
    prompt_chain,
)
from warmloop.activities.inference import HOLD_ERRORS
from warmloop.activities.registry import (
    REDIS_ERRORS,
    EngineHeartbeat,
    EngineRegistry,
    RedisOutage,
    TenantUsage,
    redis_text,
    stop_if_cancelled,
)
from warmloop.workers.clients import build_redis
from warmloop.workers.gateway.calls import TEXT_CHUNK_CHARS, Call
from warmloop.workers.gateway.config import GatewayConfig
from warmloop.workers.gateway.fleet import FleetView
from warmloop.workers.gateway.holds import (
    HoldPool,
    RecentPauseStats,
    kind_profile,
    pause_kind_of,
)
from warmloop.workers.gateway.metrics import Metrics
from warmloop.workers.gateway.relay import Outcome
from warmloop.workers.gateway.routing import GatewayRouter
from warmloop.workers.gateway.sessions import Chain, PromptIndex, Session, SessionTable
from warmloop.workers.gateway.tasks import stop_task
from warmloop.workers.gateway.upstream import (
    HttpxUpstream,
    RawUpstream,
    Upstream,
    UpstreamResponse,
)
from warmloop.workers.settings import Settings
from warmloop.workflows.contracts import Lane
from warmloop.workflows.holding import TtlCacheEndpoint
from warmloop.workflows.routing import RouteDecision, block_hashes
from warmloop.workflows.tenants import over_tokens

log = structlog.get_logger(__name__)

RETRY_ELSEWHERE: tuple[type[Exception], ...] = (
    httpx.ConnectError, httpx.ConnectTimeout, httpx.RemoteProtocolError, httpx.ReadError,
    httpx.WriteError)
"""Failures before the engine answered anything that say the engine is gone or refused
(connection refused or reset, closed without a response): tried on the next engine."""
RETRY_STATUSES = frozenset({503})
"""Answers that say the engine will not take the call now (overloaded, starting)."""
REDIS_TIMEOUT_S = 1.0
SESSIONS_STREAM = "warmloop:gateway:session-moves"
"""A Redis stream: a gateway replica announces each session new to it
(``Gateway._announce``); the others read it from where they left off, so an
announcement made while one of them was cut off from Redis still reaches it (pub/sub,
before 2026-12-07, dropped it: that hold then stood to its TTL)."""
SESSIONS_STREAM_MAXLEN = 10_000
"""Announcements the stream keeps (about: Redis trims whole nodes). A replica cut off for
longer than this many moves take reads the rest; the holds it misses end at their TTL."""
UNANNOUNCED_MAX = 10_000
"""Announcements a replica keeps to send again while Redis is away (the oldest go)."""
UNANNOUNCED_MAX_AGE_S = 600.0
"""An announcement not sent by then is dropped: the longest hold TTL (always-hold's)
has ended the other replica's hold by itself."""
STABLE_PREFIX_PROBES = ("a", "b")
MAX_STABLE_TRIED = 10_000


@dataclass
class Flight:
    """One call on its way through one engine."""

    call: Call
    session: Session | None
    generation: int
    engine: EngineHeartbeat
    decision: RouteDecision
    upstream: UpstreamResponse
    in_flight_key: str
    slot: BatchAdmission | None
    sent_at: float
    first_byte_at: float | None = None
    finished: bool = False


class Gateway:
    """Everything the gateway keeps, and the steps of a call (see the module doc)."""

    def __init__(self, settings: Settings, *, redis: aioredis.Redis | None = None,
                 http: httpx.AsyncClient | None = None, config: GatewayConfig | None = None,
                 instance: str | None = None) -> None:
        c = self.config = config or GatewayConfig()
        self.settings = settings
        self._owns = (redis is None, http is None)
        self.redis = redis if redis is not None else build_redis(settings)
        self.http = http if http is not None else httpx.AsyncClient(
            timeout=httpx.Timeout(c.read_timeout_s, connect=c.connect_timeout_s, write=30.0,
                                  pool=30.0),
            limits=httpx.Limits(max_connections=1024, max_keepalive_connections=256))
        # calls' engine requests: the lean client, unless given a client to use (tests)
        self.upstream: Upstream = HttpxUpstream(http) if http is not None else RawUpstream(
            self.http, connect_timeout_s=c.connect_timeout_s, read_timeout_s=c.read_timeout_s)
        self.outage = RedisOutage()
        self.registry = EngineRegistry(self.redis, ttl_s=settings.engine_ttl_s)
        self.directory = PrefixDirectory(self.redis)
        self.instance = instance or f"{socket.gethostname()}-{os.getpid()}"
        """This gateway among its replicas: its in-flight keys, hold tables and held
        tokens are its own in Redis."""
        self.fleet = FleetView(self.registry, self.redis, cooldown_s=c.failure_cooldown_s,
                               outage=self.outage, instance=self.instance)
        self.router = GatewayRouter(self.fleet, self.registry, self.directory,
                                    config=settings.routing, outage=self.outage,
                                    fresh_s=c.refresh_s,
                                    gateways_held_tokens=self._gateways_held_tokens)
        self.pauses = RecentPauseStats(self.redis, outage=self.outage)
        self.tenant_usage = TenantUsage(self.redis)
        """Tenants' tokens per hour: checked before a tenant key's call, added after."""
        self.holds = HoldPool(http=self.http, redis=self.redis, pauses=self.pauses,
                              config=settings.holding, directory=self.directory,
                              outage=self.outage, engine_info=self.fleet.engine,
                              ttl_cache=self._ttl_cache, others_held=self.fleet.others_held,
                              instance=self.instance)
        self.sessions = SessionTable(max_sessions=c.max_sessions, idle_s=c.session_idle_s)
        self.index = PromptIndex(max_entries=c.max_learned_prompts)
        self.metrics = Metrics()
        self._admissions: dict[str, BatchAdmission] = {}
        self._learning = asyncio.Semaphore(c.learn_concurrency)
        self._routing = 0
        """Calls between their arrival and their engine request now."""
        self._path_clear = asyncio.Event()
        self._path_clear.set()
        self._backlog = 0
        self._tasks: set[asyncio.Task[Any]] = set()
        self._stable_tried: set[str] = set()
        self._loop: asyncio.Task[None] | None = None
        self._listener: asyncio.Task[None] | None = None
        self._unannounced: dict[str, float] = {}
        """Sessions new to this replica whose announcement Redis did not take, and when
        their call came (``time.monotonic``): sent again at the next refresh."""

    # ---- lifetime ----------------------------------------------------------------------

    async def start(self) -> None:
        """Read the fleet once, then keep reading it (and ticking holds) in the
        background."""
        await self.refresh()
        # where the sessions stream ends now, read before start returns: an announcement
        # made after this gateway started is read, however late its reader first runs.
        # Not tried when the refresh just found Redis away (its reader reads it later)
        last = await self.outage.attempt("session stream", self._sessions_end, None,
                                         timeout_s=REDIS_TIMEOUT_S)
        self._loop = asyncio.ensure_future(self._refresh_loop())
        self._listener = asyncio.ensure_future(self._follow_sessions(last))

    async def stop(self) -> None:
        for task in (self._loop, self._listener):
            if task is not None:
                await stop_task(task)
        await self.idle()
        await asyncio.gather(*(a.shared.clear() for a in self._admissions.values()
                               if a.shared is not None))
        await self.holds.close()
        await self.fleet.gone()
        await self.upstream.aclose()
        if self._owns[1]:
            await self.http.aclose()
        if self._owns[0]:
            await self.redis.aclose()

    async def refresh(self) -> None:
        await self.fleet.refresh()
        await self.holds.sync(self.fleet.engines)
        await self.fleet.publish_held(self.holds.held())
        if self._unannounced:
            await self._announce_late()
        # at once: with Redis hung each renewal waits out its timeout
        await asyncio.gather(*(a.shared.renew_if_due() for a in list(self._admissions.values())
                               if a.shared is not None))

    async def idle(self) -> None:
        """Wait until the work left behind calls (learning, records) is done."""
        while self._tasks:
            await asyncio.gather(*list(self._tasks), return_exceptions=True)
        await self.fleet.publish_in_flight()

    async def _refresh_loop(self) -> None:
        while True:
            await asyncio.sleep(self.config.refresh_s)
            try:
                await self.refresh()
            except Exception:  # noqa: BLE001 - the last snapshot stands; try again
                log.exception("fleet_refresh_failed")

    # ---- a call ----------------------------------------------------------------------

    def open_session(self, call: Call) -> Session | None:
        """Step 1: the session's pause ends here (measured; its hold released). A
        session new to this gateway is announced to the other replicas
        (``SESSIONS_STREAM``): one that knew it ends its hold there."""
        if call.session is None:
            return None
        new = self.sessions.get(call.session) is None
        s = self.sessions.open(call.session, call.kind, call.lane)
        if new:
            at = time.monotonic()
            s.after_send.append(lambda: self._announce(s.key, at))
        self._pause_ended(s, later=s.after_send)
        s.ended_at = None
        self.holds.resume(s.key)
        s.active += 1
        s.generation += 1
        return s

    def _pause_ended(self, s: Session, at: float | None = None, *,
                     later: list[Callable[[], Coroutine[Any, Any, Any]]] | None = None
                     ) -> None:
        """The session's pause (since its last answer here) ends ``at`` (monotonic;
        None: now): measured into the pause statistics, if it was paused. ``later``:
        where to leave the record's write (``Session.after_send``); None: now."""
        if s.ended_at is not None and s.pause_kind is not None and s.active == 0:
            seconds = max(0.0, (time.monotonic() if at is None else at) - s.ended_at)
            profile, kind = kind_profile(s.kind).name, s.pause_kind
            self.metrics.inc("warmloop_gateway_pauses_total")
            if later is None:
                self._background(self.pauses.record(profile, kind, seconds))
            else:
                later.append(lambda: self.pauses.record(profile, kind, seconds))

    async def _announce(self, session: str, at: float) -> None:
        """Tell the other replicas that ``session``'s call of ``at`` came here; kept to
        send again (``_announce_late``) when Redis does not take it."""

        async def add() -> bool:
            await _add_move(self.redis, self.instance, session, 0)
            return True

        if not await self.outage.attempt("session announce", add, False,
                                         timeout_s=REDIS_TIMEOUT_S):
            self._unannounced.pop(session, None)
            self._unannounced[session] = at
            while len(self._unannounced) > UNANNOUNCED_MAX:
                del self._unannounced[next(iter(self._unannounced))]

    async def _announce_late(self) -> None:
        """Send the announcements Redis did not take, each with its age, so a replica
        that served the session after it was made here knows it for stale."""
        now = time.monotonic()
        for session in [k for k, at in self._unannounced.items()
                        if now - at > UNANNOUNCED_MAX_AGE_S]:  # too old to matter
            del self._unannounced[session]
        late = list(self._unannounced.items())
        if not late:
            return

        async def add() -> bool:
            async with self.redis.pipeline(transaction=False) as pipe:
                for session, at in late:
                    _add_move(pipe, self.instance, session, int((now - at) * 1000))
                await pipe.execute()
            return True

        if not await self.outage.attempt("session announce", add, False,
                                         timeout_s=REDIS_TIMEOUT_S):
            return
        for session, at in late:  # sent; a newer one of a session since stays
            if self._unannounced.get(session) == at:
                del self._unannounced[session]
        log.info("gateway_sessions_announced_late", sessions=len(late))

    async def _sessions_end(self) -> str:
        """The sessions stream's newest entry id ("0-0" when empty)."""
        newest = await self.redis.xrevrange(SESSIONS_STREAM, count=1)
        return redis_text(newest[0][0]) if newest else "0-0"

    async def _follow_sessions(self, last: str | None = None) -> None:
        """Read the sessions other replicas took (``_announce``): a session this gateway
        knows, idle here, moved (a proxy rebalanced, a replica came or went). Its pause
        ended when its call came there, its hold here has done its work and ends, and the
        session is forgotten, so that a later call back here is not measured as one long
        pause. The stream is read from where this replica left off: announcements made
        while it was cut off from Redis come when it is back, each placed in time by its
        age (the stream entry's, in Redis's clock, plus the time its maker held it).
        ``last``: the entry to read after (None: the stream's end when first read, as
        when Redis was away at the start)."""
        while True:
            try:
                if last is None:  # from the stream's end now: older moves are not ours
                    last = await self._sessions_end()
                got: Any = await self.redis.xread({SESSIONS_STREAM: last}, count=256,
                                                  block=1000)
                stop_if_cancelled()
                if not got:
                    continue
                entries = _stream_entries(got)
                received = time.monotonic()
                if all(self._own_entry(fields) for _, fields in entries):
                    # this replica's own announcements (one for each session new here,
                    # read back during its call): nothing to place in time
                    last = next((redis_text(i) for i, _ in reversed(entries) if i is not None),
                                last)
                    continue
                sec, usec = cast("tuple[int, int]", await self.redis.time())
                redis_ms = sec * 1000 + usec // 1000
                for entry_id, fields in entries:
                    if entry_id is None:
                        continue
                    last = redis_text(entry_id)
                    self._session_moved(fields, received, redis_ms, last)
            except REDIS_ERRORS as e:
                log.warning("session_stream_lost", error=str(e))
                await asyncio.sleep(1.0)

    def _own_entry(self, fields: Any) -> bool:
        try:
            return _field(fields, "gateway") == self.instance
        except (TypeError, KeyError, UnicodeDecodeError, AttributeError):
            return False  # garbage: _session_moved skips it

    def _session_moved(self, fields: Any, received: float, redis_ms: int,
                       entry_id: str) -> None:
        """One announcement read at ``received`` (monotonic), when Redis's clock said
        ``redis_ms``."""
        try:
            gateway = _field(fields, "gateway")
            key = _field(fields, "session")
            age_s = (redis_ms - int(entry_id.split("-")[0])
                     + int(_field(fields, "age_ms"))) / 1000
        except (TypeError, ValueError, KeyError, UnicodeDecodeError):
            return  # not ours to read (garbage on the stream)
        if gateway == self.instance:
            return
        s = self.sessions.get(key)
        if s is None or s.active:
            return  # unknown here, or a call of it still in flight here
        moved_at = received - max(0.0, age_s)
        if s.seen > moved_at:  # served here after it moved: the announcement is stale
            self.metrics.inc("warmloop_gateway_session_moves_stale_total")
            return
        self._pause_ended(s, moved_at)
        self.holds.resume(key)
        self.sessions.drop(key)
        self.metrics.inc("warmloop_gateway_sessions_moved_total")
        log.info("gateway_session_moved", session=key, to=gateway,
                 late_s=round(received - moved_at, 3))

    def close_unsent(self, session: Session | None) -> None:
        """The call ended before any engine took it (refused, no engine, cancelled)."""
        if session is not None:
            session.active = max(0, session.active - 1)

    async def send(self, call: Call, session: Session | None, arrived: float) -> Flight:
        """Steps 2 and 3: route and send, trying the next engine when one refuses.
        Raises ``BadCall`` (404: no engine serves the model), ``NoEngineError`` or
        ``QuotaRefused`` (a tenant key's tenant has spent its tokens this hour)."""
        self._routing += 1
        self._path_clear.clear()
        try:
            await self._check_quota(call)
            return await self._send(call, session, arrived)
        finally:
            self._routing -= 1
            if not self._routing:
                self._path_clear.set()
            # a call refused, or sent nowhere: its session came all the same
            self._after_send(session)

    async def _send(self, call: Call, session: Session | None, arrived: float) -> Flight:
        body = call.upstream_body()
        job_id = call.session or (call.prefix_keys[0] if call.prefix_keys else uuid.uuid4().hex)
        chain, last = await self._hint(call, session)
        on_last = self._unlearned_on_last(session, last)
        exclude: set[str] = set()
        failover = False
        if session is not None and session.avoid is not None:
            # its last call failed there: elsewhere if anywhere else (a failover even
            # when the fleet view has dropped that engine by now)
            avoid, session.avoid, last, failover = session.avoid, None, None, True
            if any(e.engine_id != avoid for e in self.router.servable(call.model, set())):
                exclude.add(avoid)
        while True:
            decision, engine = await self.router.route(
                job_id=job_id, chain=chain, model=call.model, last_engine=last,
                exclude=exclude, failover=failover, batch=call.lane == Lane.BATCH,
                on_last_engine=on_last)
            self.metrics.inc("warmloop_gateway_routed_total", engine=engine.engine_id,
                             reason=decision.reason)
            # scheduled now, they run at the call's next wait: an interactive call's is
            # for its answer, once the request is written; a batch call's may be for a
            # slot first (seconds: no announcement should wait that long)
            self._after_send(session)
            slot, waited = await self._admit(call, engine, job_id)
            key = self.fleet.started(engine.engine_id, f"gateway:{call.kind}")
            self.metrics.observe_added(time.perf_counter() - arrived - waited)
            try:
                upstream = await self._post(engine, call.path, body)
            except RETRY_ELSEWHERE as e:
                await self._undo(engine, key, slot, why=f"{type(e).__name__}: {e}")
            except BaseException:
                await self._undo(engine, key, slot, why=None)
                raise
            else:
                if upstream.status_code not in RETRY_STATUSES:
                    return Flight(call=call, session=session, engine=engine, decision=decision,
                                  generation=session.generation if session else 0,
                                  upstream=upstream, in_flight_key=key, slot=slot,
                                  sent_at=time.perf_counter())
                await upstream.aclose()
                await self._undo(engine, key, slot, why=f"answered {upstream.status_code}")
            exclude.add(engine.engine_id)
            failover, last, on_last = True, None, 0

    async def _check_quota(self, call: Call) -> None:
        """A tenant key's call waits for nothing: refused (``QuotaRefused``) once its
        tenant has spent this hour's tokens. Redis away: let through (as the workers'
        router does), the outage logged once."""
        quota = self.settings.tenants.get(call.tenant) if call.tenant else None
        if call.tenant is None or quota is None or quota.tokens_per_hour is None:
            return
        now = time.time()
        used = await self.outage.attempt("tenant usage",
                                         lambda: self.tenant_usage.used(call.tenant or "", now),
                                         None, timeout_s=1.0)
        if used is not None and (refused := over_tokens(call.tenant, quota, used, now)):
            raise QuotaRefused(*refused)

    async def _count_tenant_tokens(self, tenant: str, tokens: int) -> None:
        await self.outage.attempt("tenant usage",
                                  lambda: self.tenant_usage.add(tenant, tokens), None,
                                  timeout_s=1.0)

    def _unlearned_on_last(self, session: Session | None, last: str | None) -> int:
        """Tokens the session's last engine holds of this call's prompt at least, when
        its last call's chain is not learned yet (a quick next call supersedes the
        learning): that call's prompt, computed there moments ago. Without this floor
        the call would go by load alone, and one request of heartbeat lag on the last
        engine (the session's own call, just ended) sends it to a cold engine."""
        if session is None or last is None or session.engine != last:
            return 0
        if session.chain_generation >= session.generation - 1:
            return 0  # learned: the prefix directory says what is there
        bs = self._block_size()
        return session.served_tokens // bs * bs

    async def finish(self, flight: Flight, *, ok: bool, outcome: Outcome | None,
                     died: BaseException | None = None) -> None:
        """Step 4's end (once per flight): the engine's slot and connection let go,
        the session's state after the call, step 5 started. ``ok``: the engine's whole
        answer reached the client; ``died``: the engine failed after it began."""
        if flight.finished:
            return
        flight.finished = True
        with contextlib.suppress(Exception):
            await flight.upstream.aclose()
        engine = flight.engine.engine_id
        self.fleet.ended(engine, flight.in_flight_key)
        if flight.slot is not None:
            await flight.slot.release()
        if died is not None:
            status = 502
        elif ok or not flight.call.stream:
            status = flight.upstream.status_code
        else:
            status = 499  # the client left mid-stream
        self.metrics.inc("warmloop_gateway_requests_total", endpoint=flight.call.endpoint,
                         status=str(status))
        if (flight.call.tenant is not None and outcome is not None
                and outcome.prompt_tokens is not None):
            # onto the tenant's hour: what the answer reports (a stream's usage event,
            # asked for by the gateway when the client did not: Call.hidden_usage)
            self._background(self._count_tenant_tokens(
                flight.call.tenant, outcome.prompt_tokens + (outcome.completion_tokens or 0)))
        if outcome is not None and outcome.prompt_tokens is not None:
            self.metrics.inc("warmloop_gateway_prompt_tokens_total", outcome.prompt_tokens,
                             engine=engine)
            self.metrics.inc("warmloop_gateway_cached_tokens_total",
                             outcome.cached_tokens or 0, engine=engine)
        if died is not None:
            self.fleet.failed(engine)
            self.metrics.inc("warmloop_gateway_stream_errors_total", engine=engine)
            log.warning("engine_died_mid_call", engine=engine, error=str(died) or repr(died))
        await self._observe_ttft(flight)
        if ok and outcome is not None:
            self._observe_prefill(flight, outcome)
        self._after_call(flight, ok=ok, outcome=outcome, died=died)

    # ---- steps 2 and 3 -----------------------------------------------------------------

    async def _hint(self, call: Call, session: Session | None) -> tuple[Chain | None, str | None]:
        """What the router weighs the call's prompt by, and the session's last engine."""
        last = session.engine if session is not None else None
        ids = call.prompt_ids()
        if ids is not None:
            bs = self._block_size()
            return Chain.of(block_hashes(ids[:MAX_WALK_BLOCKS * bs], bs, salt=call.salt or ""),
                            bs), last
        # This prompt's own longest learned prefix first: a session's calls need not
        # share one prompt (several agents of one workflow, a handoff).
        chain = self.index.longest(call.prefix_keys)
        if chain is None and session is not None:
            chain = session.chain
            if chain is None and session.generation == 1:
                chain, last = await self._known_elsewhere(session)
        return chain, last

    async def _known_elsewhere(self, session: Session) -> tuple[Chain | None, str | None]:
        """A session new to this process (a restart, another replica): its chain and
        engine as the prefix directory recorded them."""
        known = await self.outage.attempt(
            "prefix directory", lambda: self.directory.job_chain(job_key(session.key)), None,
            timeout_s=REDIS_TIMEOUT_S)
        if known is None:
            return None, None
        hashes, engine = known
        hb = self.fleet.engine(engine)
        if hb is None:
            return None, None
        session.engine = engine
        return Chain.of(hashes, hb.block_size), engine

    def _block_size(self) -> int:
        live = self.fleet.live()
        return live[0].block_size if live else 16

    async def _admit(self, call: Call, engine: EngineHeartbeat, job_id: str
                     ) -> tuple[BatchAdmission | None, float]:
        """A batch-lane call waits for one of the engine's batch slots (as batch steps
        do); returns the slot to release and the seconds waited."""
        if call.lane != Lane.BATCH:
            return None, 0.0
        admission = self._admission(engine.engine_id)
        started = time.perf_counter()
        await admission.acquire(job_id)
        return admission, time.perf_counter() - started

    def _admission(self, engine_id: str) -> BatchAdmission:
        a = self._admissions.get(engine_id)
        if a is None:
            # K is the engine's: its inference worker and the other replicas share it
            shared = SharedBatchSlots.for_engine(self.redis, engine_id, self.settings.admission,
                                                 holder=self.instance)
            a = self._admissions[engine_id] = BatchAdmission(
                self.settings.admission, kv_pool=lambda: self.fleet.engine(engine_id),
                shared=shared,
                # one K for every sharer: the worker's, which sees the engine's steps
                ceiling=None if shared is None
                else (lambda: _batch_limit(self.fleet.engine(engine_id))))
        return a

    async def _post(self, engine: EngineHeartbeat, path: str, body: bytes
                    ) -> UpstreamResponse:
        return await self.upstream.post(engine.url.rstrip("/") + path, body)

    async def _undo(self, engine: EngineHeartbeat, key: str, slot: BatchAdmission | None, *,
                    why: str | None) -> None:
        """The engine did not take the call: its slot and in-flight mark go; with
        ``why``, it refused and is set aside."""
        self.fleet.ended(engine.engine_id, key)
        if slot is not None:
            await slot.release()
        if why is not None:
            self.fleet.failed(engine.engine_id)
            self.metrics.inc("warmloop_gateway_failovers_total", engine=engine.engine_id)
            log.warning("engine_refused_call", engine=engine.engine_id, why=why)

    async def _observe_ttft(self, flight: Flight) -> None:
        """An interactive stream's time to first bytes, for the engine's batch admission
        (which cuts its batch slots when interactive TTFT is over target)."""
        if flight.call.lane != Lane.INTERACTIVE or flight.first_byte_at is None:
            return
        admission = self._admissions.get(flight.engine.engine_id)
        if admission is not None:
            await admission.observe_interactive((flight.first_byte_at - flight.sent_at) * 1000)

    def _observe_prefill(self, flight: Flight, outcome: Outcome) -> None:
        """A stream's uncached prompt tokens and time to first bytes, to the engine's hold
        manager: its holds price re-prefill at the rate the engine shows now, as the
        inference workers' do (``HoldManager.observe_step``). Whole answers say nothing
        of prefill alone (their first bytes come after the last token)."""
        if not flight.call.stream or flight.first_byte_at is None \
                or outcome.prompt_tokens is None:
            return
        manager = self.holds.manager(flight.engine.engine_id)
        if manager is not None:
            manager.observe_step(
                uncached_tokens=outcome.prompt_tokens - (outcome.cached_tokens or 0),
                ttft_s=flight.first_byte_at - flight.sent_at)

    # ---- step 4's end: the session --------------------------------------------------------

    def _after_call(self, flight: Flight, *, ok: bool, outcome: Outcome | None,
                    died: BaseException | None) -> None:
        s, call = flight.session, flight.call
        if s is not None:
            s.active = max(0, s.active - 1)
            if died is not None:
                s.avoid, s.engine = flight.engine.engine_id, None
                return
            s.engine = flight.engine.engine_id
            if ok and outcome is not None and outcome.prompt_tokens is not None:
                s.served_tokens = outcome.prompt_tokens
            if call.final:
                self.sessions.drop(s.key)
                self._background(self.holds.end(s.key))
            elif ok and s.active == 0:
                s.ended_at = time.monotonic()
                s.pause_kind = pause_kind_of(outcome.tool_names if outcome else [])
        if ok:
            self._learn_later(flight)

    def _learn_later(self, flight: Flight) -> None:
        if self._backlog >= self.config.max_learn_backlog:
            self.metrics.inc("warmloop_gateway_learn_skipped_total")
            return
        self._backlog += 1
        self._background(self._learn(flight))

    # ---- step 5 --------------------------------------------------------------------------

    async def _learn(self, flight: Flight) -> None:
        """The prompt's chain (tokenized on the engine that served it), into the index,
        the session and the prefix directory; then the session's hold decision."""
        call, engine = flight.call, flight.engine
        try:
            if self.config.learn_delay_s:
                await asyncio.sleep(self.config.learn_delay_s)
            if self._superseded(flight):
                return
            async with self._learning:
                await self._path_clear.wait()
                ids = call.prompt_ids() or await self._tokenize(engine, call.tokenize_payload())
        except (httpx.HTTPError, TimeoutError, ValueError, KeyError, TypeError) as e:
            self.metrics.inc("warmloop_gateway_learn_skipped_total")
            log.info("prompt_not_learned", engine=engine.engine_id, error=repr(e))
            return
        finally:
            self._backlog -= 1
        await self._path_clear.wait()
        chain = prompt_chain(ids, engine.block_size, tail_tokens=self.config.tail_tokens,
                             salt=call.salt)
        learned = Chain.of(chain.hashes[:chain.reusable_blocks], chain.block_size)
        self._remember(call, learned)
        s = flight.session
        if s is not None and flight.generation >= s.chain_generation:
            s.chain, s.chain_generation = learned, flight.generation
        await self._path_clear.wait()
        await self._hold(flight, ids, chain)
        await self._path_clear.wait()
        await self._record(engine, s, chain)
        await self._learn_stable_prefix(engine, call)

    @staticmethod
    def _superseded(flight: Flight) -> bool:
        """The session's next call came: it will learn a prompt that extends this one."""
        s = flight.session
        return s is not None and s.generation != flight.generation

    async def _tokenize(self, engine: EngineHeartbeat, payload: dict[str, Any] | None
                        ) -> list[int]:
        if payload is None:
            raise ValueError("nothing to tokenize")
        async with asyncio.timeout(10.0):
            r = await self.upstream.post(engine.url.rstrip("/") + "/tokenize",
                                         json.dumps(payload).encode())
            try:
                content = await r.aread()
            finally:
                await r.aclose()
        if r.status_code != 200:
            raise ValueError(f"/tokenize answered {r.status_code}: {content[:200]!r}")
        return [int(t) for t in json.loads(content)["tokens"]]

    def _remember(self, call: Call, learned: Chain) -> None:
        """The chain under the call's whole-prompt key; for a text prompt, its share
        before the last whole chunk under that chunk's key too (an estimate, one block
        short)."""
        keys = call.prefix_keys
        if not keys:
            return
        self.index.put(keys[-1], learned)
        text = call.body.get("prompt")
        text = text[0] if isinstance(text, list) and text else text
        if call.endpoint == "completions" and isinstance(text, str):
            whole = len(text) // TEXT_CHUNK_CHARS
            if whole and len(text) % TEXT_CHUNK_CHARS:
                share = whole * TEXT_CHUNK_CHARS / len(text)
                self.index.put(keys[whole - 1], learned.first(int(learned.blocks * share) - 1))

    async def _hold(self, flight: Flight, ids: list[int], chain: PromptChain) -> None:
        """Hold the session's prefix on its engine, or not: ``HoldManager.after_step``,
        as the inference worker decides after a step that pauses its job."""
        s, call = flight.session, flight.call
        if s is None or call.final or s.pause_kind is None or s.active \
                or s.generation != flight.generation:
            return
        manager = self.holds.manager(flight.engine.engine_id)
        if manager is None:
            return
        reusable, bs = chain.reusable_blocks, chain.block_size
        try:
            choice = await manager.after_step(
                job_id=s.key, profile=kind_profile(s.kind), kind=s.pause_kind,
                prefix_tokens=ids[:reusable * bs + 1] if reusable else [],
                policy=self.config.hold_policy, interactive=s.lane == Lane.INTERACTIVE,
                body=call.body if call.endpoint == "chat" else None,
                block_hashes=chain.hashes[:reusable], block_size=bs, salt=call.salt)
        except HOLD_ERRORS as e:
            log.warning("hold_failed", session=s.key, error=str(e))
            return
        if choice is not None:
            self.metrics.inc("warmloop_gateway_hold_decisions_total", action=choice.action.value)
        if s.generation != flight.generation:
            manager.resume(s.key)  # its next call came while this was decided

    async def _record(self, engine: EngineHeartbeat, session: Session | None,
                      chain: PromptChain) -> None:
        """The served prompt into the prefix directory, as the inference worker records
        a step's (the engine's set of blocks; the session's chain for a restart). A
        session's same prompt on the same engine again is not recorded again where the
        engine publishes KV events (they, not recency, keep its blocks there)."""
        recorded = (engine.engine_id, "".join(chain.hashes[:chain.reusable_blocks]))
        if engine.precise and session is not None and session.recorded == recorded:
            return  # the same prompt again: the engine's KV events keep its blocks
        capacity = (engine.kv_capacity_tokens // chain.block_size
                    if not engine.precise and engine.kv_capacity_tokens else None)
        job = job_key(session.key) if session is not None else "gw:anon"
        done = await self.outage.attempt(
            "prefix directory",
            lambda: self._record_served(engine.engine_id, job, chain, capacity), False,
            timeout_s=REDIS_TIMEOUT_S)
        if done and session is not None:
            session.recorded = recorded

    async def _record_served(self, engine_id: str, job: str, chain: PromptChain,
                             capacity: int | None) -> bool:
        await self.directory.record_served(engine_id, job, chain, capacity_blocks=capacity)
        self.router.forget_recent()
        return True

    async def _learn_stable_prefix(self, engine: EngineHeartbeat, call: Call) -> None:
        """Once per system prompt (and tools): how much of a chat prompt every session
        starting with it shares, found as the workers find a profile's (the common
        start of two renderings that differ only after it), under the key of its first
        message. A new session's first call is routed where that is warm."""
        messages = call.body.get("messages") if call.endpoint == "chat" else None
        if not isinstance(messages, list) or len(messages) < 2 or not call.prefix_keys \
                or messages[0].get("role") not in ("system", "developer"):
            return
        key = call.prefix_keys[0]
        if key in self._stable_tried:
            return
        if len(self._stable_tried) >= MAX_STABLE_TRIED:
            self._stable_tried.clear()
        self._stable_tried.add(key)
        base = call.tokenize_payload() or {}
        try:
            a, b = [await self._tokenize(engine, {
                **base, "add_generation_prompt": False,
                "messages": [messages[0], {"role": "user", "content": u}]})
                for u in STABLE_PREFIX_PROBES]
        except (httpx.HTTPError, TimeoutError, ValueError, KeyError, TypeError):
            return
        n = next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                 min(len(a), len(b)))
        self.index.put(key, Chain.of(block_hashes(a[:n], engine.block_size,
                                                  salt=call.salt or ""), engine.block_size))

    # ---- helpers ---------------------------------------------------------------------

    def _after_send(self, session: Session | None) -> None:
        """Start the work the session's call left for after its request
        (``Session.after_send``)."""
        if session is None or not session.after_send:
            return
        work, session.after_send = session.after_send, []
        for w in work:
            self._background(w())

    def _background(self, work: Coroutine[Any, Any, Any]) -> None:
        task = asyncio.ensure_future(self._quietly(work))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    @staticmethod
    async def _quietly(work: Awaitable[Any]) -> None:
        try:
            await work
        except Exception:  # noqa: BLE001 - after-call work is advice; the call is served
            log.exception("gateway_background_failed")

    def _gateways_held_tokens(self, engine_id: str) -> int:
        """Tokens the gateways' holds keep on an engine, this one's as they are now and
        the others' as last read (the router's KV usage; no heartbeat counts them)."""
        m = self.holds.manager(engine_id)
        return (m.own_held_tokens if m is not None else 0) + self.fleet.others_held(engine_id)

    def _ttl_cache(self, engine_id: str) -> TtlCacheEndpoint | None:
        """A ttl_cache engine's keep-alive economics, as its inference worker has them
        (None for a vLLM engine, or one not in these settings)."""
        try:
            engine = self.settings.engine(engine_id)
        except ValueError:
            return None
        if engine.kind == "vllm":
            return None
        from warmloop.workers.inference_worker import _ttl_cache

        return _ttl_cache(engine)

    # ---- what the other endpoints show ---------------------------------------------------

    def models(self) -> dict[str, Any]:
        """The union of the live engines' models, as OpenAI lists models."""
        served: dict[str, list[str]] = {}
        for e in self.fleet.live():
            served.setdefault(e.model, []).append(e.engine_id)
        return {"object": "list", "data": [
            {"id": m, "object": "model", "created": 0, "owned_by": "warmloop",
             "engines": ids} for m, ids in sorted(served.items())]}

    def health(self) -> dict[str, Any]:
        return {"status": "ok" if self.fleet.engines else "no_engines",
                "engines": sorted(self.fleet.engines), "redis": "away" if self.outage.away
                else "ok", "sessions": len(self.sessions)}

    def metrics_text(self) -> str:
        gauges: list[tuple[str, dict[str, str], float]] = [
            ("warmloop_gateway_sessions", {}, len(self.sessions)),
            ("warmloop_gateway_live_engines", {}, len(self.fleet.engines))]
        for engine_id, m in sorted(self.holds.managers.items()):
            gauges.append(("warmloop_gateway_holds", {"engine": engine_id}, len(m.holds)))
            gauges.append(("warmloop_gateway_held_tokens", {"engine": engine_id},
                           m.own_held_tokens))
        for engine_id, n in sorted(self.fleet.local.items()):
            gauges.append(("warmloop_gateway_in_flight", {"engine": engine_id}, n))
        for engine_id, a in sorted(self._admissions.items()):
            gauges.append(("warmloop_gateway_batch_active", {"engine": engine_id}, a.active))
            gauges.append(("warmloop_gateway_batch_waiting", {"engine": engine_id},
                           a.waiting + a.fleet_waiting))
        return self.metrics.render(gauges)


class QuotaRefused(Exception):
    """A tenant key's tenant has spent its tokens this hour (429, ``Retry-After``)."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def _batch_limit(hb: EngineHeartbeat | None) -> int | None:
    """The engine's K as its inference worker publishes it (None: no worker admits)."""
    return None if hb is None else hb.batch_limit


def job_key(session: str) -> str:
    """The session's job id in the prefix directory (its chain, for a restart)."""
    return f"gw:{session}"


def _add_move(client: Any, gateway: str, session: str, age_ms: int) -> Any:
    """XADD one announcement on ``client`` (a client, or a pipeline that buffers it):
    who took the session, and how long ago (ms) its call came beyond the entry's own
    time (0 when sent at once)."""
    return client.xadd(SESSIONS_STREAM, {"gateway": gateway, "session": session,
                                         "age_ms": age_ms},
                       maxlen=SESSIONS_STREAM_MAXLEN, approximate=True)


def _stream_entries(got: Any) -> list[Any]:
    """The (id, fields) entries of the one stream an XREAD asked for, in whichever shape
    redis-py parsed the answer: ``[[name, entries]]`` (RESP2), ``{name: [entries]}``
    (RESP3), ``{name: entries}`` (its unified form)."""
    if isinstance(got, dict):
        value: Any = next(iter(got.values()), [])
        if value and isinstance(value[0], list):
            return list(value[0])
        return list(value)
    return list(got[0][1]) if got else []


def _field(fields: Any, name: str) -> str:
    """A stream entry's field, from a client that decodes answers or one that does not."""
    value = fields.get(name.encode(), fields.get(name))
    if value is None:
        raise KeyError(name)
    return redis_text(value)
