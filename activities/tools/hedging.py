"""Hedged tool calls: a read-only call that runs past its tool's p95 gets a second,
identical request; the first answer wins and the other request is cancelled.

Why p95: a tool's latency is often a fast body and a slow tail (a cold cache, a GC
pause, a retry inside the service) that strikes requests independently. Waiting the
p95 before asking again costs about 5 % extra requests and turns a tail of seconds
into about "p95 plus one more fast call". The threshold comes from the pause
statistics (``PauseStats``, kind ``tool_kind(name)``; the tool's ``pause_median_s`` /
``pause_p90_s`` prior until it has samples). Those statistics record the latency the
job saw, which under hedging is ``min(first, p95 + second)``: below the p95 that is
the unhedged latency, and the share above it is unchanged, so hedging leaves its own
threshold where it was.

Safety:

- Only a tool declared ``read_only`` (which excludes ``side_effect``), in a job that
  allows it (``ToolRequest.hedge``), is hedged. Side-effect tools never are.
- An error of one request never hides the other's answer: the first request to
  *answer* wins; both failing raises the first request's error (Temporal retries).
- The loser is cancelled and awaited, so no task outlives the call. A sync Python
  function's loser cannot be stopped (a thread) and runs on until it returns; its
  answer is dropped.
- A budget caps hedges at ``max_extra_share`` of calls per (profile, tool) in each
  worker, so statistics that are off (a prior far below the real latency, a service
  slow for everyone) cannot double the load on a struggling service.

Not hedged: a user's own Temporal activity tools (``ActivityRunner``), which the
workflow schedules on the user's queue, and a ``Toolset`` whose ``arun`` is the
synchronous default (it blocks the event loop, so a second request could not start).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeVar

import redis.asyncio as aioredis
import structlog
from temporalio import activity

from warmloop.activities.pauses import PauseStats, tool_kind
from warmloop.activities.registry import RedisOutage
from warmloop.workflows.holding import PauseDistribution
from warmloop.workflows.profiles import Profile, ToolSpec

log = structlog.get_logger(__name__)

T = TypeVar("T")

HEDGES_KEY = "warmloop:tool_hedges"
"""Redis hash of the workers' hedge counts, fields ``<profile>|<tool>|<what>`` with
``what`` one of ``calls`` (hedge-eligible calls), ``hedged`` (second requests sent),
``hedge_won`` (the second request answered first)."""
REDIS_TIMEOUT_S = 0.5
"""Longest a hedge count is written before going without (counts are advice)."""
LOSER_GRACE_S = 1.0
"""How long a cancelled loser is awaited; one that ignores cancellation is logged."""

Winner = Literal["primary", "hedge"]


@dataclass(frozen=True)
class Raced(Generic[T]):
    """The answer of a possibly hedged call."""

    value: T
    hedged: bool
    """A second request was sent."""
    winner: Winner


async def race(start: Callable[[bool], Coroutine[Any, Any, T]], *,
               delay_s: Awaitable[float | None], allow: Callable[[], bool],
               clock: Callable[[], float] = time.monotonic) -> Raced[T]:
    """Run ``start(False)``; if it has not answered ``delay_s`` seconds after it started
    (None: never hedge) and ``allow()`` agrees, run ``start(True)`` beside it. The first
    to return wins and the other is cancelled; an error waits for the other request;
    both failing raises the first request's error. ``delay_s`` is awaited while the
    first request runs (a slow statistics read never delays the answer)."""
    t0 = clock()
    first = asyncio.create_task(start(False))
    lookup = asyncio.ensure_future(delay_s)
    tasks = [first]
    try:
        await asyncio.wait({first, lookup}, return_when=asyncio.FIRST_COMPLETED)
        if not first.done():
            delay = _delay(lookup)
            if delay is not None:
                remaining = delay - (clock() - t0)
                if remaining > 0:
                    await asyncio.wait({first}, timeout=remaining)
                if not first.done() and allow():
                    tasks.append(asyncio.create_task(start(True)))
        pending: set[asyncio.Task[T]] = set(tasks)
        while pending:
            done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            # the primary first when both finished in the same turn
            for i, t in enumerate(tasks):
                if t in done and not t.cancelled() and t.exception() is None:
                    return Raced(t.result(), hedged=len(tasks) > 1,
                                 winner="primary" if i == 0 else "hedge")
        raise first.exception() or RuntimeError("tool call ended without an answer")
    finally:
        lookup.cancel()
        await _cancel_all([*tasks, lookup])


def _delay(lookup: asyncio.Future[float | None]) -> float | None:
    if not lookup.done() or lookup.cancelled():
        return None
    if lookup.exception() is not None:
        log.warning("hedge_threshold_unavailable", error=str(lookup.exception()))
        return None
    return lookup.result()


async def _cancel_all(tasks: list[asyncio.Future[Any]]) -> None:
    """Cancel what is still running and wait for it to end (bounded), so no request
    outlives the call; errors of the cancelled are theirs, not the call's."""
    live = [t for t in tasks if not t.done()]
    for t in live:
        t.cancel()
    if not live:
        return
    # shield: the call being cancelled itself must still reap its requests
    done, stuck = await asyncio.shield(asyncio.wait(live, timeout=LOSER_GRACE_S))
    for t in done:
        if not t.cancelled():
            t.exception()  # retrieved: a loser's error is not the call's
    if stuck:
        log.warning("hedge_loser_ignored_cancel", tasks=len(stuck))


@dataclass
class _Budget:
    tokens: float


@dataclass
class _Threshold:
    at: float
    delay_s: float
    from_prior: bool


class Hedging:
    """When to hedge a tool call, and the counts of what it did (per worker process).

    ``quantile`` of the tool's latency (the pause statistics, else its prior) is how
    long a call runs before its second request; ``max_extra_share`` caps second
    requests at that share of the tool's calls (``burst`` of them may come together);
    ``fresh_s`` is how long a threshold is reused before the statistics are read
    again (one Redis read per tool per ``fresh_s``, not per call)."""

    def __init__(self, pauses: PauseStats | None = None, *,
                 redis: aioredis.Redis | None = None, quantile: float = 0.95,
                 max_extra_share: float = 0.10, burst: float = 3.0, fresh_s: float = 10.0,
                 min_delay_s: float = 0.005, outage: RedisOutage | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if not 0.5 <= quantile < 1:
            raise ValueError(f"hedging quantile {quantile} must be in [0.5, 1)")
        if not 0 <= max_extra_share <= 1:
            raise ValueError(f"max_extra_share {max_extra_share} must be in [0, 1]")
        self._pauses = pauses
        self._redis = redis
        self._q = quantile
        self._share = max_extra_share
        self._burst = max(1.0, burst)
        self._fresh_s = fresh_s
        self._min_delay_s = min_delay_s
        self._outage = outage or RedisOutage()
        self._clock = clock
        self._thresholds: dict[tuple[str, str], _Threshold] = {}
        self._budgets: dict[tuple[str, str], _Budget] = {}
        self.counts: dict[tuple[str, str, str], int] = {}
        """In-process counts: (profile, tool, calls|hedged|hedge_won)."""

    @staticmethod
    def eligible(spec: ToolSpec, hedge: bool) -> bool:
        """A call may be hedged: the job allows it and the tool is declared read-only
        (``ToolSpec`` refuses read_only with side_effect; checked again here because a
        double-applied effect is the one failure hedging must never cause)."""
        return hedge and spec.read_only and not spec.side_effect and not spec.finishes_job

    async def delay_s(self, profile: Profile, spec: ToolSpec) -> float | None:
        """Seconds after which a call of ``spec`` gets its second request; None when
        it must not (the threshold is past the tool's timeout)."""
        key, now = (profile.name, spec.name), self._clock()
        cached = self._thresholds.get(key)
        if cached is None or now - cached.at >= self._fresh_s:
            dist = await self._distribution(profile, spec)
            pts = dist.points()
            cached = self._thresholds[key] = _Threshold(
                at=now, delay_s=max(self._min_delay_s, _quantile(pts, self._q)),
                from_prior=len(dist.samples) < dist.min_samples)
            if len(self._thresholds) > 4096:
                self._thresholds = {key: cached}
        return cached.delay_s if cached.delay_s < spec.timeout_s else None

    async def _distribution(self, profile: Profile, spec: ToolSpec) -> PauseDistribution:
        if self._pauses is not None:
            return await self._pauses.distribution(profile, tool_kind(spec.name))
        return PauseDistribution(prior_median_s=spec.pause_median_s,
                                 prior_p90_s=max(spec.pause_p90_s, spec.pause_median_s))

    def threshold_from_prior(self, profile: str, tool: str) -> bool | None:
        """Whether the last threshold of a tool came from its prior (None: none yet)."""
        t = self._thresholds.get((profile, tool))
        return None if t is None else t.from_prior

    def earn(self, profile: str, tool: str) -> None:
        """One eligible call: the budget grows by ``max_extra_share`` of a request."""
        b = self._budgets.setdefault((profile, tool), _Budget(tokens=1.0))
        b.tokens = min(self._burst, b.tokens + self._share)

    def allow(self, profile: str, tool: str) -> bool:
        """Spend one second request from the tool's budget, if there is one."""
        b = self._budgets.setdefault((profile, tool), _Budget(tokens=1.0))
        if b.tokens < 1.0:
            log.info("tool_hedge_over_budget", profile=profile, tool=tool)
            return False
        b.tokens -= 1.0
        return True

    def _count(self, profile: str, tool: str, what: str) -> None:
        k = (profile, tool, what)
        self.counts[k] = self.counts.get(k, 0) + 1

    async def record(self, profile: str, tool: str, raced: Raced[Any], seconds: float
                     ) -> None:
        """Count a finished eligible call: the in-process counts, the Prometheus counter
        (hedged calls, by winner), a log line, and the Redis hash a bench reads."""
        self._count(profile, tool, "calls")
        fields = [f"{profile}|{tool}|calls"]
        if raced.hedged:
            self._count(profile, tool, "hedged")
            fields.append(f"{profile}|{tool}|hedged")
            if raced.winner == "hedge":
                self._count(profile, tool, "hedge_won")
                fields.append(f"{profile}|{tool}|hedge_won")
            log.info("tool_hedged", tool=tool, winner=raced.winner,
                     seconds=round(seconds, 4))
            if activity.in_activity():
                activity.metric_meter().create_counter(
                    "warmloop_tool_hedges", "tool calls that got a second (hedge) request"
                ).add(1, {"profile": profile, "tool": tool, "winner": raced.winner})
        if self._redis is None:
            return
        redis = self._redis

        async def write() -> None:
            pipe = redis.pipeline(transaction=False)
            for f in fields:
                pipe.hincrby(HEDGES_KEY, f, 1)
            await pipe.execute()

        await self._outage.attempt("tool hedge counts", write, None, timeout_s=REDIS_TIMEOUT_S)


def _quantile(sorted_points: list[float], q: float) -> float:
    if not sorted_points:
        return float("inf")
    return sorted_points[min(len(sorted_points) - 1, round(q * (len(sorted_points) - 1)))]


async def hedge_counts(redis: aioredis.Redis) -> dict[tuple[str, str, str], int]:
    """The workers' hedge counts from Redis: (profile, tool, what) -> count."""
    out: dict[tuple[str, str, str], int] = {}
    for k, v in (await redis.hgetall(HEDGES_KEY)).items():
        key = k.decode() if isinstance(k, bytes) else k
        profile, tool, what = key.rsplit("|", 2)
        out[(profile, tool, what)] = int(v)
    return out
