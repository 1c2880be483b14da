"""The cost forecast: bands from Monte Carlo over observed jobs."""

from __future__ import annotations

import random

import pytest

from warmloop.sim.forecast import ObservedJob, ObservedStep, forecast, jobs_from_step_logs
from warmloop.workflows.pricing import Pricing

PRICE = Pricing(input_per_m=1.0, cached_input_per_m=0.1, output_per_m=2.0)


def observed(n: int, seed: int) -> list[ObservedJob]:
    rng = random.Random(seed)
    jobs = []
    for i in range(n):
        steps = [ObservedStep(prompt_tokens=1000 + 100 * k, cached_tokens=900,
                              completion_tokens=rng.randint(10, 90),
                              cost_usd=rng.lognormvariate(-9, 0.5))
                 for k in range(rng.randint(2, 8))]
        jobs.append(ObservedJob(f"j{i}", "p", steps))
    return jobs


def test_band_holds_about_80_percent_of_fresh_jobs() -> None:
    f = forecast(observed(400, 1), PRICE, runs=4_000, seed=2)
    fresh = [j.cost(PRICE, {}) for j in observed(2_000, 3)]
    inside = sum(f.p10 <= c <= f.p90 for c in fresh) / len(fresh)
    over = sum(c > f.p95 for c in fresh) / len(fresh)
    assert 0.74 <= inside <= 0.86
    assert 0.02 <= over <= 0.08
    assert 0.7 <= f.observed_in_band <= 0.9
    assert "80 % of tasks will cost $" in f.line() and "5 % will cost more than $" in f.line()


def test_retries_and_tool_costs_raise_the_forecast() -> None:
    jobs = observed(100, 4)
    base = forecast(jobs, PRICE, runs=2_000)
    retried = [ObservedJob(j.job_id, j.profile, [ObservedStep(
        s.prompt_tokens, s.cached_tokens, s.completion_tokens, s.cost_usd, retries=1,
        tool="t") for s in j.steps]) for j in jobs]
    more = forecast(retried, PRICE, runs=2_000, tool_costs={"t": 0.001})
    assert more.p50 > base.p50 + 0.001


def test_refuses_too_few_runs_or_jobs() -> None:
    with pytest.raises(ValueError, match="runs must be >= 1000"):
        forecast(observed(10, 1), PRICE, runs=10)
    with pytest.raises(ValueError, match="at least 5 observed jobs"):
        forecast(observed(2, 1), PRICE)


def test_jobs_from_step_logs_prices_unknown_costs() -> None:
    lines = [{"event": "step_generated", "job_id": "x-001", "step": s, "prompt_tokens": 1000,
              "cached_tokens": 0 if s == 1 else 900, "ttft_ms": 50, "latency_ms": 170}
             for s in (1, 2)]
    [job] = jobs_from_step_logs(lines)
    assert job.profile == "x" and len(job.steps) == 2
    assert job.steps[0].completion_tokens == 10
    assert job.cost(PRICE, {}) > 0
