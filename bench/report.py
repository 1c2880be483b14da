"""Summaries of job results: the figures `make demo` and the benchmarks print."""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass

from workflows.contracts import JobResult


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class JobsSummary:
    jobs: int
    states: dict[str, int]
    steps: int
    prompt_tokens: int
    cached_tokens: int
    later_steps: int
    """Steps after a job's first: they should find the job's own prefix cached."""
    later_steps_cached: int
    ttft_p50_ms: float
    ttft_p95_ms: float

    @property
    def cache_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0


def summarize(results: list[JobResult]) -> JobsSummary:
    steps = [s for r in results for s in r.steps]
    later = [s for r in results for s in r.steps[1:]]
    ttfts = [s.ttft_ms for s in steps]
    return JobsSummary(
        jobs=len(results),
        states=dict(Counter(r.state.value for r in results)),
        steps=len(steps),
        prompt_tokens=sum(s.prompt_tokens for s in steps),
        cached_tokens=sum(s.cached_tokens for s in steps),
        later_steps=len(later),
        later_steps_cached=sum(1 for s in later if s.cached_tokens > 0),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p95_ms=percentile(ttfts, 95),
    )
