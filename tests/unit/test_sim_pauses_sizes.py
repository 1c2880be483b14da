"""bench-pauses as the engines saw it: each call's own size (``sized_by_prompts``), the
review family's twelfth shared block (``PausesSizes.task_opening``) and a reviewer that
notices an approval late (``FleetConfig.approval_notice_s``). Each moves where a
prompt's last partial block falls or when an approval's pre-warm comes, which decide
what a pre-warm or a resumed step recomputes."""

from __future__ import annotations

import dataclasses

import pytest

from warmloop.sim import scenarios
from warmloop.sim.engine import Engine, Request
from warmloop.sim.run import simulate
from warmloop.sim.workload import JobSpec, StepSpec


def _run(jobs: list[JobSpec], *, notice: tuple[float, float] = (0.0, 0.0)
         ) -> list[tuple[str, float, int, int]]:
    """Every agent call the fleet sends: (step or prewarm, when it is sent, prompt
    tokens, cached tokens), in order sent."""
    calls: list[tuple[str, float, int, int]] = []
    real = Engine.submit

    def spy(self: Engine, req: Request) -> None:
        kind = "step" if req.tag is not None else "prewarm"
        sent = self.clock.now
        done = req.on_done

        def record(r: Request) -> None:
            calls.append((kind, sent, r.prompt_tokens, r.cached_tokens))
            if done is not None:
                done(r)
        req.on_done = record
        real(self, req)

    mp = pytest.MonkeyPatch()
    mp.setattr(Engine, "submit", spy)
    try:
        simulate(jobs, scenarios.cpu_engines(16 * scenarios.MIB),
                 scenarios.PAUSES_POLICIES["release"],
                 config=dataclasses.replace(scenarios.CPU_FLEET, approval_notice_s=notice))
    finally:
        mp.undo()
    return sorted(calls, key=lambda c: c[1])


def test_each_step_sends_the_prompt_its_run_measured() -> None:
    jobs = scenarios.pauses_jobs(n_jobs=2)
    measured = {"p000": [1_606, 1_638, 1_721, 1_753, 1_850, 1_887],
                "p001": [1_550, 1_632, 1_714, 1_801, 1_902, 1_998]}
    sized = scenarios.sized_by_prompts(jobs, measured)
    for job in sized:
        steps = [p for kind, _, p, _ in _run([job]) if kind == "step"]
        assert steps == measured[job.job_id]
    # the mean sizes put them elsewhere
    assert [p for kind, _, p, _ in _run([jobs[1]]) if kind == "step"] != measured["p001"]


def test_prompt_sizes_that_do_not_fit_the_plan_are_refused() -> None:
    jobs = scenarios.pauses_jobs(n_jobs=1)  # p000: a review job, its first step escalates
    with pytest.raises(ValueError, match="5 prompt sizes for 6 steps"):
        scenarios.sized_by_prompts(jobs, {"p000": [1_606] * 5})
    with pytest.raises(ValueError, match="shorter than its prefix and tail"):
        scenarios.sized_by_prompts(jobs, {"p000": [100] * 6})
    with pytest.raises(ValueError, match="less than the step's call"):
        scenarios.sized_by_prompts(jobs, {"p000": [1_606, 1_610, 1_700, 1_800, 1_900, 2_000]})
    # a job the sizes do not name keeps its planned ones
    assert scenarios.sized_by_prompts(jobs, {"p999": [1] * 6}) == jobs


def test_a_review_job_finds_the_twelve_blocks_another_left() -> None:
    """The review prefix fills 11 blocks and the 12th ends 8 tokens into the task, the
    same in every job: a second review job's first step finds 1,536 tokens, as the
    bench's did (with the opening left out, 1,408)."""
    def first_steps(sizes: scenarios.PausesSizes) -> list[int]:
        jobs = [j for j in scenarios.pauses_jobs(sizes=sizes) if j.family == "synthetic-review"]
        jobs = [dataclasses.replace(j, arrival_s=k * 0.5) for k, j in enumerate(jobs[:2])]
        return [cached for kind, _, p, cached in _run(jobs) if kind == "step"
                and p == jobs[0].prefix_tokens + jobs[0].task_tokens + jobs[0].tail_tokens]

    assert first_steps(scenarios.PAUSES_SIZES) == [0, 1_536]
    assert first_steps(dataclasses.replace(scenarios.PAUSES_SIZES, task_opening=0)) == [0, 1_408]


def _approval_job() -> JobSpec:
    return JobSpec(job_id="j", family="synthetic-review", prefix_tokens=1_536, task_tokens=49,
                   tail_tokens=21, steps=[
                       StepSpec(output_tokens=12, result_tokens=33,
                                pause_kind="approval:escalation", pause_s=10.0,
                                approval=True, viewed_after_s=5.0, call_tokens=22),
                       StepSpec(output_tokens=12, result_tokens=85)])


def test_a_late_reviewer_moves_the_view_the_decision_and_the_next_step() -> None:
    on_time = _run([_approval_job()])
    late = _run([_approval_job()], notice=(1.5, 1.5))
    assert [c[0] for c in on_time] == [c[0] for c in late] == [
        "step", "prewarm", "prewarm", "step"]
    assert late[0][1] == pytest.approx(on_time[0][1])
    for a, b in zip(on_time[1:], late[1:], strict=True):
        assert b[1] - a[1] == pytest.approx(1.5, abs=1e-6)


def test_the_notice_is_drawn_per_approval_the_same_in_every_run() -> None:
    def sent(notice: tuple[float, float]) -> list[float]:
        return [c[1] for c in _run([_approval_job()], notice=notice)]

    drawn = sent((0.33, 2.35))
    assert drawn == sent((0.33, 2.35))  # seeded by the job and step
    on_time = sent((0.0, 0.0))
    lag = drawn[1] - on_time[1]
    assert 0.33 <= lag <= 2.35 and lag not in (0.33, 2.35)


@pytest.mark.parametrize("notice", [(-0.1, 1.0), (2.0, 1.0)])
def test_a_lateness_range_out_of_order_is_refused(notice: tuple[float, float]) -> None:
    with pytest.raises(ValueError, match="0 <= low <= high"):
        dataclasses.replace(scenarios.CPU_FLEET, approval_notice_s=notice)
