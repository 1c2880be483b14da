"""A step's route taken before the step: by the worker of the step before, as that step
ends (``GenerateRequest.route_next``). Histories from before that routed ahead with an
activity during the job's pause; they still replay (histories/agent_job_route_ahead*)."""

from __future__ import annotations

import json
import uuid

from temporalio.client import WorkflowHistory
from temporalio.testing import WorkflowEnvironment

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import TICKET, always, run_job, workers
from tests.workflow.test_replay import HISTORIES, _replayer
from warmloop.workflows.agent_job import (
    PATCH_ROUTE_AHEAD,
    PATCH_ROUTE_NEXT_IN_WORKER,
    ROUTE_AHEAD_MAX_AGE,
    AgentJob,
)
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    FunctionCall,
    JobInput,
    JobState,
    ReplayScript,
    ReplayStep,
    ToolCall,
)

SEARCH = reply("search_kb", '{"topic": "crash"}')


def _patches(history: WorkflowHistory) -> list[str]:
    """The patch ids a history recorded, in order."""
    return [json.loads(payload.data)["id"]
            for event in history.events
            if event.HasField("marker_recorded_event_attributes")
            and "patch-data" in event.marker_recorded_event_attributes.details
            for payload in event.marker_recorded_event_attributes.details["patch-data"].payloads]


def _activities(history: WorkflowHistory) -> list[str]:
    return [e.activity_task_scheduled_event_attributes.activity_type.name
            for e in history.events if e.HasField("activity_task_scheduled_event_attributes")]


async def test_each_step_after_the_first_uses_the_route_its_previous_worker_took(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(SEARCH))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=4)
        history = await client.get_workflow_handle(res.job_id).fetch_history()
    assert res.state == JobState.LOOP_CAP
    # step 1 routes itself and counts itself as load; steps 2-4 are routed by the worker
    # of the step before (not counted there: a step waiting on its tool is not load);
    # none for a fifth step the step cap forbids
    assert [(r.step, r.mark_in_flight) for r in fakes.routes] == [
        (1, True), (2, False), (3, False), (4, False)]
    assert [r.last_engine for r in fakes.routes[1:]] == fakes.served_by[:3]
    # ... so their own workers count them when they start
    assert [g.mark_in_flight for g in fakes.generate_requests] == [False, True, True, True]
    assert [g.route_next is not None for g in fakes.generate_requests] == [True] * 3 + [False]
    assert [s.route_reason for s in res.steps] == ["least_loaded", "sticky", "sticky", "sticky"]
    # no routing activity beside the tools
    assert "route_step" not in _activities(history)
    patches = _patches(history)
    assert PATCH_ROUTE_NEXT_IN_WORKER in patches and PATCH_ROUTE_AHEAD not in patches
    await _replayer().replay_workflow(history)


async def test_a_route_older_than_the_limit_is_taken_again_at_the_step(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    pauses = [0.5, ROUTE_AHEAD_MAX_AGE.total_seconds() + 60, 0.0]
    steps = [ReplayStep(call=ToolCall(id=f"call-{i}", function=FunctionCall(
                 name="search_kb", arguments='{"topic": "crash"}')),
                        result=f"article {i}", pause_s=p, output_tokens=8,
                        pause_kind="tool:search_kb" if p else "")
             for i, p in enumerate(pauses)]
    fakes = FakeActivities(always(SEARCH))
    async with workers(time_skipping_env, fakes) as client:
        job = JobInput(profile="ticket-triage", task=TICKET,
                       replay=ReplayScript(steps=steps))
        res = await client.execute_workflow(AgentJob.run, job, id=f"ahead-{uuid.uuid4().hex[:8]}",
                                            task_queue=AGENT_TASK_QUEUE)
        history = await client.get_workflow_handle(res.job_id).fetch_history()
    assert res.state == JobState.FINISHED, res.reason
    # step 2 follows a half-second timer: the route its previous worker took is used;
    # step 3 follows a pause past the limit: routed by the worker, then again at the step;
    # step 3's worker routes a step 4 the replay's script (three calls) never takes
    assert [(r.step, r.mark_in_flight) for r in fakes.routes] == [
        (1, True), (2, False), (3, False), (3, True), (4, False)]
    assert [g.mark_in_flight for g in fakes.generate_requests] == [False, True, False]
    await _replayer().replay_workflow(history)


async def test_histories_that_routed_ahead_still_replay() -> None:
    for name in ("agent_job_route_ahead.json", "agent_job_route_ahead_stale.json"):
        history = WorkflowHistory.from_json("recorded", (HISTORIES / name).read_text())
        assert PATCH_ROUTE_AHEAD in _patches(history)
        assert "route_step" in _activities(history)
        await _replayer().replay_workflow(history)


async def test_a_pinned_job_routes_nothing(time_skipping_env: WorkflowEnvironment) -> None:
    fakes = FakeActivities(always(SEARCH))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=3, engine_id="fake0")
    assert fakes.routes == []
    assert [g.route_next for g in fakes.generate_requests] == [None] * 3
    assert len(res.steps) == 3
