"""A cancel that arrives while a step's activity runs ends the job CANCELLED.

The activity's cancellation reaches the workflow as an ActivityError caused by
cancellation; it must not read as an engine failure (re-route), a tool failure (tell the
model) or an outage (ENGINE_UNAVAILABLE)."""

from __future__ import annotations

import asyncio

import pytest
from temporalio import activity
from temporalio.client import WorkflowFailureError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.polling import eventually
from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import always, workers
from tests.workflow.test_durable_loop import start
from tests.workflow.test_replay import _record, _replayer
from warmloop.workers.temporal_plugin import sandbox_runner
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobState, StoreTranscriptRequest

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


async def test_a_cancel_that_meets_the_end_of_a_job_keeps_its_outcome(
    dev_server_env: WorkflowEnvironment,
) -> None:
    """A cancel that reaches a job in the same workflow task as the completion of its
    last activity (storing its transcript as it ends) is raised in the workflow as a bare
    cancellation (the SDK's RAISE_ON_CANCELLING_COMPLETED_ACTIVITY), not an activity
    error. The job had ended by then: it must keep its own outcome and transcript, not
    end CANCELED in Temporal with no result (a batch's cancel racing its jobs' ends did
    this in CI). The two events are made to land in one workflow task by stopping the
    job's workflow worker while its store runs."""
    fakes = FakeActivities(always(reply("finish",
                                        '{"resolution": "resolved", "priority": "high"}')))
    storing, release = asyncio.Event(), asyncio.Event()
    plain_store = fakes.store_transcript

    async def gated_store(req: StoreTranscriptRequest) -> str:
        storing.set()
        await release.wait()
        return await plain_store(req)

    fakes.store_transcript = activity.defn(name="store_transcript")(gated_store)  # type: ignore[method-assign]
    async with workers(dev_server_env, fakes, workflows=False) as client:
        def workflow_worker() -> Worker:  # its local activities too (route_step)
            return Worker(client, task_queue=AGENT_TASK_QUEUE, workflows=[AgentJob],
                          workflow_runner=sandbox_runner(), no_remote_activities=True,
                          activities=[fakes.route_step, fakes.pick_engine,
                                      fakes.record_pause, fakes.engine_alive])

        first = workflow_worker()
        async with first:
            handle = await start(client, max_steps=6)
            await asyncio.wait_for(storing.wait(), timeout=30)
        # no workflow worker: the cancel and the store's completion wait in one task
        await handle.cancel()
        release.set()

        async def both_recorded() -> bool | None:
            kinds = [e.WhichOneof("attributes")
                     for e in (await handle.fetch_history()).events]
            cancel = "workflow_execution_cancel_requested_event_attributes"
            return (cancel in kinds and "activity_task_completed_event_attributes"
                    in kinds[kinds.index(cancel):]) or None

        await eventually(both_recorded, attempts=300)
        async with workflow_worker():
            try:
                res = await asyncio.wait_for(handle.result(), timeout=90)
            except WorkflowFailureError as e:
                pytest.fail(f"the job ended without its result: {e.cause!r}")
            history = await handle.fetch_history()
    assert res.state == JobState.FINISHED, (res.state, res.reason)
    assert res.transcript_key and fakes.stored and fakes.stored[-1].transcript == res.transcript
    await _replayer().replay_workflow(history)
    _record("agent_job_cancel_meets_its_end.json", history)
