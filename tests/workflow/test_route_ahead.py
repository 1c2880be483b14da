"""A step's route is taken while its job waits on the tool before it (route ahead)."""

from __future__ import annotations

import uuid

from temporalio.testing import WorkflowEnvironment

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import TICKET, always, run_job, workers
from tests.workflow.test_replay import _replayer
from warmloop.workflows.agent_job import ROUTE_AHEAD_MAX_AGE, AgentJob
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


async def test_steps_after_a_tool_use_the_route_taken_during_it(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(SEARCH))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=4)
        history = await client.get_workflow_handle(res.job_id).fetch_history()
    assert res.state == JobState.LOOP_CAP
    # one route a step: the first at the step, the others ahead, during the tool; none
    # for a fifth step the step cap already forbids
    assert [(r.step, r.mark_in_flight) for r in fakes.routes] == [
        (1, True), (2, False), (3, False), (4, False)]
    # a step routed ahead is counted as load by its worker when it starts, not before
    assert [g.mark_in_flight for g in fakes.generate_requests] == [False, True, True, True]
    assert [s.route_reason for s in res.steps] == ["least_loaded", "sticky", "sticky", "sticky"]
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
    # step 2 follows a half-second timer: its route ahead is used; step 3 follows a
    # pause past the limit: routed ahead, then again when it starts
    assert [(r.step, r.mark_in_flight) for r in fakes.routes] == [
        (1, True), (2, False), (3, False), (3, True)]
    assert [g.mark_in_flight for g in fakes.generate_requests] == [False, True, False]
    await _replayer().replay_workflow(history)


async def test_a_pinned_job_routes_nothing_ahead(time_skipping_env: WorkflowEnvironment) -> None:
    fakes = FakeActivities(always(SEARCH))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=3, engine_id="fake0")
    assert res.state == JobState.LOOP_CAP
    assert fakes.routes == []
    assert [g.mark_in_flight for g in fakes.generate_requests] == [False, False, False]
