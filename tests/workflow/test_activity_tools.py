"""Activity tools: the job schedules the user's own activity on the user's task queue,
with the call's arguments, ids and idempotency key; a missing worker or a failing
activity is a tool result the model reads, never a stuck or crashed job."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any, Literal

import pytest
from pydantic import BaseModel, ConfigDict
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import workers
from warmloop import ActivityRunner, Profile, ToolRetry, ToolSpec
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput, JobResult, JobState
from warmloop.workflows.profiles import REGISTRY
from warmloop.workflows.tool_results import activity_tool_result

USER_QUEUE = "acme-tools"


class Task(BaseModel):
    order_id: str


class RefundArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    order_id: Literal["O1", "O2"]


class DoneArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    answer: Literal["refunded", "failed"]


def _profile(name: str, activity_name: str, pickup_s: float = 60.0,
             queue: str = USER_QUEUE, **identity: Any) -> Profile:
    return Profile(
        name=name, system_prompt="You refund orders.", task_model=Task, task_id_field="order_id",
        tools=(ToolSpec("refund", "Refund an order.", RefundArgs, side_effect=True,
                        retry=ToolRetry(max_attempts=2, initial_interval_s=0.1), **identity,
                        runner=ActivityRunner(activity=activity_name, task_queue=queue,
                                              pickup_timeout_s=pickup_s)),
               ToolSpec("finish", "Done.", DoneArgs, finishes_job=True)),
        max_tool_output_chars=300)


PROFILES = [_profile("acme-refunds", "acme_refund"), _profile("acme-flaky", "acme_flaky"),
            _profile("acme-unserved", "acme_refund", pickup_s=5, queue="acme-nobody"),
            _profile("acme-once", "acme_refund", effect_key=("order_id",),
                     effect_scope="tenant")]
CALLS: list[dict[str, Any]] = []


@activity.defn(name="acme_refund")
async def acme_refund(call: dict[str, Any]) -> dict[str, Any]:
    CALLS.append(call)
    return {"refunded": call["arguments"]["order_id"], "z_padding": "n" * 1000}


@activity.defn(name="acme_flaky")
async def acme_flaky(call: dict[str, Any]) -> str:
    CALLS.append(call)
    raise ApplicationError("payment provider down")


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    for p in PROFILES:
        REGISTRY.add(p, source="test")
    CALLS.clear()
    yield
    for p in PROFILES:
        REGISTRY.remove(p.name)


def _script() -> FakeActivities:
    steps = {1: reply("refund", '{"order_id": "O2"}')}
    done = reply("finish", '{"answer": "refunded"}')
    return FakeActivities(lambda req: steps.get(req.step, done))


async def _run(env: WorkflowEnvironment, fakes: FakeActivities, profile: str) -> JobResult:
    async with workers(env, fakes) as client, Worker(
            client, task_queue=USER_QUEUE, activities=[acme_refund, acme_flaky]):
        return await client.execute_workflow(
            AgentJob.run, JobInput(profile=profile, task={"order_id": "O2"}),
            id=f"job-{uuid.uuid4().hex[:8]}", task_queue=AGENT_TASK_QUEUE)


async def test_an_activity_tool_runs_on_the_users_queue(
        time_skipping_env: WorkflowEnvironment) -> None:
    fakes = _script()
    res = await _run(time_skipping_env, fakes, "acme-refunds")
    assert res.state == JobState.FINISHED
    assert fakes.tool_requests == []  # warmloop's run_tool never saw it
    assert len(CALLS) == 1
    call = CALLS[0]
    assert call["arguments"] == {"order_id": "O2"} and call["task_id"] == "O2"
    assert call["idempotency_key"] == f"{res.job_id}:1:refund" and call["step"] == 1
    answer = res.transcript[1]
    assert answer.role == "tool" and '"refunded": "O2"' in answer.content
    assert "[cut: " in answer.content and len(answer.content) < 400  # the profile's cap
    assert [p.kind for p in fakes.pauses] == ["tool:refund"]


async def test_an_activity_tools_tenant_scoped_effect_has_one_key_in_every_job(
        time_skipping_env: WorkflowEnvironment) -> None:
    """``effect_scope="tenant"``: the user's activity gets the same idempotency key in
    two jobs refunding the same order (it dedupes the refund by it); a job-scoped
    identity's key names the job."""
    first = await _run(time_skipping_env, _script(), "acme-once")
    second = await _run(time_skipping_env, _script(), "acme-once")
    assert first.state == second.state == JobState.FINISHED
    keys = [c["idempotency_key"] for c in CALLS]
    assert len(keys) == 2 and keys[0] == keys[1]
    assert keys[0].startswith("default/*:refund:") and first.job_id not in keys[0]


async def test_a_pause_that_cannot_be_recorded_does_not_fail_the_job(
        time_skipping_env: WorkflowEnvironment) -> None:
    """The pause statistics are best effort. A local activity's last failure can come back
    as its ApplicationError itself, not wrapped in an ActivityError: caught all the same."""
    fakes = _script()
    fakes.pause_stats_fail = True
    res = await _run(time_skipping_env, fakes, "acme-refunds")
    assert res.state == JobState.FINISHED
    assert [p.kind for p in fakes.pauses] == ["tool:refund"] * 2  # both attempts failed


async def test_a_failing_activity_tool_is_read_by_the_model(
        time_skipping_env: WorkflowEnvironment) -> None:
    res = await _run(time_skipping_env, _script(), "acme-flaky")
    assert res.state == JobState.FINISHED
    assert len(CALLS) == 2  # its retry policy: two attempts
    assert "tool refund failed" in res.transcript[1].content


async def test_an_activity_tool_no_worker_serves_is_read_by_the_model(
        time_skipping_env: WorkflowEnvironment) -> None:
    res = await _run(time_skipping_env, _script(), "acme-unserved")
    assert res.state == JobState.FINISHED
    assert ("tool refund is unavailable: no worker took it from task queue acme-nobody"
            in res.transcript[1].content)


@pytest.mark.parametrize(
    ("raw", "ok", "output"),
    [("plain", True, "plain"), ({"ok": False, "output": "no such order"}, False, "no such order"),
     ({"b": 1, "a": [2]}, True, '{"a": [2], "b": 1}'), (None, True, "null"),
     # a boolean ok always says whether the call worked
     ({"ok": False}, False, "{}"), ({"ok": False, "reason": "late"}, False, '{"reason": "late"}'),
     ({"ok": True, "output": {"id": 1}}, True, '{"id": 1}')],
)
def test_what_an_activity_tool_returns_becomes_what_the_model_reads(
        raw: Any, ok: bool, output: str) -> None:
    r = activity_tool_result(raw)
    assert (r.ok, r.output) == (ok, output)
