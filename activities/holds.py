"""Holding, engine-side: keep a paused job's prefix warm while it pays.

The inference worker decides after each step whose tool call will pause the job (a
tool, or a human approval): it asks the cost model (``warmloop.workflows.holding.decide_hold``)
with the pause statistics of that tool or approval kind and the engine's pressure.
A hold is kept by 1-token touch requests on the prefix's token ids, often enough that
the blocks never reach the end of vLLM's LRU (the interval follows the engine's churn),
until the job resumes, its job ends (it asks Temporal, ``JobsOver``), the hold's TTL
passes, or the cap on held tokens needs room.

A hold never changes correctness: a job whose hold is lost just re-prefills.

A touch must not become a re-prefill: where the engine publishes KV events (precise
mode), the touch first asks the prefix directory which of the held blocks are still
cached. Blocks lost off the end shrink the hold to what survived; a hold whose first
block is gone is dropped. So a touch computes one token, never a lost tail (the job's
next step recomputes that only if it needs it).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Protocol

import httpx
import redis.asyncio as aioredis
import structlog
from temporalio.client import Client
from temporalio.service import RPCError

from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.pauses import PauseStats, approval_kind, tool_kind
from warmloop.activities.registry import (
    REDIS_ERRORS,
    EngineHeartbeat,
    RedisOutage,
    stop_if_cancelled,
)
from warmloop.workflows.holding import (
    ChurnMeter,
    EvictionRegret,
    HoldAction,
    HoldChoice,
    HoldConfig,
    HoldCosts,
    HoldPolicy,
    ObservedPrefill,
    PauseDistribution,
    TtlCacheCosts,
    TtlCacheEndpoint,
    cap_turnover_s,
    decide_hold,
    displaced_on_curve,
    hold_lasts_the_wait,
    keepalive_schedule,
    touch_interval_s,
)
from warmloop.workflows.profiles import Profile
from warmloop.workflows.profiles.base import ToolCallError

log = structlog.get_logger(__name__)

HOLDS_KEY = "warmloop:holds:{}"
"""Hash per engine: job id -> the hold (JSON)."""
HOLD_STATS = "warmloop:holds:stats:{}"
"""Hash per engine: holds, touches, touch tokens, releases by cause (``released_on_resume``,
``_on_ttl``, ``_for_room``, ``_lost``, ``_moved``, ``_job_over``), holds cut short for
room (``trimmed_for_room``), blocks computed again after eviction
(``regretted_blocks``)."""
MAX_LOADED_SLOWDOWN = 4.0
"""The most the engine's own steps may raise re-prefill's price over its calibration: a
slope read over a few steps with a queue in their TTFTs can claim anything (the CPU
benches' engines: up to ~3x slower beside the stack than alone)."""
REDIS_TIMEOUT_S = 1.0
"""Longest a tick waits on Redis for its bookkeeping: the touches are what keep holds
warm, and Redis only records them."""


@dataclass
class Hold:
    job_id: str
    kind: str
    tokens: list[int]
    until: float
    next_touch: float
    created: float
    touches: int = 0
    body: dict[str, Any] | None = None
    """ttl_cache engines: the chat request a keep-alive ping resends (a managed API takes
    messages, not token ids)."""
    pings: list[float] | None = None
    """ttl_cache engines: when to ping (just before each expiry)."""
    hashes: list[str] | None = None
    """The held blocks' chain in the prefix directory (checked before each touch)."""
    block_size: int = 16
    salt: str | None = None
    """The ``cache_salt`` of the job's tenant: a touch without it would keep another
    chain warm (the unsalted one) and let the job's own blocks go."""
    touched_at: float | None = None
    """When last touched (None: not yet; the step that made it used the blocks at
    ``created``)."""
    step: int | None = None
    """The step after which the job paused (a later or equal step recorded on another
    engine means the job went on there: the hold is dropped, ``_drop_moved``)."""
    asked_at: float | None = None
    """When it last asked whether its job still runs (None: not yet; ``_drop_over``)."""

    def record(self) -> str:
        return json.dumps({"kind": self.kind, "tokens": len(self.tokens),
                           "until": round(self.until, 1), "touches": self.touches})


def pause_kind(profile: Profile, tool: str, arguments: str) -> str | None:
    """What the job will wait on after this call: ``tool:<name>`` or
    ``approval:<kind>``; None when the call ends the job or is invalid (the repair
    step follows at once)."""
    try:
        spec, args = profile.validate_call(tool, arguments)
    except ToolCallError:
        return None
    if spec.finishes_job:
        return None
    rule = profile.approval_for(spec.name, args)
    return approval_kind(rule.kind) if rule is not None else tool_kind(spec.name)


def without_touches(running: int, waiting: int, touches: int) -> tuple[int, int]:
    """An engine's running and waiting requests less ``touches`` of its holder's own in
    flight (``HoldManager.touching``), running ones first: a touch computes a token or
    two, so one still waiting is next to run."""
    mine = min(touches, running)
    return running - mine, max(0, waiting - (touches - mine))


class JobsOver(Protocol):
    """Which of these jobs have ended: a hold's job that ended after its pausing step (a
    budget, a cancel, a rejected or expired approval, a terminated workflow) sends no
    next step to resume it."""

    async def __call__(self, job_ids: list[str]) -> set[str]: ...


class WorkflowsOver:
    """``JobsOver`` from Temporal: a job is its workflow (the workflow id is the job id),
    over once its latest run is no longer running (continue-as-new's next run is).
    Strongly consistent (a describe per job, not the visibility store, which lags). A job
    Temporal cannot describe in ``timeout_s`` (an error, an id it does not know) counts as
    running: an ended hold only costs room until its TTL, a dropped one a re-prefill.

    At most ``max_concurrent`` describes are in flight at once: a worker with hundreds of
    holds asks in waves rather than in one burst on the frontend (the question runs
    beside the hold ticks, so a longer answer delays no touch). With Temporal away a
    question takes about ``ceil(jobs / max_concurrent) * timeout_s`` and finds no job
    over; the next is asked only when it has ended."""

    def __init__(self, client: Client, *, timeout_s: float = 2.0,
                 max_concurrent: int = 8) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be at least 1, got {max_concurrent}")
        self._client = client
        self._timeout_s = timeout_s
        self._slots = asyncio.Semaphore(max_concurrent)

    async def __call__(self, job_ids: list[str]) -> set[str]:
        async def over(job_id: str) -> bool:
            async with self._slots:
                return await self._over(job_id)

        answers = await asyncio.gather(*(over(j) for j in job_ids))
        return {j for j, done in zip(job_ids, answers, strict=True) if done}

    async def _over(self, job_id: str) -> bool:
        try:
            # the SDK retries an unavailable server for ~10 s: the bound is ours
            d = await asyncio.wait_for(
                self._client.get_workflow_handle(job_id).describe(
                    rpc_timeout=timedelta(seconds=self._timeout_s)),
                self._timeout_s)
        except (TimeoutError, RPCError):
            return False
        return d.status is not None and d.status.name != "RUNNING"


class HoldManager:
    def __init__(self, *, engine_id: str, base_url: str, model: str, http: httpx.AsyncClient,
                 redis: aioredis.Redis, pauses: PauseStats,
                 engine_info: Callable[[], EngineHeartbeat | None],
                 config: HoldConfig | None = None,
                 ttl_cache: TtlCacheEndpoint | None = None,
                 directory: PrefixDirectory | None = None,
                 clock: Callable[[], float] = time.time,
                 outage: RedisOutage | None = None,
                 regret: EvictionRegret | None = None,
                 jobs_over: JobsOver | None = None
                 ) -> None:
        """``regret``: the engine's evictions as its KV events show them (precise mode);
        the rent of a hold is then the recomputes its room would cause, measured.
        ``jobs_over``: asked every ``config.job_check_s`` which held jobs have ended
        (``WorkflowsOver``); None: a hold whose job ended stands to its TTL."""
        self._engine = engine_id
        self._jobs_over = jobs_over
        self._asking: asyncio.Task[None] | None = None
        """The question to ``jobs_over`` in flight (at most one; ticks never wait on it)."""
        self.regret = regret
        self._regretted = 0
        """``regret.regretted`` as last counted in the hold statistics."""
        self._outage = outage or RedisOutage()
        self._uncounted: Counter[str] = Counter()
        """Statistics not yet written (Redis was away): they go with the next count."""
        self._directory = directory
        self._ttl_cache = ttl_cache
        self._url = base_url.rstrip("/") + "/v1/completions"
        self._chat_url = base_url.rstrip("/") + "/v1/chat/completions"
        self._model = model
        self._http = http
        self._redis = redis
        self._pauses = pauses
        self._info = engine_info
        self.config = config or HoldConfig()
        self._clock = clock
        self.holds: dict[str, Hold] = {}
        self.churn = ChurnMeter()
        """Tokens the engine computes a second (``observe_engine``): the touch interval."""
        self.prefill = ObservedPrefill()
        """Re-prefill's price as the engine's own steps show it (``observe_step``)."""
        self._resumed = 0
        """Holds ended by their job's next step since the last tick (counted there)."""
        self._room_release: tuple[float, float] = (-float("inf"), 0.0)
        """When the last hold was let go for room, and its age then (the cap's turnover:
        ``lasts_the_wait``)."""
        self.touching = 0
        """Touches in flight now. vLLM counts each as a running request, but a touch is
        this holder's upkeep (one token), not load: the worker's heartbeat leaves them
        out of the engine's count (``without_touches``). Counted as load they pushed the
        held job's own next step, and any job whose prefix the engine holds, elsewhere
        whenever a heartbeat caught one."""
        self.held_more = asyncio.Event()
        """Set when a hold is made: the worker's heartbeat then publishes ``held_tokens``
        at once, not up to a beat later. The router counts held tokens as taken KV
        (``workflows.routing.kv_taken``); a job that starts in that beat would otherwise
        see an engine that just began holding a family's prefix as empty, and may bring
        a second family beside it (the cap cannot keep both)."""

    @property
    def held_tokens(self) -> int:
        """Tokens of KV the holds keep, each block once: what the cap
        (``HoldConfig.max_held_fraction``) bounds.

        Holds of one profile share its system prompt and tools (most of a prompt): summed
        per hold, 30 % of an 8,192-token pool took one job's 2,000-token prompt and left
        the next hold to evict it, though the second kept only its ~600 tokens of its own.
        Blocks are told apart by their hashes in the prefix directory's chain (a hold
        without them counts whole)."""
        blocks: dict[str, int] = {}  # hash -> its block's tokens
        tokens = 0
        for h in self.holds.values():
            if h.hashes:
                blocks.update(dict.fromkeys(h.hashes, h.block_size))
                # the token past the last full block (not cached: the touch computes it)
                tokens += max(0, len(h.tokens) - len(h.hashes) * h.block_size)
            else:
                tokens += len(h.tokens)
        return tokens + sum(blocks.values())

    # ---- decisions ----------------------------------------------------------------------

    def costs(self, prefix_tokens: int, *, interactive: bool
              ) -> HoldCosts | TtlCacheCosts | None:
        c = self.config
        latency = (c.interactive_latency_usd_per_s if interactive
                   else c.batch_latency_usd_per_s)
        if self._ttl_cache is not None:
            t = self._ttl_cache
            return TtlCacheCosts(
                prefix_tokens=prefix_tokens, cache_ttl_s=t.cache_ttl_s, margin_s=t.margin_s,
                input_usd_per_token=t.input_usd_per_mtok / 1e6,
                cached_input_usd_per_token=t.cached_input_usd_per_mtok / 1e6,
                output_usd_per_token=t.output_usd_per_mtok / 1e6,
                prefill_s_per_token=1.0 / c.prefill_tokens_per_s, latency_usd_per_s=latency)
        info = self._info()
        if info is None or not info.kv_capacity_tokens:
            return None
        c = self.config
        # The engine's calibration, where it has one: re-prefill at its measured rate for
        # this prompt's length, the GPU at its price. The config's flat rate otherwise.
        # Slower where the engine's own steps show it slower now (measured alone, it
        # prices re-prefill cheap under load).
        cal = info.calibration
        rate = (1.0 / c.prefill_tokens_per_s if cal is None
                else cal.prefill_s_per_token(max(1, prefix_tokens)))
        observed = self.prefill.s_per_token()
        if observed is not None:  # at least alone's, at most what a noisy slope may claim
            rate = min(max(rate, observed), MAX_LOADED_SLOWDOWN * rate)
        return HoldCosts(
            displaced_tokens_per_s=self._displaced(prefix_tokens, info),
            displaced_latency_usd_per_s=c.interactive_latency_usd_per_s,
            prefix_tokens=prefix_tokens, kv_capacity_tokens=info.kv_capacity_tokens,
            kv_usage=min(0.999, max(info.kv_usage, self.held_tokens / info.kv_capacity_tokens)),
            prefill_s_per_token=rate,
            gpu_usd_per_s=c.gpu_usd_per_hour / 3600 if cal is None else cal.gpu_usd_per_s,
            latency_usd_per_s=(c.interactive_latency_usd_per_s if interactive
                               else c.batch_latency_usd_per_s),
        )

    def _displaced(self, prefix_tokens: int, info: EngineHeartbeat) -> float | None:
        """What room is worth on the engine now, where its evictions are followed: the
        recomputes a pool smaller by this prefix would add. A holder that does not follow
        the events (the gateway) reads the worker's measure from the heartbeat. None (the
        rent follows the contention model): ``rent="model"``, or no measure yet."""
        if self.config.rent != "measured":
            return None
        if self.regret is not None:
            return self.regret.displaced_tokens_per_s(prefix_tokens, self._clock())
        if info.room_regret is not None:
            return displaced_on_curve(info.room_regret, prefix_tokens)
        return None

    async def after_step(self, *, job_id: str, profile: Profile, kind: str | None,
                         prefix_tokens: list[int], policy: HoldPolicy,
                         interactive: bool, body: dict[str, Any] | None = None,
                         block_hashes: list[str] | None = None, block_size: int = 16,
                         salt: str | None = None, step: int | None = None
                         ) -> HoldChoice | None:
        """The step's call pauses the job on ``kind``: hold its prefix or let it go.
        ``salt``: the step's ``cache_salt`` (its tenant's), which every touch carries.
        ``step``: the step's number (a hold learns from the prefix directory that its
        job moved on to another engine by it)."""
        if kind is None or not prefix_tokens or policy == "never":
            return None
        decided = await self._decide(profile=profile, kind=kind,
                                     prefix_tokens=len(prefix_tokens), policy=policy,
                                     interactive=interactive)
        if decided is None:
            return None
        choice, costs = decided
        if choice.action == HoldAction.HOLD:
            now = self._clock()
            # The step just used these blocks: they are the most recently used now, so
            # the first touch is due one churn interval from now, not at once.
            hold = Hold(job_id=job_id, kind=kind, tokens=list(prefix_tokens),
                        until=now + self._hold_for_s(choice, policy),
                        next_touch=now + self.touch_interval_s(),
                        created=now, hashes=list(block_hashes) if block_hashes else None,
                        block_size=block_size, salt=salt, step=step)
            if self._ttl_cache is not None:
                # the step itself just refreshed the TTL: ping only before each expiry
                hold.body = body
                hold.pings = [now + t for t in keepalive_schedule(
                    cache_ttl_s=self._ttl_cache.cache_ttl_s, hold_for_s=hold.until - now,
                    margin_s=self._ttl_cache.margin_s)]
                hold.next_touch = hold.pings[0] if hold.pings else hold.until
            self.holds[job_id] = hold
            await self._count(holds=1)
            await self._make_room()
            self.held_more.set()  # after the room it made: what is held now
            await self._publish()
        log.info("hold_decision", job_id=job_id, kind=kind, action=choice.action.value,
                 ttl_s=round(choice.ttl_s, 1), reason=choice.reason,
                 # what re-prefill was priced at (the calibration, or the engine's steps)
                 prefill_us_per_token=round(costs.prefill_s_per_token * 1e6, 2)
                 if costs is not None else None,
                 kv_usage=round(costs.kv_usage, 3) if isinstance(costs, HoldCosts) else None,
                 # the rent's measure (None: the contention model priced it)
                 displaced_tokens_per_s=round(costs.displaced_tokens_per_s, 1)
                 if isinstance(costs, HoldCosts) and costs.displaced_tokens_per_s is not None
                 else None)
        return choice

    async def pause_distribution(self, profile: Profile, kind: str) -> PauseDistribution:
        """The pauses of ``kind`` the hold model weighs (Redis's histogram, else the
        prior): read once, it serves both ``decide`` and ``lasts_the_wait``."""
        return await self._pauses.distribution(profile, kind)

    async def lasts_the_wait(self, *, job_id: str, profile: Profile, kind: str,
                             prompt_tokens: int, wait: PauseDistribution | None = None
                             ) -> bool:
        """Whether a hold of ``prompt_tokens`` made now would last through a pause of
        ``kind`` beside the holds here, at the pace the cap lets them go
        (``holding.hold_lasts_the_wait``); a job that holds here already keeps its place.
        Unknown capacity: it lasts. ``wait``: ``kind``'s pauses, where the caller has
        read them (``pause_distribution``)."""
        info = self._info()
        if job_id in self.holds or info is None or not info.kv_capacity_tokens:
            return True
        now = self._clock()
        oldest = min((h.created for h in self.holds.values()), default=None)
        return hold_lasts_the_wait(
            self.held_tokens, prompt_tokens, info.kv_capacity_tokens,
            self.config.max_held_fraction,
            oldest_age_s=None if oldest is None else now - oldest,
            turnover_s=cap_turnover_s(*self._room_release, now),
            wait=wait if wait is not None else await self._pauses.distribution(profile, kind))

    async def decide(self, *, profile: Profile, kind: str, prefix_tokens: int,
                     policy: HoldPolicy, interactive: bool,
                     pauses: PauseDistribution | None = None) -> HoldChoice | None:
        """What ``after_step`` would decide for a prompt of ``prefix_tokens`` paused on
        ``kind``, without holding anything: a pre-warm on an approval's opening asks it
        before it computes the prompt (``holding.viewed_kind``). None: no decision (the
        policy never holds, or the engine is not known yet). ``pauses``: ``kind``'s, where
        the caller has read them (``pause_distribution``)."""
        if policy == "never" or prefix_tokens < 1:
            return None
        decided = await self._decide(profile=profile, kind=kind, prefix_tokens=prefix_tokens,
                                     policy=policy, interactive=interactive, pauses=pauses)
        return None if decided is None else decided[0]

    async def _decide(self, *, profile: Profile, kind: str, prefix_tokens: int,
                      policy: HoldPolicy, interactive: bool,
                      pauses: PauseDistribution | None = None
                      ) -> tuple[HoldChoice, HoldCosts | TtlCacheCosts | None] | None:
        if policy == "always_hold":
            return HoldChoice(HoldAction.HOLD, self.config.always_hold_ttl_s, 0.0, 0.0,
                              "always_hold policy"), None
        costs = self.costs(prefix_tokens, interactive=interactive)
        if costs is None:
            return None
        if pauses is None:
            pauses = await self._pauses.distribution(profile, kind)
        return decide_hold(costs, pauses), costs

    def _hold_for_s(self, choice: HoldChoice, policy: HoldPolicy) -> float:
        return choice.ttl_s * (1.0 if policy == "always_hold" else self.config.ttl_slack)

    def resume(self, job_id: str) -> None:
        """The job's next step is here: its hold has done its work. It ends at once; its
        Redis bookkeeping (the count, the published table) waits for the next tick, off
        the step's path."""
        if self.holds.pop(job_id, None) is not None:
            self._resumed += 1

    # ---- keeping holds warm ------------------------------------------------------------

    def touch_interval_s(self) -> float:
        """Touch before other traffic can push the prefix's blocks out of the LRU: the
        blocks free for reuse ahead of them, over the rate other traffic uses blocks."""
        info = self._info()
        if info is None or not info.kv_capacity_tokens:
            return self.config.max_touch_interval_s
        # the engine's KV usage does not count held blocks (touches end at once)
        free = info.kv_capacity_tokens * (1 - info.kv_usage) - self.held_tokens
        return touch_interval_s(self.config, free_tokens=free,
                                churn_tokens_per_s=self.churn.rate)

    def observe_step(self, *, uncached_tokens: int, ttft_s: float) -> None:
        """Feed one step the engine served (its uncached prompt tokens and TTFT): the hold
        model prices re-prefill by what the engine shows now (``ObservedPrefill``)."""
        self.prefill.observe(uncached_tokens, ttft_s)

    def observe_engine(self, computed_tokens_total: float, now: float | None = None) -> None:
        """Feed the engine's cumulative computed-prefill counter (queries - hits)."""
        self.churn.observe(computed_tokens_total, self._clock() if now is None else now)

    async def tick(self) -> None:
        now = self._clock()
        for h in list(self.holds.values()):
            if now >= h.until and self._forget(h):
                await self._count(released_on_ttl=1)
        self._ask_over(now)
        interval = self.touch_interval_s()
        for h in self.holds.values():
            if h.pings is None:
                # The churn may have risen since this touch was scheduled (a hold made on
                # a quiet engine waited the longest interval, 30 s, while a burst of
                # other traffic turned the pool over in seconds): never wait longer than
                # the interval the churn asks for now.
                last = h.created if h.touched_at is None else h.touched_at
                h.next_touch = min(h.next_touch, last + interval)
        due = [h for h in self.holds.values() if h.next_touch <= now]
        if due:
            due = await self._drop_moved(due)
        if due:
            await asyncio.gather(*(self._touch(h) for h in due))
            interval = self.touch_interval_s()
            touched = self._clock()
            for h in due:
                h.touched_at = touched
                if h.pings is not None:
                    h.pings = [t for t in h.pings if t > now]
                    h.next_touch = h.pings[0] if h.pings else h.until
                else:
                    h.next_touch = touched + interval
        counts: dict[str, int] = {}
        if self._resumed:
            counts["released_on_resume"], self._resumed = self._resumed, 0
        if self.regret is not None and self.regret.regretted > self._regretted:
            # blocks the engine computed again after evicting them (what room is worth)
            counts["regretted_blocks"] = self.regret.regretted - self._regretted
            self._regretted = self.regret.regretted
        if counts:
            await self._count(**counts)
        await self._publish()

    async def run(self, tick_s: float = 0.25) -> None:
        """Tick for good. Holds live in this process, not in Redis: while Redis is away
        they are still touched (their bookkeeping waits), and nothing stops the loop,
        which would leave the worker's task group and stop the worker."""
        while True:
            stop_if_cancelled()
            try:
                await self.tick()
            except REDIS_ERRORS as e:  # the bookkeeping is best effort; should not come here
                self._outage.failed(e, what="hold tick")
            except httpx.HTTPError as e:
                log.warning("hold_tick_failed", error=str(e))
            except Exception:  # noqa: BLE001 - holds are advice; the worker serves steps
                log.exception("hold_tick_failed")
            await asyncio.sleep(tick_s)

    async def _drop_moved(self, due: list[Hold]) -> list[Hold]:
        """Drop the holds whose job has since been served on another engine (the prefix
        directory's record of the job: a step at or after the hold's, elsewhere); the
        rest are returned. A job moves on failover, when the router picks another engine
        for its next step, or when an approval's prewarm lands elsewhere, and only the
        engine it went to resumes its own hold: the old one would otherwise keep
        touching a prompt nobody will send here until its TTL (always-hold's is 10
        minutes), in room the cap gives other holds. One round trip for all due holds;
        with Redis away every hold is kept."""
        directory = self._directory
        known = [h for h in due if h.step is not None]
        if directory is None or not known:
            return due
        records = await self._outage.attempt(
            "prefix directory", lambda: directory.job_engines([h.job_id for h in known]),
            None, timeout_s=REDIS_TIMEOUT_S)
        if not records:
            return due
        kept = []
        for h in due:
            engine, step = records.get(h.job_id, (self._engine, None))
            if (engine != self._engine and step is not None and h.step is not None
                    and step >= h.step and self._forget(h)):
                await self._count(released_moved=1)
                log.info("hold_moved", job_id=h.job_id, to_engine=engine, step=step)
            else:
                kept.append(h)
        return kept

    def _ask_over(self, now: float) -> None:
        """Ask ``jobs_over`` about the holds not asked for ``config.job_check_s``, all in
        one question, in the background (a slow Temporal must not hold back touches);
        ``_drop_over`` drops those whose job has ended. Without it an ended job's hold
        stands to its TTL, always-hold's approvals 10 minutes, in room the cap gives
        other holds."""
        every = self.config.job_check_s
        if (self._jobs_over is None or every <= 0
                or (self._asking is not None and not self._asking.done())):
            return
        ask = [h for h in self.holds.values()
               if now - (h.created if h.asked_at is None else h.asked_at) >= every]
        if not ask:
            return
        for h in ask:
            h.asked_at = now
        self._asking = asyncio.create_task(self._drop_over(self._jobs_over, ask))

    async def _drop_over(self, jobs_over: JobsOver, ask: list[Hold]) -> None:
        try:
            over = await jobs_over(sorted({h.job_id for h in ask}))
        except Exception as e:  # noqa: BLE001 - advice: a hold kept costs only room
            log.warning("hold_job_check_failed", error=str(e))
            return
        now = self._clock()
        for h in ask:
            # _forget: the job may have been resumed, or held anew, while we asked
            if h.job_id in over and self._forget(h):
                await self._count(released_job_over=1)
                log.info("hold_job_over", job_id=h.job_id, kind=h.kind,
                         held_s=round(now - h.created, 1))

    async def _touch(self, h: Hold) -> None:
        if h.body is not None:  # a managed API: resend the conversation, one output token
            url, body = self._chat_url, {**h.body, "max_tokens": 1, "stream": False}
            body.pop("stream_options", None)
        else:
            if not await self._still_cached(h):
                return
            url, body = self._url, {"model": self._model, "prompt": h.tokens, "max_tokens": 1,
                                    "temperature": 0, "priority": self.config.touch_priority}
            if h.salt is not None:
                body["cache_salt"] = h.salt
        self.touching += 1
        try:
            r = await self._http.post(url, json=body, timeout=30.0)
        finally:
            self.touching -= 1
        if r.status_code != 200:
            log.warning("touch_failed", job_id=h.job_id, status=r.status_code)
            return
        usage = r.json().get("usage") or {}
        prompt = int(usage.get("prompt_tokens", 0))
        cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
        h.touches += 1
        computed = prompt - cached + 1  # its uncached prompt and one output token
        if computed > 2:
            log.info("touch_recomputed", job_id=h.job_id, prompt_tokens=prompt,
                     cached_tokens=cached, blocks=len(h.hashes or []), touches=h.touches)
        await self._count(touches=1, touch_prompt_tokens=prompt,
                          touch_computed_tokens=computed)

    async def record_prewarm(self, prompt_tokens: int, cached_tokens: int) -> None:
        """A pre-warm re-prefilled a paused job's prompt: count what it computed."""
        await self._count(prewarms=1,
                          prewarm_computed_tokens=max(0, prompt_tokens - cached_tokens))

    async def _still_cached(self, h: Hold) -> bool:
        """Trim the hold to its blocks the engine still caches (per its KV events);
        False, and the hold dropped, when none are left."""
        info = self._info()
        directory = self._directory
        if directory is None or not h.hashes or info is None or not info.precise:
            return True
        hashes = h.hashes
        matched = await self._outage.attempt(
            "prefix directory", lambda: directory.matched_blocks(hashes, [self._engine]), None,
            timeout_s=REDIS_TIMEOUT_S)
        if matched is None:
            # Redis away: touch as for an engine without KV events (a block lost since
            # the last touch is computed again, and the hold stays warm).
            return True
        kept = matched[self._engine]
        if kept >= len(h.hashes):
            return True
        if kept == 0:
            self._forget(h)
            await self._count(released_lost=1)
            log.info("hold_lost", job_id=h.job_id, blocks=len(h.hashes))
            return False
        h.hashes = h.hashes[:kept]
        h.tokens = h.tokens[:kept * h.block_size + 1]
        await self._count(shrunk=1)
        return True

    async def _make_room(self) -> None:
        """Bring the held tokens under the cap, oldest holds first, each let go whole;
        with ``HoldConfig.cut_for_room`` a hold whose tail alone is the excess keeps its
        leading blocks instead (a prefix is reusable from its start, so a hold cut short
        still saves what it keeps; whole holds only, one prompt over the cap, a
        3,000-token session on an 8,192-token pool at 30 %, is never held)."""
        info = self._info()
        if info is None or not info.kv_capacity_tokens:
            return
        cap = self.config.max_held_fraction * info.kv_capacity_tokens
        for h in sorted(self.holds.values(), key=lambda h: h.created):
            excess = self.held_tokens - cap
            if excess <= 0:
                break
            before = len(h.tokens)
            if self.config.cut_for_room and self._trim(h, excess):
                log.info("hold_cut_for_room", job_id=h.job_id, kind=h.kind,
                         tokens_before=before, tokens=len(h.tokens), excess=round(excess),
                         age_s=round(self._clock() - h.created, 1))
                await self._count(trimmed_for_room=1)
                break
            if self._forget(h):
                now = self._clock()
                self._room_release = (now, now - h.created)
                log.info("hold_released_for_room", job_id=h.job_id, kind=h.kind,
                         tokens=before, excess=round(excess),
                         age_s=round(now - h.created, 1))
                await self._count(released_for_room=1)

    def _trim(self, h: Hold, excess: float) -> bool:
        """Cut ``h``'s tail so the held tokens fall by at least ``excess``, keeping at
        least one block; False (``h`` unchanged) when its tail cannot give that much.
        Blocks another hold keeps too free nothing, so they are not counted."""
        bs = h.block_size
        if h.body is not None or bs < 1:
            return False  # a managed API's keep-alive resends the whole chat
        if not h.hashes:
            keep = int((len(h.tokens) - excess - 1) // bs) * bs + 1
            if keep < bs + 1:
                return False
            h.tokens = h.tokens[:keep]
            return True
        shared = {x for o in self.holds.values() if o is not h and o.hashes for x in o.hashes}
        freed = max(0, len(h.tokens) - len(h.hashes) * bs - 1)  # its tail past full blocks
        kept = len(h.hashes)
        while freed < excess and kept > 1:
            kept -= 1
            if h.hashes[kept] not in shared:
                freed += bs
        if freed < excess:
            return False
        h.hashes = h.hashes[:kept]
        h.tokens = h.tokens[:kept * bs + 1]
        return True

    def _forget(self, h: Hold) -> bool:
        """Drop ``h`` if it is still its job's hold. Callers await Redis between choosing
        a hold and dropping it, and a step may resume (or hold anew) the job meanwhile."""
        if self.holds.get(h.job_id) is not h:
            return False
        del self.holds[h.job_id]
        return True

    async def _count(self, **increments: int) -> None:
        """Add to this engine's hold statistics, in one round trip. Best effort: while
        Redis is away the increments wait in memory and go with the next count."""
        pending, self._uncounted = self._uncounted, Counter()
        pending.update(increments)
        key = HOLD_STATS.format(self._engine)

        async def write() -> bool:
            pipe = self._redis.pipeline(transaction=False)
            for field, n in pending.items():
                pipe.hincrby(key, field, n)
            await pipe.execute()
            return True

        if not await self._outage.attempt("hold statistics", write, False,
                                          timeout_s=REDIS_TIMEOUT_S):
            self._uncounted.update(pending)

    async def _publish(self) -> None:
        """The hold table, for `warmloop` reports. Best effort: each tick writes it
        whole, so one that Redis missed is made good by the next."""
        key = HOLDS_KEY.format(self._engine)

        async def write() -> None:
            pipe = self._redis.pipeline(transaction=True)
            pipe.delete(key)
            if self.holds:
                pipe.hset(key, mapping={j: h.record() for j, h in self.holds.items()})
            await pipe.execute()

        await self._outage.attempt("hold table", write, None, timeout_s=REDIS_TIMEOUT_S)


async def hold_stats(redis: aioredis.Redis, engine_id: str) -> dict[str, int]:
    raw = await redis.hgetall(HOLD_STATS.format(engine_id))
    return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
