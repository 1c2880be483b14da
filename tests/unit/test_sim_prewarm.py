"""An approval's simulated pre-warm sends what the workflow's pre-warm sends: the
transcript as it stands and an empty tail, not the next step's whole prompt. On the
approval's opening that is the call without its result (not yet run); on its decision,
sent beside the approved call after the decision's records (``PATCH_DECISION_BESIDE_TOOL``),
a replayed job's transcript has its recorded result too."""

from __future__ import annotations

import pytest

from warmloop.sim import scenarios
from warmloop.sim.engine import Engine, Request
from warmloop.sim.fleet import PREWARM_TAIL_TOKENS
from warmloop.sim.run import simulate
from warmloop.sim.workload import JobSpec, StepSpec

PREFIX, TASK, TAIL = 1_472, 77, 24


def _prewarm_prompts(call_tokens: int | None) -> tuple[list[int], list[int]]:
    """The prompt tokens of one job's pre-warms and of its steps, in order."""
    job = JobSpec(job_id="j", family="synthetic-review", prefix_tokens=PREFIX,
                  task_tokens=TASK, tail_tokens=TAIL, steps=[
                      StepSpec(output_tokens=12, result_tokens=47,
                               pause_kind="approval:escalation", pause_s=4.0, approval=True,
                               viewed_after_s=1.0, call_tokens=call_tokens),
                      StepSpec(output_tokens=12, result_tokens=87)])
    prewarms: list[int] = []
    steps: list[int] = []
    real = Engine.submit

    def spy(self: Engine, req: Request) -> None:
        (steps if req.tag is not None else prewarms).append(req.prompt_tokens)
        real(self, req)

    mp = pytest.MonkeyPatch()
    mp.setattr(Engine, "submit", spy)
    try:
        simulate([job], scenarios.cpu_engines(16 * scenarios.MIB),
                 scenarios.PAUSES_POLICIES["release"], config=scenarios.CPU_FLEET)
    finally:
        mp.undo()
    return prewarms, steps


def test_an_openings_prewarm_leaves_out_the_result_and_the_decisions_sends_it() -> None:
    prewarms, steps = _prewarm_prompts(call_tokens=21)
    # viewed: before the tool runs; decided: beside it, its result in
    assert prewarms == [PREFIX + TASK + 21 + PREWARM_TAIL_TOKENS,
                        PREFIX + TASK + 47 + PREWARM_TAIL_TOKENS]
    # the next step sends the result and its tail
    assert steps == [PREFIX + TASK + TAIL, PREFIX + TASK + 47 + TAIL]


def test_a_workload_that_does_not_split_the_call_prewarms_the_next_prompt() -> None:
    prewarms, steps = _prewarm_prompts(call_tokens=None)
    assert prewarms == [PREFIX + TASK + 47 + TAIL] * 2
    assert steps[-1] == PREFIX + TASK + 47 + TAIL


def test_bench_pauses_escalations_say_their_call() -> None:
    approvals = [st for j in scenarios.pauses_jobs() for st in j.steps if st.approval]
    assert approvals
    sizes = scenarios.PAUSES_SIZES
    assert sizes.escalate_call is not None
    assert all(st.call_tokens == sizes.escalate_call < st.result_tokens == sizes.escalation
               for st in approvals)
