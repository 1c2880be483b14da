"""bench-pauses' scripted workload: every policy and repeat replays the simulator's own
plans (the same calls, tool pauses and reviewer timings), so the bench's policies differ
only in what they hold, and the simulator is checked against the very jobs it ran."""

from __future__ import annotations

import argparse
import json
from collections import Counter
from datetime import UTC, datetime, timedelta

from bench.pauses import PolicyRun, planned_reviews, plans, script
from bench.synthetic_profiles import SYNTHETIC_PROFILES
from warmloop.sim.scenarios import pauses_jobs, plan_pauses
from warmloop.workflows.contracts import PendingApproval


def args(**kw: object) -> argparse.Namespace:
    base: dict[str, object] = {
        "seed": 11, "jobs": 16, "steps": 6, "review_every": 4, "gap_s": 1.5,
        "pause_median_s": 3.0, "long_share": 0.1, "approval_min_s": 10.0,
        "approval_max_s": 20.0}
    return argparse.Namespace(**{**base, **kw})


def test_the_bench_replays_the_simulators_plans() -> None:
    ours = plans(args())
    assert ours == pauses_jobs()  # the simulator's bench-pauses scenario, unchanged
    assert plans(args(seed=12)) != ours


def test_a_plan_becomes_recorded_steps_the_profile_accepts() -> None:
    profiles = {p.name: p for p in SYNTHETIC_PROFILES}
    approvals = 0
    for i, plan in enumerate(plans(args())):
        case = f"S{i:04d}"
        s = script(plan, case)
        assert s == script(plan, case), "a script must not depend on the run"
        assert s.ask_approvals and len(s.steps) == len(plan.steps) == 6
        profile = profiles[plan.family]
        for st, rec in zip(plan.steps, s.steps, strict=True):
            name, arguments = rec.call.function.name, json.loads(rec.call.function.arguments)
            spec, parsed = profile.validate_call(name, rec.call.function.arguments)
            rule = profile.approval_for(spec.name, parsed)
            assert rec.pause_kind == st.pause_kind
            if st.approval:
                # the reviewer's wait is the pause: no timer after it
                approvals += 1
                assert name == "escalate" and rule is not None and rec.pause_s == 0.0
                assert st.pause_kind == f"approval:{rule.kind}"
            else:
                assert name == "lookup" and rule is None and rec.pause_s == st.pause_s
                assert arguments["key"] in rec.result
        assert s.steps[-1].pause_kind == "" and s.steps[-1].pause_s == 0.0
    assert 6 <= approvals <= 14  # about half of the four review jobs' first five steps


def test_the_reviewer_opens_and_decides_each_escalation_when_its_plan_says() -> None:
    plan = next(p for p in plans(args()) if any(st.approval for st in p.steps))
    k = next(k for k, st in enumerate(plan.steps, start=1) if st.approval)
    schedule = planned_reviews({"wf": plan})
    now = datetime.now(UTC)
    pending = PendingApproval(approval_id=f"escalation-{k}", job_id="wf", kind="escalation",
                              tool="escalate", arguments={}, step=k, approvers=["reviewer"],
                              requested_at=now, deadline=now + timedelta(hours=1))
    view_s, decide_s = schedule("wf", pending)
    assert decide_s == plan.steps[k - 1].pause_s
    assert view_s == decide_s - 5.0 and 10.0 <= decide_s <= 20.0


def test_every_policy_starts_from_pauses_the_hold_model_has_learned() -> None:
    jobs = plans(args())
    once = [(j.family, st.pause_kind, st.pause_s) for j in jobs for st in j.steps
            if st.pause_kind]
    learned = plan_pauses(jobs)
    # whole copies of the plans' pauses, enough that no kind is decided on its prior
    assert len(learned) % len(once) == 0 and learned[: len(once)] == once
    counts = Counter((family, kind) for family, kind, _ in learned)
    assert set(counts) == {("synthetic-support", "tool:lookup"),
                           ("synthetic-review", "tool:lookup"),
                           ("synthetic-review", "approval:escalation")}
    copies, fewest = len(learned) // len(once), min(counts.values())
    assert fewest >= 20 and fewest // copies * (copies - 1) < 20  # no more copies than that


def test_a_repeat_says_whether_the_families_shared_an_engine() -> None:
    def job(family: str, *engines: str) -> dict[str, object]:
        return {"job": "p", "family": family,
                "steps": [{"step": i + 1, "engine": e} for i, e in enumerate(engines)]}

    apart = PolicyRun("hold", jobs=[job("review", "e1", "e1"), job("support", "e0", "e0", "e0"),
                                    job("support", "e0", "e1")])
    assert apart.family_engines() == {"review": {"e1": 2}, "support": {"e0": 4, "e1": 1}}
    assert apart.families_sharing_an_engine() == 0
    # run 11's outlier: the review family on e0 and most of support beside it
    together = PolicyRun("warmloop", jobs=[job("review", "e0", "e0"),
                                           job("support", "e0", "e0", "e1")])
    assert together.families_sharing_an_engine() == 2
