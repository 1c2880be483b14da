"""Hold or release: whether a paused job's prefix should be kept warm, by cost.

Pure policy (no I/O), so the inference worker (``warmloop.activities.holds``), the benchmarks
and the tests run the same code.

While a job waits on a tool or a human, its prefix sits in the engine's LRU. Holding
it (1-token touches that refresh its blocks) costs KV memory other jobs could use,
for as long as the pause lasts or until the hold's TTL; releasing it costs a
re-prefill of the prefix on resume (GPU time and added latency). Choose the cheaper,
in expectation over the observed pause durations of that tool or approval kind.
"""

from __future__ import annotations

import bisect
import math
from collections import OrderedDict, deque
from collections.abc import Hashable, Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field, model_validator

HoldPolicy = Literal["cost_model", "always_hold", "never"]
"""cost_model: decide_hold per pause; always_hold and never (vLLM's own LRU) are the
baselines benchmarks compare it with."""


class HoldConfig(BaseModel):
    """Prices and limits of holding on one engine."""

    max_held_fraction: float = Field(default=0.3, gt=0, le=1)
    """Cap on held tokens as a share of the KV pool; the oldest holds go first."""
    cut_for_room: bool = False
    """Past the cap, cut the oldest hold's tail where that is room enough, instead of
    letting it go whole. Off by default: bench-pauses' interleaved runs lost with it
    (warmloop 7,170-21,122 tokens recomputed after pauses in five repeats, against
    2,306 at the median of nine without): cut to exactly the excess, the oldest holds
    stay the oldest and are cut again, down to the prompt other holds share, and the
    next in line are the approvals' held prompts. The simulator's agentic fleet seemed
    to gain (439.5 -> 451.5 jobs per GPU-hour at 8 GPUs) only while it let released
    blocks go as if just used; aged to their last touch it is level (431.2 against
    429.0). Bench-gateway's one prompt over the cap (one ~3,000-token session, 2,457
    allowed) is held only with it."""
    prefill_tokens_per_s: float = Field(default=20_000.0, gt=0)
    gpu_usd_per_hour: float = Field(default=0.80, gt=0)
    interactive_latency_usd_per_s: float = Field(default=0.01, ge=0)
    """What a second of added latency on an interactive job's resume is worth."""
    batch_latency_usd_per_s: float = Field(default=0.0, ge=0)
    ttl_slack: float = Field(default=1.2, ge=1.0, le=4.0)
    """A hold lasts the chosen TTL times this. The TTL is a recorded pause's histogram
    bucket middle, and a pause in that bucket may run up to ~16 % longer (log buckets
    1.35x wide): without slack the longest expected pauses outlive their holds."""
    rent: Literal["measured", "model"] = "measured"
    """How a hold's rent is priced on an engine whose KV events are followed: "measured",
    the recomputes the engine's evictions show a hold's room would cause
    (``EvictionRegret``); "model", the prefix's share of the pool times usage / (1 -
    usage), as without events. Measured won where other traffic does not come back
    (bench-pauses: 0.90x / 1.05x always-hold's post-pause prefill, against 1.01-2.21x);
    the simulator's agentic mix (hour-long approvals on 6k-40k-token prompts, pools
    25-70 % in use) did better with the model (603 jobs in 600 s on 8 GPUs against 586):
    the measure holds those approvals near their longest, and sees no cost in the held
    budget (``max_held_fraction``) they take from other holds."""
    always_hold_ttl_s: float = Field(default=600.0, gt=0)
    """TTL of the always_hold baseline policy."""
    min_touch_interval_s: float = Field(default=0.25, gt=0)
    max_touch_interval_s: float = Field(default=30.0, gt=0)
    job_check_s: float = Field(default=5.0, ge=0)
    """How often a standing hold asks whether its job still runs (0: never). A job that
    ended after a pausing step (a token, cost or time budget; a cancel; a rejected or
    expired approval; a terminated workflow) sends no next step to resume its hold, which
    would otherwise stand to its TTL (always-hold's and approvals': 10 minutes) in room
    the cap gives other holds."""
    touch_priority: int = -1
    """vLLM priority of touches (lower first): ahead of interactive steps (0). A touch
    computes one token, so it costs a queued step almost nothing; queued behind other
    requests instead, their allocations evict the very blocks it comes to keep, and the
    touch then recomputes them (bench-pauses saw 68-92 tokens a touch at priority 5)."""


class TtlCacheEndpoint(BaseModel):
    """An engine kind: a managed API whose prompt cache expires ``cache_ttl_s`` after
    last use, billed per token (cached input cheaper)."""

    cache_ttl_s: float = Field(default=300.0, gt=0)
    margin_s: float = Field(default=5.0, ge=0)
    """Ping this long before expiry."""
    input_usd_per_mtok: float = Field(default=3.0, ge=0)
    cached_input_usd_per_mtok: float = Field(default=0.3, ge=0)
    output_usd_per_mtok: float = Field(default=15.0, ge=0)


class HoldAction(StrEnum):
    HOLD = "hold"
    RELEASE = "release"
    OFFLOAD = "offload"
    """Move the prefix's KV to a slower tier (LMCache, CPU offload): GPU engines only."""


class PauseDistribution(BaseModel):
    """Observed pause durations (seconds) of one tool or approval kind.

    Falls back on the profile's prior (a lognormal given by its median and p90) until
    ``min_samples`` observations exist.
    """

    model_config = ConfigDict(frozen=True)

    samples: tuple[float, ...] = ()
    prior_median_s: float = Field(gt=0)
    prior_p90_s: float = Field(gt=0)
    min_samples: int = Field(default=20, ge=1)

    @model_validator(mode="after")
    def _ordered(self) -> PauseDistribution:
        if self.prior_p90_s < self.prior_median_s:
            raise ValueError("prior_p90_s must be >= prior_median_s")
        return self

    def points(self) -> list[float]:
        """Sorted representative durations: the samples, or 99 prior quantiles."""
        if len(self.samples) >= self.min_samples:
            return sorted(self.samples)
        mu = math.log(self.prior_median_s)
        sigma = (math.log(self.prior_p90_s) - mu) / 1.2815515655446004  # z(0.9)
        return [math.exp(mu + sigma * _z((i + 0.5) / 99)) for i in range(99)]

    def scaled(self, factor: float) -> PauseDistribution:
        """The same shape, every pause ``factor`` times longer (for property tests)."""
        return PauseDistribution(
            samples=tuple(s * factor for s in self.samples),
            prior_median_s=self.prior_median_s * factor,
            prior_p90_s=self.prior_p90_s * factor, min_samples=self.min_samples,
        )


def _z(p: float) -> float:
    """Inverse standard normal CDF (Acklam's rational approximation, |err| < 1.2e-9)."""
    a = (-3.969683028665376e01, 2.209460984245205e02, -2.759285104469687e02,
         1.383577518672690e02, -3.066479806614716e01, 2.506628277459239e00)
    b = (-5.447609879822406e01, 1.615858368580409e02, -1.556989798598866e02,
         6.680131188771972e01, -1.328068155288572e01)
    c = (-7.784894002430293e-03, -3.223964580411365e-01, -2.400758277161838e00,
         -2.549732539343734e00, 4.374664141464968e00, 2.938163982698783e00)
    d = (7.784695709041462e-03, 3.224671290700398e-01, 2.445134137142996e00,
         3.754408661907416e00)
    if p < 0.02425:
        q = math.sqrt(-2 * math.log(p))
        return (((((c[0] * q + c[1]) * q + c[2]) * q + c[3]) * q + c[4]) * q + c[5]) / \
            ((((d[0] * q + d[1]) * q + d[2]) * q + d[3]) * q + 1)
    if p > 1 - 0.02425:
        return -_z(1 - p)
    q = p - 0.5
    r = q * q
    return (((((a[0] * r + a[1]) * r + a[2]) * r + a[3]) * r + a[4]) * r + a[5]) * q / \
        (((((b[0] * r + b[1]) * r + b[2]) * r + b[3]) * r + b[4]) * r + 1)


class HoldCosts(BaseModel):
    """What holding and re-prefilling cost on one engine, in dollars."""

    model_config = ConfigDict(frozen=True)

    prefix_tokens: int = Field(ge=0)
    kv_capacity_tokens: int = Field(gt=0)
    kv_usage: float = Field(ge=0, le=1)
    """The engine's memory pressure now (vllm:kv_cache_usage_perc)."""
    prefill_s_per_token: float = Field(gt=0)
    """GPU seconds to prefill one token on this engine (measured)."""
    gpu_usd_per_s: float = Field(gt=0)
    latency_usd_per_s: float = Field(ge=0)
    """What a second of added latency on resume is worth (0 for batch work)."""
    offload_reload_s_per_token: float | None = Field(default=None, gt=0)
    """Seconds per token to bring an offloaded prefix back; None: no offload tier."""

    displaced_tokens_per_s: float | None = Field(default=None, ge=0)
    """Measured: tokens a second the engine would compute again had it this hold's room
    less (``EvictionRegret``); the rent is their re-prefill. None: no measure (no KV
    events, or too few yet), and the rent follows the contention model."""
    displaced_latency_usd_per_s: float | None = Field(default=None, ge=0)
    """What a second of latency is worth to the jobs a hold displaces (None: the
    holder's ``latency_usd_per_s``). They may be interactive while the holder is not."""

    def reprefill_usd(self) -> float:
        seconds = self.prefix_tokens * self.prefill_s_per_token
        return seconds * (self.gpu_usd_per_s + self.latency_usd_per_s)

    def hold_usd_per_s(self) -> float:
        """Rent of the held blocks: what the recomputes they cause other jobs cost.

        Measured where the engine's evictions are followed (``displaced_tokens_per_s``):
        those recomputes, priced as re-prefill. Otherwise a model: the blocks' share of
        the engine scaled by contention; at low pressure idle memory is nearly free, and
        as usage nears 1 holding evicts blocks other jobs need, so the price rises
        without bound (1 / (1 - usage)).
        """
        if self.displaced_tokens_per_s is not None:
            latency = (self.latency_usd_per_s if self.displaced_latency_usd_per_s is None
                       else self.displaced_latency_usd_per_s)
            return self.displaced_tokens_per_s * self.prefill_s_per_token \
                * (self.gpu_usd_per_s + latency)
        share = self.prefix_tokens / self.kv_capacity_tokens
        contention = self.kv_usage / max(1e-6, 1.0 - self.kv_usage)
        return share * self.gpu_usd_per_s * contention

    def offload_usd(self) -> float | None:
        if self.offload_reload_s_per_token is None:
            return None
        seconds = self.prefix_tokens * self.offload_reload_s_per_token
        return seconds * (self.gpu_usd_per_s + self.latency_usd_per_s)


class TtlCacheCosts(BaseModel):
    """A managed endpoint whose prompt cache expires ``cache_ttl_s`` after last use.

    Holding there is keep-alive pings: each re-reads the prefix at the cached price (plus
    one output token) once per TTL period. Releasing means the next call pays the
    prefix at the uncached price, and waits for it.
    """

    model_config = ConfigDict(frozen=True)

    prefix_tokens: int = Field(ge=0)
    cache_ttl_s: float = Field(gt=0)
    margin_s: float = Field(default=5.0, ge=0)
    input_usd_per_token: float = Field(ge=0)
    cached_input_usd_per_token: float = Field(ge=0)
    output_usd_per_token: float = Field(ge=0)
    prefill_s_per_token: float = Field(default=0.0, ge=0)
    """Added latency per uncached token on resume, as the endpoint shows it."""
    latency_usd_per_s: float = Field(default=0.0, ge=0)

    def ping_usd(self) -> float:
        return (self.prefix_tokens * self.cached_input_usd_per_token
                + self.output_usd_per_token)

    def hold_usd_per_s(self) -> float:
        return self.ping_usd() / max(1e-6, self.cache_ttl_s - self.margin_s)

    def reprefill_usd(self) -> float:
        extra = self.prefix_tokens * (self.input_usd_per_token - self.cached_input_usd_per_token)
        return max(0.0, extra) + self.prefix_tokens * self.prefill_s_per_token \
            * self.latency_usd_per_s

    def offload_usd(self) -> float | None:
        return None


class CostModel(Protocol):
    """What decide_hold needs of an engine kind."""

    def hold_usd_per_s(self) -> float: ...
    def reprefill_usd(self) -> float: ...
    def offload_usd(self) -> float | None: ...


@dataclass(frozen=True)
class HoldChoice:
    """The decision and the expected costs behind it, so the choice can be audited."""

    action: HoldAction
    ttl_s: float
    """How long to hold (0 unless HOLD); touches stop and blocks are released after it."""
    expected_usd: float
    release_usd: float
    reason: str


def expected_hold_usd(costs: CostModel, pauses: list[float], ttl_s: float) -> float:
    """E[rent while held] + P(pause > ttl) x re-prefill, over the pause points."""
    rent = costs.hold_usd_per_s()
    reprefill = costs.reprefill_usd()
    n = len(pauses)
    total = 0.0
    for p in pauses:
        total += rent * min(p, ttl_s) + (reprefill if p > ttl_s else 0.0)
    return total / n


def _best_hold(costs: CostModel, points: list[float], reprefill: float
               ) -> tuple[float, float]:
    """The TTL of least ``expected_hold_usd`` among the sorted ``points`` and its cost
    (the first of equals), ``reprefill`` being ``costs.reprefill_usd()`` (the caller
    has it already): one sweep with running sums, not a pass over the points per
    candidate (a fleet decides hundreds of holds a second; the two agree to rounding,
    ``tests/unit/test_holding.py`` checks the choices)."""
    n = len(points)
    if not n:
        return 0.0, math.inf
    rent = costs.hold_usd_per_s()
    best_ttl, best = 0.0, math.inf
    below = 0.0  # sum of the points <= ttl
    i = 0
    while i < n:
        ttl = points[i]
        while i < n and points[i] == ttl:
            below += ttl
            i += 1
        above = n - i  # points > ttl: each pays the hold to ttl, then the re-prefill
        cost = (rent * (below + ttl * above) + reprefill * above) / n
        if cost < best:
            best_ttl, best = ttl, cost
    return best_ttl, best


def decide_hold(costs: CostModel, pauses: PauseDistribution) -> HoldChoice:
    """HOLD for the TTL of least expected cost, RELEASE, or OFFLOAD, whichever is cheapest.

    Candidate TTLs are the pause points themselves (holding past a point only pays if
    the resume comes by then), so the search is exact over the empirical distribution.
    """
    points = pauses.points()
    release = costs.reprefill_usd()
    best_ttl, best = _best_hold(costs, points, release)
    offload = costs.offload_usd()
    if offload is not None and offload < min(best, release):
        return HoldChoice(HoldAction.OFFLOAD, 0.0, offload, release,
                          f"reload ${offload:.2e} < hold ${best:.2e} and re-prefill ${release:.2e}")
    if best < release:
        covered = bisect.bisect_right(points, best_ttl) / len(points)
        return HoldChoice(HoldAction.HOLD, best_ttl, best, release,
                          f"hold {best_ttl:.1f}s covers {covered:.0%} of pauses: "
                          f"${best:.2e} < re-prefill ${release:.2e}")
    return HoldChoice(HoldAction.RELEASE, 0.0, release, release,
                      f"re-prefill ${release:.2e} <= best hold ${best:.2e}")


class ObservedPrefill:
    """What a re-prefill costs on an engine now, from its own steps: the slope of their
    time to first token over their uncached tokens (least squares over the last
    ``window`` steps).

    Why: ``warmloop calibrate`` measures an engine alone, and a hold priced by that idle
    rate calls re-prefill cheap where the engine, busy beside other work, computes each
    token slower (the CPU benches' engines calibrate at 50-105k tokens/s alone; their
    steps' slope under load was 22-58k, run to run), so the hold model lets go of pauses
    always-hold would keep. The slope, not a
    ratio: a step's fixed cost (scheduling, the first decode) does not grow with the
    tokens a hold saves. None until ``min_steps`` steps spanning ``min_spread_tokens``
    uncached tokens were seen (a slope needs different lengths); the caller keeps the
    calibration's rate as a floor, since no load makes prefill faster than alone."""

    def __init__(self, *, window: int = 64, min_steps: int = 16,
                 min_spread_tokens: int = 512) -> None:
        if window < min_steps or min_steps < 2:
            raise ValueError(f"ObservedPrefill needs 2 <= min_steps ({min_steps}) <= window "
                             f"({window})")
        self._window = window
        self._min_steps = min_steps
        self._min_spread = min_spread_tokens
        self._points: list[tuple[int, float]] = []

    def observe(self, uncached_tokens: int, ttft_s: float) -> None:
        """One step's uncached prompt tokens and its time to first token (seconds)."""
        if uncached_tokens < 0 or not ttft_s > 0 or math.isinf(ttft_s):
            return  # a cache-only step or a garbled report: no information
        self._points.append((uncached_tokens, ttft_s))
        if len(self._points) > self._window:
            del self._points[0]

    def s_per_token(self) -> float | None:
        """Seconds each more uncached token adds to a step's TTFT here, or None."""
        pts = self._points
        n = len(pts)
        if n < self._min_steps:
            return None
        xs = [x for x, _ in pts]
        if max(xs) - min(xs) < self._min_spread:
            return None
        mx = sum(xs) / n
        my = sum(y for _, y in pts) / n
        var = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in pts) / var
        return slope if slope > 0 else None


class ChurnMeter:
    """Prompt tokens a second an engine computes (the churn that pushes a hold's blocks
    toward eviction), from its cumulative counter read at each probe (an inference
    worker's heartbeat; the simulator's once a second). ``rate`` is the smoothed rate,
    or the last probe's where it is higher: a burst after a quiet spell turns the pool
    over before the average catches up."""

    __slots__ = ("_probe", "last", "smoothed")

    def __init__(self) -> None:
        self._probe: tuple[float, float] | None = None
        self.smoothed = 0.0
        self.last = 0.0

    def observe(self, computed_tokens_total: float, now: float) -> None:
        """One probe of the counter (vLLM's prefix cache queries minus hits); a counter
        that went back (an engine restarted) starts the measure again."""
        if self._probe is not None:
            t0, v0 = self._probe
            if now > t0 and computed_tokens_total >= v0:
                rate = (computed_tokens_total - v0) / (now - t0)
                self.smoothed = 0.7 * self.smoothed + 0.3 * rate
                self.last = rate
        self._probe = (now, computed_tokens_total)

    @property
    def rate(self) -> float:
        return max(self.smoothed, self.last)


def touch_interval_s(config: HoldConfig, *, free_tokens: float,
                     churn_tokens_per_s: float) -> float:
    """How often to touch a hold so other traffic cannot push its blocks out of the LRU
    between touches: half the time the ``free_tokens`` ahead of them last at the churn,
    within the config's bounds; the longest interval while no churn is measured."""
    if churn_tokens_per_s <= 0:
        return config.max_touch_interval_s
    interval = 0.5 * max(0.0, free_tokens) / churn_tokens_per_s
    return min(config.max_touch_interval_s, max(config.min_touch_interval_s, interval))


class EvictionRegret:
    """What room in an engine's KV pool is worth now, from the engine's own evictions:
    blocks it evicted and then computed again (a ghost list, as in ARC).

    Why: a hold's rent is the recomputes it causes others. The contention model
    (share x usage / (1 - usage)) assumes every held block displaces one someone
    reuses; under churn of fresh prompts (bench-pauses' background: nothing evicted
    ever comes back) holding costs nobody anything, and that rent made the cost model
    let go of the one-in-ten long lookup pauses always-hold keeps (warmloop 1.07-2.21x
    always-hold's post-pause prefill in three of four runs).

    Each evicted block is remembered with the pool's eviction count at the time. When
    the engine stores the same block again, the tokens evicted between the two are how
    much larger the pool would have had to be to keep it (under LRU, evictions come in
    the order of last use). So the recomputes whose distance is at most ``h`` tokens are
    what ``h`` more tokens of room would have saved; the rent of holding ``h`` tokens is
    taken as the same rate (the loss from ``h`` less room read off the gain from ``h``
    more: one side of the engine's miss curve, a local linear reading).

    Pure (the caller passes the clock): the inference worker feeds it the engine's KV
    events, the simulator its engines' evictions."""

    def __init__(self, *, horizon_s: float = 300.0, min_span_s: float = 30.0,
                 max_ghosts: int = 65_536, stale_s: float = 60.0,
                 max_regrets: int = 65_536) -> None:
        """``stale_s``: with no event for that long the regret has no measure (None),
        not a rent of zero: a publisher that died or a subscriber that fell off would
        otherwise read as a pool where room costs nothing, and every pause would be
        held to its longest. An idle engine loses nothing by it (the contention model
        prices an idle pool's room near zero too). ``max_regrets``: the most recomputes
        kept (a busy GPU engine recomputes thousands of blocks a second, and every hold
        decision sums them); past it the rate is read over the span they cover."""
        if not 0 < min_span_s <= horizon_s:
            raise ValueError(f"EvictionRegret needs 0 < min_span_s ({min_span_s}) <= "
                             f"horizon_s ({horizon_s})")
        if max_ghosts < 1:
            raise ValueError(f"EvictionRegret.max_ghosts must be >= 1, got {max_ghosts}")
        if stale_s <= 0:
            raise ValueError(f"EvictionRegret.stale_s must be > 0, got {stale_s}")
        if max_regrets < 1:
            raise ValueError(f"EvictionRegret.max_regrets must be >= 1, got {max_regrets}")
        self._max_regrets = max_regrets
        self._floor: float | None = None
        """When the oldest recompute dropped for ``max_regrets`` was made: the rate is
        read over what came after it."""
        self._horizon = horizon_s
        self._min_span = min_span_s
        self._stale = stale_s
        self._last_event: float | None = None
        self._max_ghosts = max_ghosts
        self._ghosts: OrderedDict[Hashable, int] = OrderedDict()
        """Evicted block -> tokens evicted before it (oldest eviction first)."""
        self._evicted_tokens = 0
        self._regrets: deque[tuple[float, int, int]] = deque()
        """(when, distance in tokens, the block's tokens) of each block computed again."""
        self._since: float | None = None
        self.regretted = 0
        """Blocks computed again after eviction, in all (for logs and tests)."""

    def evicted(self, blocks: Iterable[Hashable], block_tokens: int, now: float) -> None:
        """The engine evicted ``blocks`` (``block_tokens`` each) at ``now``."""
        self._start(now)
        ghosts = self._ghosts
        for b in blocks:
            ghosts.pop(b, None)
            ghosts[b] = self._evicted_tokens
            self._evicted_tokens += block_tokens
        while len(ghosts) > self._max_ghosts:
            ghosts.popitem(last=False)

    def stored(self, blocks: Iterable[Hashable], block_tokens: int, now: float) -> None:
        """The engine computed and cached ``blocks`` at ``now``."""
        self._start(now)
        ghosts = self._ghosts
        for b in blocks:
            mark = ghosts.pop(b, None)
            if mark is not None:
                self._regrets.append((now, self._evicted_tokens - mark, block_tokens))
                self.regretted += 1
        regrets = self._regrets
        if len(regrets) > self._max_regrets:
            floor = 0.0
            while len(regrets) > self._max_regrets:
                floor = regrets.popleft()[0]
            # the rate's span starts at the floor: a recompute made at that very instant
            # would count over no time at all (one batch of events shares one ``now``)
            while regrets and regrets[0][0] <= floor:
                regrets.popleft()
            self._floor = floor
        self._trim(now)

    def _span(self, now: float) -> float | None:
        """Seconds of recomputes to divide by now, or None: no measure (too few seen,
        or stale)."""
        since, last = self._since, self._last_event
        if since is None or last is None or now - since < self._min_span \
                or now - last > self._stale:
            return None
        start = max(since, now - self._horizon,
                    self._floor if self._floor is not None else since)
        return max(now - start, 1e-9)

    def displaced_tokens_per_s(self, room_tokens: int, now: float) -> float | None:
        """Tokens a second the engine computed again that ``room_tokens`` more room
        would have kept (over the last ``horizon_s``); None until ``min_span_s`` of
        events were seen, or after ``stale_s`` without one (zero is a measure: nothing
        evicted came back)."""
        span = self._span(now)
        if span is None:
            return None
        self._trim(now)
        tokens = sum(t for _, d, t in self._regrets if d <= room_tokens)
        return tokens / span

    def curve(self, now: float, *, first_room: int = 256, max_room: int = 1 << 20
              ) -> list[tuple[int, float]] | None:
        """``displaced_tokens_per_s`` at rooms doubling from ``first_room`` up to the
        farthest recompute seen (and no further than ``max_room``): what the inference
        worker's heartbeat carries, for holders that do not see the events (the gateway).
        None while there is no measure."""
        span = self._span(now)
        if span is None:
            return None
        self._trim(now)
        # one pass: each recompute into the first room that covers it, then running sums
        by_room: dict[int, int] = {}
        farthest = 0
        for _, d, t in self._regrets:
            k = max(0, (-(-d // first_room) - 1).bit_length())  # first_room * 2**k >= d
            by_room[k] = by_room.get(k, 0) + t
            farthest = max(farthest, d)
        out, total, k = [], 0, 0
        while True:
            room = first_room << k
            total += by_room.get(k, 0)
            if room >= max_room:
                total = sum(by_room.values())  # the last point counts what lies beyond
            out.append((room, round(total / span, 3)))
            if room >= farthest or room >= max_room:
                return out
            k += 1

    def _start(self, now: float) -> None:
        self._last_event = now
        if self._since is None:
            self._since = now

    def _trim(self, now: float) -> None:
        regrets = self._regrets
        while regrets and regrets[0][0] < now - self._horizon:
            regrets.popleft()


def displaced_on_curve(curve: list[tuple[int, float]], room_tokens: int) -> float:
    """The rate ``EvictionRegret.curve`` gives for ``room_tokens``: at the first room
    that large (rounding the room up counts more recomputes: the dearer rent), or its
    last point, which counts every recompute measured."""
    for room, rate in curve:
        if room >= room_tokens:
            return rate
    return curve[-1][1] if curve else 0.0


PREWARM_SKIPPED = "prewarm_skipped"
"""``GenerateResult.finish_reason`` of a prewarm the worker skipped (``prewarm_worthwhile``
said no): nothing was sent to the engine."""
PREWARM_DECLINED = "prewarm_declined"
"""``GenerateResult.finish_reason`` of an approval's opening pre-warm the hold model
declined: holding the prompt from the opening to the decision does not pay
(``viewed_kind``), so the decision's pre-warm computes it once. Nothing was sent."""


VIEWED_SUFFIX = ":viewed"
VIEWED_PRIOR_S = (30.0, 120.0)
"""(median, p90) seconds from an approval's opening to its decision until the kind has
samples: someone who opened it decides within a minute or two. The whole approval's
prior (a human's: minutes to hours) would decline every opening's pre-warm on a fresh
stack."""


def viewed_kind(approval_kind: str) -> str:
    """The pause kind of the wait from an approval's opening to its decision
    (``approval:<kind>`` -> ``approval:<kind>:viewed``): what a pre-warm on the opening
    holds the prompt through, learned apart from the whole approval's wait. The
    workflow records it at the decision; the opening's pre-warm is sent only where the
    cost model would hold through it (``HoldManager.decide``), since one let go before
    the decision computes the prompt twice."""
    return f"{approval_kind}{VIEWED_SUFFIX}"


def is_viewed_kind(kind: str) -> bool:
    """Whether ``kind`` is a ``viewed_kind`` (its prior is ``VIEWED_PRIOR_S``)."""
    return kind.startswith("approval:") and kind.endswith(VIEWED_SUFFIX)


def cap_turnover_s(released_at: float, age_s: float, now: float) -> float | None:
    """The pace the hold cap lets holds go at, for ``hold_lasts_the_wait``: the age
    ``age_s`` of the last hold let go for room (at ``released_at``), while no longer
    than one such age has passed since; None after that (the cap is not turning over)."""
    return age_s if now - released_at <= age_s else None


def hold_lasts_the_wait(held_tokens: float, prompt_tokens: int, capacity_tokens: float,
                        max_held_fraction: float, *, oldest_age_s: float | None,
                        turnover_s: float | None, wait: PauseDistribution) -> bool:
    """Whether a new hold of ``prompt_tokens`` would likely last through ``wait``, beside
    the ``held_tokens`` an engine of ``capacity_tokens`` holds now.

    The cap lets holds go oldest first, so where it is full a new hold lasts about as
    long as the holds now go at: ``turnover_s``, the age of the last hold let go for
    room (None: none let go for room within that long, so the cap is not turning
    over), or, over the cap now, ``oldest_age_s``, the oldest hold's age, whichever is
    shorter. It lasts the wait if the wait's median is no longer. An approval's opening
    pre-warm asks this after the hold model: a prompt computed and then let go for room
    before the decision is computed again by the decision's own pre-warm. In the
    simulator (8 GPUs, 80 %, 1,800 s: thousands of approvals waiting at once, minutes
    from opening to decision) only 64 of 25,187 decisions found the opening's hold still
    there, and interactive TTFT p99 was 106 ms against 90 without opening pre-warms;
    where the reviewer decides within seconds of opening (bench-pauses) the pre-warm
    still goes at a full cap. Only observed waits decide: until the kind has
    ``min_samples`` its prior is a guess (a minute or two for an opening, chosen so a
    fresh stack pre-warms), under which it lasts. A hold made after a step computes
    nothing, so only the pre-warm asks. An unknown pool (capacity 0) has room; a prompt
    over the cap alone (nothing held) does not last."""
    if capacity_tokens <= 0 or len(wait.samples) < wait.min_samples:
        return True  # a prior (``VIEWED_PRIOR_S``) is a guess, left permissive on purpose
    over = held_tokens + prompt_tokens > max_held_fraction * capacity_tokens
    if over and oldest_age_s is None:
        return False
    lasts = [t for t in (turnover_s, oldest_age_s if over else None) if t is not None]
    if not lasts:
        return True
    points = wait.points()
    return points[len(points) // 2] <= min(lasts)


def prewarm_worthwhile(waiting: int) -> bool:
    """Whether to prewarm a paused job's prompt now, on an engine with ``waiting``
    requests queued (its last report).

    A prewarm is speculative: it pays only if the prompt survives until the job's next
    step, while a queued request's prefill is certain work. On an engine with a queue it
    would delay that work and compete for the pool it would need to survive in; in the
    fleet simulator at 2.4x the bundled mix's old capacity figure, prewarms cost warmloop
    2.7 % of its completed jobs against cache-aware routing without them. So prewarm on
    an engine with spare capacity only; the next step prefills for itself otherwise."""
    return waiting <= 0


def keepalive_schedule(*, cache_ttl_s: float, hold_for_s: float, margin_s: float = 5.0
                       ) -> list[float]:
    """Offsets (seconds from the pause's start) of keep-alive pings for an endpoint whose
    prompt cache expires ``cache_ttl_s`` after last use (a managed API's TTL cache).

    Each ping refreshes the TTL, so pings go ``margin_s`` before each expiry, until the
    hold's end; none when the hold ends before the first expiry.
    """
    if cache_ttl_s <= margin_s:
        raise ValueError(f"cache_ttl_s ({cache_ttl_s}) must exceed margin_s ({margin_s})")
    if hold_for_s < 0:
        raise ValueError("hold_for_s must be >= 0")
    step = cache_ttl_s - margin_s
    return [step * k for k in range(1, int(hold_for_s // step) + 1) if step * k < hold_for_s]
