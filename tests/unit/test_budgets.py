"""The step's output budget: its tier, the tokens left, and the raise after a cut."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from warmloop.workflows.budgets import (
    JobLimits,
    OutputBudgets,
    StepKind,
    Usage,
    step_output_budget,
)


def test_a_cut_doubles_the_next_budget_up_to_after_cut_and_never_below_the_tier() -> None:
    b = OutputBudgets(plan=96, execute=160, reflect=128, after_cut=500)
    lim, use = JobLimits(), Usage()
    assert step_output_budget(b, StepKind.REFLECT, lim, use) == 128
    assert step_output_budget(b, StepKind.REFLECT, lim, use, cut_at=96) == 192
    assert step_output_budget(b, StepKind.REFLECT, lim, use, cut_at=400) == 500
    # a ceiling below the tier never lowers the tier
    low = OutputBudgets(execute=300, after_cut=200)
    assert step_output_budget(low, StepKind.EXECUTE, lim, use, cut_at=150) == 300


def test_the_raised_budget_still_stops_at_the_tokens_left() -> None:
    lim = JobLimits(max_total_tokens=1_000)
    use = Usage(prompt_tokens=900)
    assert step_output_budget(OutputBudgets(), StepKind.REFLECT, lim, use, cut_at=144) == 100


def test_after_cut_has_bounds() -> None:
    with pytest.raises(ValidationError, match="after_cut"):
        OutputBudgets(after_cut=8)
