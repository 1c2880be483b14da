"""Caps and tiered budgets: pure policy, called by the workflow before every step."""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel, ConfigDict, Field


class StepKind(StrEnum):
    """What the model is about to do; picks the step's output budget tier."""

    PLAN = "plan"
    """The first step: read the task and choose a first action."""
    EXECUTE = "execute"
    """After a successful tool result: the next action."""
    REFLECT = "reflect"
    """After an error (invalid call, failed tool, rejection): correct course."""


class OutputBudgets(BaseModel):
    """max_tokens per step kind: plan < execute, reflect smallest.

    Every tier must still fit the longest valid tool call of the profile, or calls
    are cut short into invalid JSON.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    plan: int = Field(default=144, ge=16, le=8192)
    execute: int = Field(default=160, ge=16, le=8192)
    reflect: int = Field(default=128, ge=16, le=8192)
    after_cut: int = Field(default=1024, ge=16, le=8192)
    """The most a step gets after the step before was cut at its budget with no valid
    call: each such cut doubles the next step's budget up to this. Without it a tier
    too small for a long call (a ``load_tools`` list, a long argument) repeats the same
    cut until the job ends in ``invalid_output``."""

    def for_kind(self, kind: StepKind) -> int:
        return {StepKind.PLAN: self.plan, StepKind.EXECUTE: self.execute,
                StepKind.REFLECT: self.reflect}[kind]


class JobLimits(BaseModel):
    """Per-job caps. None means no cap of that kind."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    max_steps: int = Field(default=8, ge=1, le=10_000)
    max_tool_calls: dict[str, int] = Field(default_factory=dict)
    """Per tool name; overrides the ToolSpec's max_calls."""
    max_wall_time_s: float | None = Field(default=None, gt=0)
    max_total_tokens: int | None = Field(default=None, ge=1)
    """Prompt plus completion tokens over all steps."""
    max_cost_usd: float | None = Field(default=None, gt=0)


class Usage(BaseModel):
    """What a job has spent so far; carried across continue-as-new."""

    steps: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    completion_tokens: int = 0
    cost_usd: float = 0.0
    """Dollars of the steps whose engine declares a price (see cost_unknown_steps)."""
    cost_unknown_steps: int = 0
    """Steps (and failed attempts of steps) served by an engine that declares no price:
    their cost is unknown, so cost_usd is a lower bound whenever this is above 0."""
    tool_calls: dict[str, int] = Field(default_factory=dict)

    @property
    def total_tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens


class CapHit(BaseModel):
    """Why a job must stop now; ``state`` is a JobState value."""

    state: str
    reason: str


def check_before_step(limits: JobLimits, usage: Usage, elapsed_s: float) -> CapHit | None:
    """The cap that stops the job before its next step, if any."""
    if usage.steps >= limits.max_steps:
        return CapHit(state="LOOP_CAP", reason=f"step cap of {limits.max_steps} reached")
    if limits.max_wall_time_s is not None and elapsed_s >= limits.max_wall_time_s:
        return CapHit(state="TIMED_OUT",
                      reason=f"wall time cap of {limits.max_wall_time_s:g}s reached")
    if limits.max_total_tokens is not None and usage.total_tokens >= limits.max_total_tokens:
        return CapHit(state="BUDGET_EXHAUSTED",
                      reason=f"token budget of {limits.max_total_tokens} spent "
                      f"({usage.total_tokens} used)")
    if limits.max_cost_usd is not None and usage.cost_unknown_steps:
        # Only a job pinned to an unpriced engine gets here: routing sends a capped job's
        # steps to priced engines only.
        return CapHit(state="INVALID_INPUT",
                      reason=f"cost cap of ${limits.max_cost_usd:g} cannot be enforced: "
                      f"{usage.cost_unknown_steps} step(s) ran on an engine that declares "
                      "no price; add \"price\" to WARMLOOP_ENGINES")
    if limits.max_cost_usd is not None and usage.cost_usd >= limits.max_cost_usd:
        return CapHit(state="BUDGET_EXHAUSTED",
                      reason=f"cost cap of ${limits.max_cost_usd:g} spent "
                      f"(${usage.cost_usd:.6f} used)")
    return None


def check_tool_cap(limits: JobLimits, usage: Usage, tool: str,
                   spec_max_calls: int | None) -> CapHit | None:
    """Whether one more call to ``tool`` exceeds its per-job cap."""
    cap = limits.max_tool_calls.get(tool, spec_max_calls)
    if cap is not None and usage.tool_calls.get(tool, 0) >= cap:
        return CapHit(state="LOOP_CAP", reason=f"{tool} called more than its cap of {cap}")
    return None


def step_output_budget(budgets: OutputBudgets, kind: StepKind, limits: JobLimits,
                       usage: Usage, *, cut_at: int | None = None) -> int:
    """max_tokens for the next step: its tier, never more than the tokens left.

    ``cut_at``: the budget the step before was cut at (finish reason ``length``, no
    valid call); this step gets twice that, up to ``budgets.after_cut``, and never
    less than its tier.
    """
    tier = budgets.for_kind(kind)
    if cut_at is not None:
        tier = max(tier, min(2 * cut_at, budgets.after_cut))
    if limits.max_total_tokens is None:
        return tier
    return max(1, min(tier, limits.max_total_tokens - usage.total_tokens))


def remaining_text(limits: JobLimits, usage: Usage, elapsed_s: float) -> str:
    """The budget line the model reads in the volatile tail of its prompt."""
    step = usage.steps + 1
    parts = [f"Step {step} of {limits.max_steps}; {limits.max_steps - step} steps remain "
             "after this one"]
    if limits.max_total_tokens is not None:
        parts.append(f"{max(0, limits.max_total_tokens - usage.total_tokens)} tokens left")
    if limits.max_cost_usd is not None:
        parts.append(f"${max(0.0, limits.max_cost_usd - usage.cost_usd):.4f} left")
    if limits.max_wall_time_s is not None:
        parts.append(f"{max(0.0, limits.max_wall_time_s - elapsed_s):.0f}s left")
    text = "; ".join(parts) + "."
    if step >= limits.max_steps:
        text += " Call finish now."
    return text
