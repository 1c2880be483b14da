"""AgentJob on Temporal's time-skipping test server with scripted activities."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflow.fakes import FakeActivities, reply
from warmloop.workers.temporal_plugin import sandbox_runner
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    GenerateRequest,
    GenerateResult,
    JobInput,
    JobResult,
    JobState,
    engine_task_queue,
)

TICKET = {"ticket_id": "T1001", "customer_id": "C100", "subject": "crash", "body": "it crashes"}


@asynccontextmanager
async def workers(env: WorkflowEnvironment, fakes: FakeActivities,
                  serving: list[str] | None = None, *,
                  workflows: bool = True) -> AsyncIterator[Client]:
    """An agent worker plus one engine worker per id in ``serving`` (default: all).
    ``workflows=False``: the agent worker runs the activities only (the test runs the
    workflows on a worker of its own, to stop and start it)."""
    client = env.client
    agent = Worker(client, task_queue=AGENT_TASK_QUEUE, workflow_runner=sandbox_runner(),
                   workflows=[AgentJob] if workflows else [],
                   activities=[fakes.route_step, fakes.pick_engine, fakes.record_pause,
                               fakes.engine_alive,
                               fakes.run_tool,
                               fakes.store_transcript, fakes.load_transcript])
    engine_workers = [
        Worker(client, task_queue=engine_task_queue(e), activities=[fakes.generate,
                                                                   fakes.prewarm])
        for e in (fakes.engines if serving is None else serving)
    ]
    fakes.alive = set(fakes.engines if serving is None else serving)
    async with agent:
        for w in engine_workers:
            await w.__aenter__()
        try:
            yield client
        finally:
            for w in engine_workers:
                await w.__aexit__(None, None, None)


async def run_job(client: Client, **kw: object) -> JobResult:
    job = JobInput(profile=kw.pop("profile", "ticket-triage"), task=kw.pop("task", TICKET),  # type: ignore[arg-type]
                   **kw)  # type: ignore[arg-type]
    return await client.execute_workflow(AgentJob.run, job, id=f"job-{uuid.uuid4().hex[:8]}",
                                         task_queue=AGENT_TASK_QUEUE)


def always(result: GenerateResult) -> Callable[[GenerateRequest], GenerateResult]:
    return lambda req: result


async def test_step_cap_ends_in_loop_cap_with_partial_result(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(reply("search_kb", '{"topic": "crash"}')))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=4)
    assert res.state == JobState.LOOP_CAP
    assert len(res.steps) == 4 and all(s.valid for s in res.steps)
    assert len(fakes.tool_requests) == 4
    # transcript: one call and one result per step, stored in S3 by key
    assert len(res.transcript) == 8
    assert res.transcript_key == f"transcripts/{res.job_id}.json"
    assert fakes.stored[0].transcript == res.transcript
    # routed every step; with nothing to tell engines apart the job stays where it is
    assert [r.step for r in fakes.routes] == [1, 2, 3, 4]
    assert [r.last_engine for r in fakes.routes] == [None, "fake0", "fake0", "fake0"]
    assert [s.route_reason for s in res.steps] == ["least_loaded", "sticky", "sticky", "sticky"]
    # the cap's step asks for no hold: no step follows it, whatever its call
    assert [r.hold_policy for r in fakes.generate_requests] == ["cost_model"] * 3 + ["never"]


async def test_finish_tool_ends_the_job_with_its_arguments(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    script = iter([reply("lookup_customer", '{"customer_id": "C100"}'),
                   reply("finish", '{"resolution": "resolved", "priority": "high"}')])
    fakes = FakeActivities(lambda req: next(script))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client)
    assert res.state == JobState.FINISHED
    assert res.final == {"resolution": "resolved", "priority": "high"}
    assert [t.name for t in fakes.tool_requests] == ["lookup_customer"]


async def test_prompts_are_append_only_across_steps(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(reply("search_kb", '{"topic": "login"}')))
    async with workers(time_skipping_env, fakes) as client:
        await run_job(client, max_steps=3)
    prompts = fakes.prompts
    assert len(prompts) == 3
    for before, after in zip(prompts, prompts[1:], strict=False):
        assert after[: len(before) - 1] == before[:-1]  # all but the budget tail
        assert after[-1].content.startswith("Step ") and after[-1] != before[-1]
    # only what is new travels in each request: history stays O(steps)
    assert [len(r.new_messages) for r in fakes.generate_requests] == [0, 2, 2]
    assert [r.base_len for r in fakes.generate_requests] == [0, 0, 2]


async def test_malformed_tool_call_is_reported_to_the_model_and_the_job_goes_on(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    script = iter([
        reply("search_kb", '{"topic": "log'),              # truncated JSON
        reply(None, content="I think the answer is 42"),   # prose, no call
        reply("search_kb", '{"topic": "login"}'),
        reply("drop_tables", "{}"),                        # unknown tool
        reply("finish", '{"resolution": "resolved", "priority": "low"}'),
    ])
    fakes = FakeActivities(lambda req: next(script))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=8)
    assert res.state == JobState.FINISHED
    assert [s.valid for s in res.steps] == [False, False, True, False, True]
    assert "not valid JSON" in (res.steps[0].error or "")
    assert "exactly one tool call" in (res.steps[1].error or "")
    assert "unknown tool 'drop_tables'" in (res.steps[3].error or "")
    # the model was told, inside the transcript, what went wrong
    last_prompt = fakes.prompts[4]
    assert any("error: unknown tool" in m.content for m in last_prompt)
    assert any("error: arguments of search_kb are not valid JSON" in m.content
               for m in last_prompt)


async def test_repeated_invalid_output_ends_in_invalid_output(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(reply("search_kb", "not json")))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=8)
    assert res.state == JobState.INVALID_OUTPUT
    assert len(res.steps) == 3 and res.transcript  # kept
    assert not fakes.tool_requests


async def test_context_overflow_ends_in_context_exhausted(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    def script(req: GenerateRequest) -> GenerateResult:
        if req.step == 3:
            raise ApplicationError("too long", type="ContextOverflow", non_retryable=True)
        return reply("search_kb", '{"topic": "login"}')

    fakes = FakeActivities(script)
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=8)
    assert res.state == JobState.CONTEXT_EXHAUSTED
    assert len(res.steps) == 2 and len(res.transcript) == 4


async def test_a_step_on_a_dead_engine_fails_over_and_is_not_lost(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    # Two engines in the registry, but only "fake1" has a worker: the step scheduled
    # on "fake0" is never picked up, times out to start, and is re-routed.
    fakes = FakeActivities(
        lambda req: reply("search_kb", '{"topic": "login"}', engine_id="fake1"),
        engines=["fake0", "fake1"],
    )
    fakes.forced_routes = ["fake0"]  # first route: the dead one
    async with workers(time_skipping_env, fakes, serving=["fake1"]) as client:
        res = await run_job(client, max_steps=2, step_pickup_timeout_s=2)
    assert res.state == JobState.LOOP_CAP
    assert [(r.step, r.exclude) for r in fakes.routes] == [(1, []), (1, ["fake0"]), (2, [])]
    assert [s.route_reason for s in res.steps] == ["failover", "sticky"]
    assert [s.engine_id for s in res.steps] == ["fake1", "fake1"]
    assert [r.step for r in fakes.generate_requests] == [1, 2]  # each step ran once


async def test_invalid_input_that_bypassed_the_client_ends_cleanly(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(reply("finish", "{}")))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, task={"ticket_id": "nope"})
    assert res.state == JobState.INVALID_INPUT
    assert "ticket_id" in res.reason
    assert not fakes.generate_requests


def test_job_result_round_trips_as_json() -> None:
    res = JobResult(job_id="j", profile="ticket-triage", state=JobState.LOOP_CAP, reason="r")
    assert JobResult.model_validate(json.loads(res.model_dump_json())) == res


async def test_a_job_may_offer_only_some_tools(time_skipping_env: WorkflowEnvironment) -> None:
    script = iter([reply("finish", '{"resolution": "resolved", "priority": "low"}'),
                   reply("search_kb", '{"topic": "login"}')])
    fakes = FakeActivities(lambda req: next(script))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=2, tools=["search_kb", "lookup_customer"])
    assert res.state == JobState.LOOP_CAP  # finish was not offered, so it cannot end the job
    assert "unknown tool 'finish'" in (res.steps[0].error or "")
    assert all(r.tools == ["search_kb", "lookup_customer"] for r in fakes.generate_requests)


async def test_a_lost_transcript_store_is_refilled_from_the_workflow(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    lost = {"once": True}

    def script(req: GenerateRequest) -> GenerateResult:
        if req.step == 3 and lost.pop("once", False):
            raise ApplicationError("no message 1", type="TranscriptGap", non_retryable=True)
        return reply("search_kb", '{"topic": "login"}')

    fakes = FakeActivities(script)
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=4)
    assert res.state == JobState.LOOP_CAP and len(res.steps) == 4
    step3 = [r for r in fakes.generate_requests if r.step == 3]
    assert [(r.base_len, len(r.new_messages)) for r in step3] == [(2, 2), (0, 4)]
    assert not any(r.exclude for r in fakes.routes)  # same engine: not a failover
    assert {s.engine_id for s in res.steps} == {"fake0"}
