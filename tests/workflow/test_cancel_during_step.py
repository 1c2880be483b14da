"""A cancel that arrives while a step's activity runs ends the job CANCELLED.

The activity's cancellation reaches the workflow as an ActivityError caused by
cancellation; it must not read as an engine failure (re-route), a tool failure (tell the
model) or an outage (ENGINE_UNAVAILABLE)."""

from __future__ import annotations

import asyncio

import pytest
from temporalio.testing import WorkflowEnvironment

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import always, workers
from tests.workflow.test_durable_loop import start
from warmloop.workflows.contracts import JobState

SEARCH = reply("search_kb", '{"topic": "crash"}')


# On a real dev server: the time-skipping one stops skipping time for the whole session
# while a cancelled activity it lost track of is still counted as running.
# route_step is a local activity: it holds the workflow task, so a cancel is seen when it
# returns, as generate is being scheduled: the generate case.
@pytest.mark.parametrize("activity", ["generate", "run_tool"])
async def test_cancel_during_a_step_ends_cancelled_and_schedules_nothing_more(
    dev_server_env: WorkflowEnvironment, activity: str,
) -> None:
    fakes = FakeActivities(always(SEARCH), engines=["fake0", "fake1"])
    # the first step runs whole, so the cancel lands on a job with a transcript
    fakes.hang[activity] = 2
    async with workers(dev_server_env, fakes) as client:
        handle = await start(client, max_steps=6)
        await asyncio.wait_for(fakes.hanging.wait(), timeout=30)
        generated, tools, routes = (len(fakes.generate_requests), len(fakes.tool_requests),
                                    len(fakes.routes))
        await handle.cancel()
        res = await asyncio.wait_for(handle.result(), timeout=90)
    assert res.state == JobState.CANCELLED, (res.state, res.reason)
    # nothing after the cancel: no re-route, no second try, no next step
    assert (len(fakes.generate_requests), len(fakes.tool_requests), len(fakes.routes)) == (
        generated, tools, routes)
    assert fakes.stored and fakes.stored[-1].transcript == res.transcript
    assert res.transcript_key
