"""Route ahead (a step's route taken while its job waited on the tool before it) is off
for new jobs: they route each step at the step. Histories that routed ahead still replay
(histories/agent_job_route_ahead*.json, recorded before it was turned off)."""

from __future__ import annotations

import json

from temporalio.client import WorkflowHistory
from temporalio.testing import WorkflowEnvironment

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import always, run_job, workers
from tests.workflow.test_replay import HISTORIES, _replayer
from warmloop.workflows.agent_job import PATCH_ROUTE_AHEAD, PATCH_ROUTE_AT_STEP

SEARCH = reply("search_kb", '{"topic": "crash"}')


def _patches(history: WorkflowHistory) -> list[str]:
    """The patch ids a history recorded, in order."""
    return [json.loads(payload.data)["id"]
            for event in history.events
            if event.HasField("marker_recorded_event_attributes")
            and "patch-data" in event.marker_recorded_event_attributes.details
            for payload in event.marker_recorded_event_attributes.details["patch-data"].payloads]


async def test_a_new_job_routes_each_step_at_the_step(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(SEARCH))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=4)
        history = await client.get_workflow_handle(res.job_id).fetch_history()
    # one route a step, each at the step and counting it as load there; none ahead
    assert [(r.step, r.mark_in_flight) for r in fakes.routes] == [
        (1, True), (2, True), (3, True), (4, True)]
    assert [g.mark_in_flight for g in fakes.generate_requests] == [False] * 4
    assert [s.route_reason for s in res.steps] == ["least_loaded", "sticky", "sticky", "sticky"]
    patches = _patches(history)
    assert PATCH_ROUTE_AT_STEP in patches and PATCH_ROUTE_AHEAD not in patches
    await _replayer().replay_workflow(history)


async def test_histories_that_routed_ahead_still_replay() -> None:
    for name in ("agent_job_route_ahead.json", "agent_job_route_ahead_stale.json"):
        history = WorkflowHistory.from_json("recorded", (HISTORIES / name).read_text())
        assert PATCH_ROUTE_AHEAD in _patches(history)
        await _replayer().replay_workflow(history)


async def test_a_pinned_job_routes_nothing(time_skipping_env: WorkflowEnvironment) -> None:
    fakes = FakeActivities(always(SEARCH))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=3, engine_id="fake0")
    assert fakes.routes == []
    assert [g.mark_in_flight for g in fakes.generate_requests] == [False, False, False]
    assert len(res.steps) == 3
