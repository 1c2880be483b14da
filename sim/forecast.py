"""Cost forecast: Monte Carlo over a profile's decision loop, learned from observed jobs.

Each simulated task draws its step count from the observed jobs' step counts, and per
step the tokens (prompt, cached, completion) and cost of an observed step at the same
position (the loop's later steps carry longer transcripts); a step is retried with the
observed retry rate (the attempt costs again), an approval escalates with the observed
escalation rate (the resumed prompt is re-prefilled once more), and each tool call adds
its tool's cost (``--tool-costs``). Steps whose cost was not recorded (an engine without
a price) are priced by a calibration's ``EnginePrice``.

Observed jobs come from ``warmloop result --json`` output (``JobResult``: JSON, a list of
them, or JSONL), or from inference workers' ``step_generated`` log lines.
"""

from __future__ import annotations

import json
import random
from collections import defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from warmloop.workflows.pricing import Pricing


@dataclass(frozen=True)
class ObservedStep:
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    cost_usd: float | None
    retries: int = 0
    tool: str | None = None


@dataclass
class ObservedJob:
    job_id: str
    profile: str
    steps: list[ObservedStep]
    escalations: int = 0
    approvals: int = 0

    def cost(self, price: Pricing, tool_costs: dict[str, float]) -> float:
        return sum(_step_cost(s, price) * (1 + s.retries) + tool_costs.get(s.tool or "", 0.0)
                   for s in self.steps)


def _step_cost(s: ObservedStep, price: Pricing) -> float:
    if s.cost_usd is not None:
        return s.cost_usd
    return price.cost(prompt_tokens=s.prompt_tokens, cached_tokens=s.cached_tokens,
                      completion_tokens=s.completion_tokens)


def job_from_result(d: dict[str, Any]) -> ObservedJob:
    """An observed job from a ``JobResult`` dump."""
    steps = [ObservedStep(int(s["prompt_tokens"]), int(s["cached_tokens"]),
                          int(s["completion_tokens"]), s.get("cost_usd"),
                          int(s.get("retries", 0)), s.get("tool")) for s in d.get("steps", [])]
    approvals = d.get("approvals", []) or []
    escalations = sum(1 for a in approvals if a.get("escalated") or a.get("level", 0))
    return ObservedJob(d.get("job_id", "?"), d.get("profile", "?"), steps, escalations,
                       len(approvals))


def load_jobs(path: Path) -> list[ObservedJob]:
    """``JobResult`` JSON (one, a list, or JSONL), or ``step_generated`` log lines."""
    text = path.read_text()
    stripped = text.strip()
    if stripped.startswith("["):
        return [job_from_result(d) for d in json.loads(stripped)]
    lines = [json.loads(line) for line in stripped.splitlines() if line.strip().startswith("{")]
    if lines and all(d.get("event") == "step_generated" for d in lines):
        return jobs_from_step_logs(lines)
    return [job_from_result(d) for d in lines if "steps" in d]


def jobs_from_step_logs(records: Iterable[dict[str, Any]], *, decode_ms_per_token: float = 12.0,
                        profile_of: dict[str, str] | None = None) -> list[ObservedJob]:
    """Jobs from inference workers' ``step_generated`` lines: prompt and cached tokens as
    the engine reported them; completion tokens estimated from the decode time (the log
    line does not carry them) at ``decode_ms_per_token``; cost unknown (priced later)."""
    by_job: dict[str, dict[int, ObservedStep]] = defaultdict(dict)
    for d in records:
        if d.get("event") != "step_generated" or "job_id" not in d:
            continue
        decode = max(0.0, float(d.get("latency_ms", 0)) - float(d.get("ttft_ms", 0)))
        by_job[d["job_id"]][int(d.get("step", 0))] = ObservedStep(
            int(d["prompt_tokens"]), int(d["cached_tokens"]),
            max(1, round(decode / decode_ms_per_token)), None)
    out = []
    for job_id, steps in by_job.items():
        profile = (profile_of or {}).get(job_id) or job_id.rsplit("-", 1)[0]
        out.append(ObservedJob(job_id, profile, [steps[k] for k in sorted(steps)]))
    return out


@dataclass
class Forecast:
    runs: int
    costs: list[float] = field(repr=False)
    p10: float
    p50: float
    p90: float
    p95: float
    observed: int
    observed_in_band: float
    """Share of the observed jobs' real costs inside [p10, p90] (about 0.8 if right)."""
    observed_over_p95: float
    """Share of the observed jobs costing more than p95 (about 0.05 if right)."""

    def line(self) -> str:
        return (f"80 % of tasks will cost ${self.p10:.6f}-${self.p90:.6f}; "
                f"5 % will cost more than ${self.p95:.6f}")


def quantile(sorted_values: Sequence[float], q: float) -> float:
    if not sorted_values:
        raise ValueError("no values")
    i = q * (len(sorted_values) - 1)
    lo = int(i)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (i - lo)


def forecast(jobs: Sequence[ObservedJob], price: Pricing, *, runs: int = 10_000, seed: int = 0,
             tool_costs: dict[str, float] | None = None) -> Forecast:
    """Monte Carlo over the loop learned from ``jobs`` (at least 1,000 runs)."""
    if runs < 1_000:
        raise ValueError(f"runs must be >= 1000 for a stable tail, got {runs}")
    usable = [j for j in jobs if j.steps]
    if len(usable) < 5:
        raise ValueError(f"need at least 5 observed jobs with steps, got {len(usable)}; "
                         "run more jobs of the profile first")
    tools = tool_costs or {}
    rng = random.Random(seed)
    counts = [len(j.steps) for j in usable]
    by_pos: dict[int, list[ObservedStep]] = defaultdict(list)
    for j in usable:
        for i, s in enumerate(j.steps):
            by_pos[i].append(s)
    last_pos = max(by_pos)
    escalation_rate = sum(j.escalations for j in usable) / len(usable)
    costs = []
    for _ in range(runs):
        n = rng.choice(counts)
        total = 0.0
        prompt = 0
        for i in range(n):
            s = rng.choice(by_pos[min(i, last_pos)])
            c = _step_cost(s, price)
            # retries as the observed step had them (each attempt costs again)
            total += c * (1 + s.retries) + tools.get(s.tool or "", 0.0)
            prompt = s.prompt_tokens
        if rng.random() < escalation_rate:
            total += price.cost(prompt_tokens=prompt, cached_tokens=0, completion_tokens=1)
        costs.append(total)
    costs.sort()
    p10, p50, p90, p95 = (quantile(costs, q) for q in (0.1, 0.5, 0.9, 0.95))
    observed = [j.cost(price, tools) for j in usable]
    return Forecast(runs=runs, costs=costs, p10=p10, p50=p50, p90=p90, p95=p95,
                    observed=len(observed),
                    observed_in_band=sum(p10 <= c <= p90 for c in observed) / len(observed),
                    observed_over_p95=sum(c > p95 for c in observed) / len(observed))
