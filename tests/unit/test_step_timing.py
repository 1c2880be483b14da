"""The per-step time breakdown: the workflow's stages from the activity's timestamps,
and the report's summary of them."""

from __future__ import annotations

import math

from warmloop.workers.report import breakdown_table, step_breakdown
from warmloop.workflows.agent_job import _step_timing
from warmloop.workflows.contracts import GenerateResult, StepRecord, StepTiming


def gen(**timing: float) -> GenerateResult:
    return GenerateResult(engine_id="e0", prompt_tokens=10, cached_tokens=0,
                          completion_tokens=1, ttft_ms=30.0, latency_ms=40.0,
                          scheduled_at=100.010, returned_at=100.080,
                          timing=StepTiming(ttft_ms=30.0, decode_ms=10.0, **timing))


def test_the_workflow_adds_routing_and_return_from_the_activitys_timestamps() -> None:
    t = _step_timing(gen(schedule_to_start_ms=2.0, prompt_ms=0.5), step_start=100.000,
                     back=100.085)
    assert t is not None
    assert math.isclose(t.routing_ms, 10.0, abs_tol=1e-6)
    assert math.isclose(t.return_ms, 5.0, abs_tol=1e-6)
    assert t.schedule_to_start_ms == 2.0 and t.ttft_ms == 30.0
    assert math.isclose(t.overhead_ms, 10.0 + 2.0 + 0.5 + 5.0, abs_tol=1e-6)


def test_clocks_that_disagree_never_give_a_negative_stage() -> None:
    # the workflow's clock behind the worker's (another host): clamped at 0
    t = _step_timing(gen(), step_start=100.020, back=100.050)
    assert t is not None and t.routing_ms == 0.0 and t.return_ms == 0.0


def test_a_step_recorded_before_timing_existed_has_none() -> None:
    g = gen().model_copy(update={"timing": None})
    assert _step_timing(g, step_start=0.0, back=1.0) is None


def record(timing: StepTiming | None) -> StepRecord:
    return StepRecord(step=1, engine_id="e0", route_reason="sticky", tool=None, valid=True,
                      prompt_tokens=1, cached_tokens=0, completion_tokens=1, ttft_ms=1.0,
                      latency_ms=1.0, timing=timing)


def test_the_report_summarises_each_stage_over_the_timed_steps() -> None:
    steps = [record(StepTiming(routing_ms=float(i), ttft_ms=100.0)) for i in range(1, 11)]
    steps.append(record(None))  # untimed: left out, not counted as zeros
    b = step_breakdown(steps)
    assert b["routing_ms"]["p50"] == 5.0 and b["routing_ms"]["p95"] == 10.0
    assert b["routing_ms"]["mean"] == 5.5 and b["ttft_ms"]["p50"] == 100.0
    assert b["overhead_ms"]["p50"] == 5.0
    table = breakdown_table(steps, title="t")
    assert table.row_count == len(b) and "10 timed steps" in str(table.title)
