"""Summaries of job results: what `make demo`, `warmloop report` and the benchmarks print."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

from rich.table import Table

from warmloop.workflows.contracts import STEP_STAGES, JobResult, JobState, StepRecord


def percentile(values: list[float], q: float) -> float:
    """Nearest-rank percentile (q in 0..100); NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = max(1, math.ceil(q / 100 * len(ordered)))
    return ordered[rank - 1]


@dataclass(frozen=True)
class JobsSummary:
    """Figures over a set of jobs, all from the engines' own usage numbers."""

    jobs: int
    states: dict[str, int]
    steps: int
    prompt_tokens: int
    cached_tokens: int
    later_steps: int
    """Steps after a job's first: they should find the job's own prefix cached."""
    later_steps_cached: int
    valid_steps: int
    cost_usd: float
    """Spend of the jobs whose every step was priced."""
    cost_unknown_jobs: int
    """Jobs with a step on an engine that declares no price: their cost is unknown and
    left out of the cost figures."""
    cost_per_task_p50: float
    cost_per_task_p95: float
    ttft_p50_ms: float
    ttft_p95_ms: float
    ttft_p99_ms: float
    task_ttft_p50_ms: float
    """Per job: the sum of its steps' TTFT, the time the agent waited for first tokens."""
    task_ttft_p99_ms: float
    retries: int
    approvals: int
    steps_by_model: dict[str, int] = field(default_factory=dict)
    """Steps per served model (a model ladder's rungs); empty before steps named it."""
    escalations: dict[str, int] = field(default_factory=dict)
    """Steps asked again of a larger model, by reason."""
    top_only_cost_usd: float | None = None
    """Estimate: every step's tokens at the dearest model's observed cost per token
    (what running everything on the top rung would have cost); None with one model."""

    @property
    def cache_share(self) -> float:
        return self.cached_tokens / self.prompt_tokens if self.prompt_tokens else 0.0

    @property
    def tool_call_success(self) -> float:
        """Valid tool calls / model steps."""
        return self.valid_steps / self.steps if self.steps else 0.0

    @property
    def accepted(self) -> int:
        return self.states.get(JobState.FINISHED.value, 0)

    @property
    def cost_per_accepted(self) -> float:
        """All spend (failed and capped jobs, retries) over the jobs that finished; NaN
        when some job's cost is unknown."""
        if self.cost_unknown_jobs:
            return math.nan
        return self.cost_usd / self.accepted if self.accepted else math.inf


def summarize(results: list[JobResult]) -> JobsSummary:
    steps = [s for r in results for s in r.steps]
    later = [s for r in results for s in r.steps[1:]]
    ttfts = [s.ttft_ms for s in steps]
    costs = [r.usage.cost_usd for r in results if not r.usage.cost_unknown_steps]
    task_ttfts = [sum(s.ttft_ms for s in r.steps) for r in results if r.steps]
    return JobsSummary(
        jobs=len(results),
        states=dict(Counter(r.state.value for r in results)),
        steps=len(steps),
        prompt_tokens=sum(s.prompt_tokens for s in steps),
        cached_tokens=sum(s.cached_tokens for s in steps),
        later_steps=len(later),
        later_steps_cached=sum(1 for s in later if s.cached_tokens > 0),
        valid_steps=sum(1 for s in steps if s.valid),
        cost_usd=sum(costs),
        cost_unknown_jobs=len(results) - len(costs),
        cost_per_task_p50=percentile(costs, 50),
        cost_per_task_p95=percentile(costs, 95),
        ttft_p50_ms=percentile(ttfts, 50),
        ttft_p95_ms=percentile(ttfts, 95),
        ttft_p99_ms=percentile(ttfts, 99),
        task_ttft_p50_ms=percentile(task_ttfts, 50),
        task_ttft_p99_ms=percentile(task_ttfts, 99),
        retries=sum(s.retries for s in steps),
        approvals=sum(len(r.approvals) for r in results),
        steps_by_model=dict(Counter(s.model for s in steps if s.model)),
        escalations=dict(Counter(s.escalated for s in steps if s.escalated)),
        top_only_cost_usd=_top_only_cost(steps),
    )


def _top_only_cost(steps: list[StepRecord]) -> float | None:
    tokens: dict[str, int] = defaultdict(int)
    cost: dict[str, float] = defaultdict(float)
    for s in steps:
        if s.model and s.cost_usd is not None:
            tokens[s.model] += s.prompt_tokens + s.completion_tokens
            cost[s.model] += s.cost_usd
    rates = {m: cost[m] / tokens[m] for m in tokens if tokens[m]}
    if len(rates) < 2:
        return None
    top = max(rates.values())
    return sum((s.prompt_tokens + s.completion_tokens) * top for s in steps)


def _usd(v: float) -> str:
    return "-" if math.isinf(v) or math.isnan(v) else f"${v:.6f}"


def _cost_per_task(s: JobsSummary) -> str:
    """p50 / p95 over the priced jobs; says how many jobs' cost is unknown."""
    if not s.cost_unknown_jobs:
        return f"{_usd(s.cost_per_task_p50)} / {_usd(s.cost_per_task_p95)}"
    known = ("unknown" if s.cost_unknown_jobs == s.jobs
             else f"{_usd(s.cost_per_task_p50)} / {_usd(s.cost_per_task_p95)}")
    return f"{known} ({s.cost_unknown_jobs} of {s.jobs} jobs unpriced)"


def report_table(results: list[JobResult], *, title: str,
                 correct: dict[str, tuple[int, int]] | None = None) -> Table:
    """One column per profile: the figures `warmloop report` prints. ``correct``
    (``make demo``): per profile, the jobs whose whole task matched its ground truth
    and the jobs graded."""
    by_profile: dict[str, list[JobResult]] = defaultdict(list)
    for r in results:
        by_profile[r.profile].append(r)
    summaries = {p: summarize(rs) for p, rs in sorted(by_profile.items())}
    table = Table(title=title)
    table.add_column("figure")
    for p in summaries:
        table.add_column(p, justify="right")
    states = sorted({st for s in summaries.values() for st in s.states})
    rows: list[tuple[str, list[str]]] = [("jobs", [str(s.jobs) for s in summaries.values()])]
    rows += [(f"  {st}", [str(s.states.get(st, 0)) for s in summaries.values()])
             for st in states]
    rows += [
        ("model steps", [str(s.steps) for s in summaries.values()]),
        ("cost per task p50 / p95", [_cost_per_task(s) for s in summaries.values()]),
        ("cost per accepted outcome", ["unknown" if s.cost_unknown_jobs
                                       else _usd(s.cost_per_accepted)
                                       for s in summaries.values()]),
        ("prompt tokens from cache", [f"{s.cache_share:.1%}" for s in summaries.values()]),
        ("steps after a job's first with cached tokens",
         [f"{s.later_steps_cached}/{s.later_steps}" for s in summaries.values()]),
        ("tool-call success (valid / steps)",
         [f"{s.tool_call_success:.1%}" for s in summaries.values()]),
        ("TTFT per step p50 / p99 (ms)",
         [f"{s.ttft_p50_ms:.0f} / {s.ttft_p99_ms:.0f}" for s in summaries.values()]),
        ("TTFT per task p50 / p99 (ms)",
         [f"{s.task_ttft_p50_ms:.0f} / {s.task_ttft_p99_ms:.0f}" for s in summaries.values()]),
        ("step retries", [str(s.retries) for s in summaries.values()]),
        ("human approvals", [str(s.approvals) for s in summaries.values()]),
    ]
    if any(len(s.steps_by_model) > 1 for s in summaries.values()):
        rows.append(("steps by model", [", ".join(
            f"{m} {n / max(1, s.steps):.0%}" for m, n in sorted(s.steps_by_model.items()))
            for s in summaries.values()]))
        rows.append(("escalations", [", ".join(
            f"{k} {n}" for k, n in sorted(s.escalations.items())) or "0"
            for s in summaries.values()]))
        rows.append(("cost vs top model alone (est.)", [
            f"{s.cost_usd / s.top_only_cost_usd:.2f}x" if s.top_only_cost_usd else "-"
            for s in summaries.values()]))
    if correct is not None:
        rows.append(("correct (whole task vs ground truth)",
                     [_share(*correct.get(p, (0, 0))) for p in summaries]))
        # "accepted" above counts every FINISHED job; graded, the spend is over the
        # jobs that got the task right, which is what a weak model's bill really buys
        rows.append(("cost per correct outcome", [
            "unknown" if s.cost_unknown_jobs
            else _usd(s.cost_usd / good if (good := correct.get(p, (0, 0))[0]) else math.inf)
            for p, s in summaries.items()]))
    for name, values in rows:
        table.add_row(name, *values)
    return table


def tenant_table(results: list[JobResult], *, title: str) -> Table:
    """One row per tenant (of the jobs' ids): what a bill needs, jobs, tokens and
    dollars (a lower bound where some steps ran on engines that declare no price)."""
    from warmloop.workflows.tenants import tenant_of

    by_tenant: dict[str, list[JobResult]] = defaultdict(list)
    for r in results:
        by_tenant[tenant_of(r.job_id)].append(r)
    table = Table("tenant", "jobs", "model steps", "prompt tokens", "from cache",
                  "completion tokens", "cost", title=title)
    for tenant, rs in sorted(by_tenant.items()):
        prompt = sum(r.usage.prompt_tokens for r in rs)
        cached = sum(r.usage.cached_tokens for r in rs)
        unknown = sum(r.usage.cost_unknown_steps for r in rs)
        cost = _usd(sum(r.usage.cost_usd for r in rs))
        table.add_row(tenant, str(len(rs)), str(sum(r.usage.steps for r in rs)), str(prompt),
                      f"{cached / prompt:.1%}" if prompt else "-",
                      str(sum(r.usage.completion_tokens for r in rs)),
                      f"at least {cost} ({unknown} unpriced steps)" if unknown else cost)
    return table


def _share(good: int, graded: int) -> str:
    return f"{good}/{graded} ({good / graded:.0%})" if graded else "-"


STAGE_LABELS = {
    "routing_ms": "routing (route activity round trip)",
    "schedule_to_start_ms": "Temporal schedule-to-start",
    "worker_pickup_ms": "worker pickup (SDK, event loop)",
    "prompt_ms": "hold resume, transcript, prompt",
    "admission_ms": "batch admission wait",
    "ttft_ms": "engine queue + prefill (TTFT)",
    "decode_ms": "decode",
    "after_ms": "after the last token (S3, directory, holds)",
    "return_ms": "result back to the workflow",
}


def step_breakdown(steps: list[StepRecord]) -> dict[str, dict[str, float]]:
    """p50 / p95 / mean (ms) of each stage of the step path, over the steps that were
    timed, plus ``overhead_ms``: everything but the engine's queue, prefill and decode."""
    timed = [s.timing for s in steps if s.timing is not None]
    out: dict[str, dict[str, float]] = {}
    for stage in (*STEP_STAGES, "overhead_ms"):
        values = [float(getattr(t, stage)) for t in timed]
        out[stage] = {"p50": percentile(values, 50), "p95": percentile(values, 95),
                      "mean": sum(values) / len(values) if values else math.nan}
    return out


def breakdown_table(steps: list[StepRecord], *, title: str) -> Table:
    """Where the steps' time went, stage by stage (`warmloop report`, the benchmarks)."""
    figures = step_breakdown(steps)
    table = Table(title=f"{title} ({sum(s.timing is not None for s in steps)} timed steps)")
    for c, justify in (("stage", "left"), ("p50 ms", "right"), ("p95 ms", "right"),
                       ("mean ms", "right")):
        table.add_column(c, justify=justify)  # type: ignore[arg-type]
    for stage, f in figures.items():
        label = STAGE_LABELS.get(stage, "overhead: all but queue, prefill, decode")
        table.add_row(label, f"{f['p50']:.1f}", f"{f['p95']:.1f}", f"{f['mean']:.1f}")
    return table
