"""Run one simulation and sum it up."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from warmloop.sim.core import Clock, collecting_less
from warmloop.sim.fleet import POLICIES, Fleet, FleetConfig, Policy
from warmloop.sim.workload import JobSpec
from warmloop.workflows.calibration import EngineCalibration
from warmloop.workflows.contracts import Lane


def pct(values: Sequence[float], q: float) -> float:
    """Nearest-rank percentile, q in 0..1; NaN for none."""
    if not values:
        return math.nan
    ordered = sorted(values)
    return ordered[max(0, min(len(ordered) - 1, math.ceil(q * len(ordered)) - 1))]


@dataclass
class Summary:
    policy: str
    jobs: int
    completed: int
    steps: int
    prompt_tokens: int
    cached_tokens: int
    hit_rate: float
    prefill_tokens: int
    """Prompt tokens the engines computed (all traffic of the jobs, prewarms included)."""
    job_p50_s: float
    job_p95_s: float
    makespan_s: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    interactive_ttft_p99_ms: float
    cost_p50_usd: float
    cost_p95_usd: float
    post_pause_recomputed: int
    other_ttft_p95_ms: float
    engine_busy_share: float
    sim_seconds: float
    events: int
    hold_decisions: dict[str, int]

    def as_dict(self) -> dict[str, object]:
        return {k: (round(v, 6) if isinstance(v, float) else v) for k, v in self.__dict__.items()}


def simulate(jobs: Sequence[JobSpec], calibrations: Sequence[EngineCalibration],
             policy: Policy | str, *, config: FleetConfig | None = None,
             until_s: float | None = None,
             setup: Callable[[Fleet], None] | None = None) -> Summary:
    """Run ``jobs`` on engines of ``calibrations`` under ``policy`` until every job ends
    (or ``until_s``), and sum the run up."""
    pol = POLICIES[policy] if isinstance(policy, str) else policy
    with collecting_less():  # the jobs' chains are built here, as many objects as the run
        clock = Clock()
        fleet = Fleet(clock, calibrations, pol, config)
        fleet.add_jobs(jobs)
        if setup is not None:
            setup(fleet)
        clock.run(until_s)
        return summarize(fleet, clock)


def summarize(fleet: Fleet, clock: Clock) -> Summary:
    done = [j for j in fleet.jobs if not math.isnan(j.end_s)]
    durations = [j.end_s - j.arrival_s for j in done]
    prompt = sum(s.prompt_tokens for s in fleet.steps)
    cached = sum(s.cached_tokens for s in fleet.steps)
    ttfts = [s.ttft_s * 1000 for s in fleet.steps]
    inter = [s.ttft_s * 1000 for s in fleet.steps if s.lane == Lane.INTERACTIVE]
    post_pause = sum(max(0, s.keepable_tokens - min(s.cached_tokens, s.keepable_tokens))
                     for s in fleet.steps if s.step > 1) + fleet.prewarm_computed
    first = min((j.arrival_s for j in fleet.jobs), default=0.0)
    last = max((j.end_s for j in done), default=first)
    costs = [j.cost_usd for j in done]
    busy = sum(e.busy_s for e in fleet.engines)
    span = max(1e-9, clock.now) * len(fleet.engines)
    return Summary(
        policy=fleet.policy.name, jobs=len(fleet.jobs), completed=len(done),
        steps=len(fleet.steps), prompt_tokens=prompt, cached_tokens=cached,
        hit_rate=cached / prompt if prompt else 0.0,
        prefill_tokens=prompt - cached + fleet.prewarm_computed,
        job_p50_s=pct(durations, 0.5), job_p95_s=pct(durations, 0.95),
        makespan_s=last - first, ttft_p50_ms=pct(ttfts, 0.5), ttft_p95_ms=pct(ttfts, 0.95),
        ttft_p99_ms=pct(ttfts, 0.99), interactive_ttft_p99_ms=pct(inter, 0.99),
        cost_p50_usd=pct(costs, 0.5), cost_p95_usd=pct(costs, 0.95),
        post_pause_recomputed=post_pause,
        other_ttft_p95_ms=pct([t * 1000 for t in fleet.other_ttfts], 0.95),
        engine_busy_share=busy / span, sim_seconds=clock.now, events=clock.events,
        hold_decisions=dict(fleet.hold_decisions))
