"""Pause statistics: how long each tool and each approval kind keeps a job waiting.

Kept in Redis as a fixed log-spaced histogram per (profile, kind), so memory stays
bounded however many pauses are seen and any process can merge them. Until a kind
has enough samples the profile's prior (a lognormal) stands in
(``warmloop.workflows.holding.PauseDistribution``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import redis.asyncio as aioredis
from temporalio import activity

from warmloop.activities.registry import RedisOutage
from warmloop.workflows.contracts import RecordPauseRequest
from warmloop.workflows.holding import VIEWED_PRIOR_S, PauseDistribution, is_viewed_kind
from warmloop.workflows.profiles import Profile

PAUSES_KEY = "warmloop:pauses:{}|{}"
PAUSES_INDEX = "warmloop:pauses"
LO_S, HI_S, BUCKETS = 0.05, 86_400.0, 48
_RATIO = (HI_S / LO_S) ** (1 / BUCKETS)
MAX_POINTS = 200
"""Histogram points handed to the cost model (scaled down from larger counts)."""


def bucket_of(seconds: float) -> int:
    if seconds <= LO_S:
        return 0
    return min(BUCKETS - 1, int(math.log(seconds / LO_S) / math.log(_RATIO)))


def bucket_mid(i: int) -> float:
    """Geometric middle of bucket i (its representative duration)."""
    return LO_S * _RATIO ** (i + 0.5)


def tool_kind(tool: str) -> str:
    return f"tool:{tool}"


def approval_kind(kind: str) -> str:
    return f"approval:{kind}"


def prior_for(profile: Profile, kind: str) -> tuple[float, float]:
    """(median, p90) seconds the profile expects for a tool or approval kind (and for
    the wait from an approval's opening to its decision, ``viewed_kind``)."""
    name = kind.split(":", 1)[1]
    if is_viewed_kind(kind):
        return VIEWED_PRIOR_S
    if kind.startswith("approval:"):
        rule = next((r for r in profile.approvals if r.kind == name), None)
        if rule is not None:
            return rule.pause_median_s, rule.pause_p90_s
        return 600.0, 3600.0
    try:
        spec = profile.tool(name)
    except KeyError:
        return 1.0, 5.0
    return spec.pause_median_s, spec.pause_p90_s


@dataclass(frozen=True)
class PauseSummary:
    profile: str
    kind: str
    samples: int
    p50_s: float
    p90_s: float
    p99_s: float
    from_prior: bool


REDIS_TIMEOUT_S = 1.0
"""Longest a pause is recorded or looked up for a decision before going without."""


class PauseStats:
    """The histograms. Recording and reading them for a hold decision are best effort:
    statistics are advice, and a tool that ran (its effect applied) or a step that
    finished must not fail because Redis is away; the decision then uses the prior."""

    def __init__(self, redis: aioredis.Redis, *, min_samples: int = 20,
                 outage: RedisOutage | None = None) -> None:
        self._redis = redis
        self._min = min_samples
        self._outage = outage or RedisOutage()

    async def record(self, profile: str, kind: str, seconds: float) -> None:
        """Add one pause (lost, and logged once per outage, while Redis is away)."""
        key = PAUSES_KEY.format(profile, kind)

        async def write() -> None:
            pipe = self._redis.pipeline(transaction=False)
            pipe.hincrby(key, str(bucket_of(seconds)), 1)
            pipe.hincrby(key, "n", 1)
            pipe.sadd(PAUSES_INDEX, f"{profile}|{kind}")
            await pipe.execute()

        await self._outage.attempt("pause statistics", write, None, timeout_s=REDIS_TIMEOUT_S)

    async def histogram(self, profile: str, kind: str) -> dict[int, int]:
        raw = await self._redis.hgetall(PAUSES_KEY.format(profile, kind))
        out = {}
        for k, v in raw.items():
            key = k.decode() if isinstance(k, bytes) else k
            if key.isdigit():
                out[int(key)] = int(v)
        return out

    async def distribution(self, profile: Profile, kind: str) -> PauseDistribution:
        """What the cost model weighs a hold with: the samples seen, else the prior."""
        median, p90 = prior_for(profile, kind)
        hist: dict[int, int] = await self._outage.attempt(
            "pause statistics", lambda: self.histogram(profile.name, kind), {},
            timeout_s=REDIS_TIMEOUT_S)
        return PauseDistribution(samples=points(hist),
                                 prior_median_s=median, prior_p90_s=max(p90, median),
                                 min_samples=self._min)

    async def summaries(self, profiles: dict[str, Profile]) -> list[PauseSummary]:
        out = []
        for member in sorted(await self._redis.smembers(PAUSES_INDEX)):
            name = member.decode() if isinstance(member, bytes) else member
            profile, _, kind = name.partition("|")
            p = profiles.get(profile)
            hist = await self.histogram(profile, kind)
            n = sum(hist.values())
            if p is not None:
                dist = await self.distribution(p, kind)
            else:
                dist = PauseDistribution(samples=points(hist), prior_median_s=1.0,
                                         prior_p90_s=5.0, min_samples=1)
            pts = dist.points()
            out.append(PauseSummary(profile, kind, n, _q(pts, .5), _q(pts, .9), _q(pts, .99),
                                    from_prior=n < self._min))
        return out


def points(hist: dict[int, int]) -> tuple[float, ...]:
    """The histogram as representative durations, at most MAX_POINTS of them."""
    n = sum(hist.values())
    if n == 0:
        return ()
    scale = min(1.0, MAX_POINTS / n)
    out: list[float] = []
    for i in sorted(hist):
        out += [bucket_mid(i)] * max(1, round(hist[i] * scale))
    return tuple(out)


def _q(sorted_points: list[float], q: float) -> float:
    return sorted_points[min(len(sorted_points) - 1, round(q * (len(sorted_points) - 1)))]


class PauseActivities:
    def __init__(self, stats: PauseStats) -> None:
        self._stats = stats

    @activity.defn(name="record_pause")
    async def record_pause(self, req: RecordPauseRequest) -> None:
        """A workflow saw a pause end (a human's decision): add it to the statistics."""
        await self._stats.record(req.profile, req.kind, req.seconds)
