"""What a job does when a part around it fails or the model names the wrong record:
Redis away while routing, an engine that fails a step part-way, a side effect aimed
at another record than the job's task."""

from __future__ import annotations

import asyncio
import uuid
from datetime import UTC, datetime

import pytest
from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import TICKET, always, run_job, workers
from warmloop.workers.temporal_plugin import sandbox_runner
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.budgets import Usage
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    AttemptSpend,
    GenerateRequest,
    GenerateResult,
    JobCarry,
    JobInput,
    JobState,
    RouteRequest,
    engine_task_queue,
)
from warmloop.workflows.routing import RouteDecision

SEARCH = reply("search_kb", '{"topic": "crash"}')
INVOICE = {"invoice_id": "INV1001", "vendor_id": "V001", "po_number": "PO1001"}


class RedisAway(FakeActivities):
    """route_step answers RedisUnavailable (Redis away, no engines known yet) a few
    times, then routes as usual."""

    away_for = 8  # more than route_step's own retries

    @activity.defn(name="route_step")
    async def route_step(self, req: RouteRequest) -> RouteDecision:
        if self.away_for > 0:
            self.away_for -= 1
            raise ApplicationError("Redis is away", type="RedisUnavailable")
        return await super().route_step(req)


async def test_a_job_waits_for_redis_rather_than_ending(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = RedisAway(always(SEARCH))
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=2)
    assert fakes.away_for == 0
    assert res.state == JobState.LOOP_CAP, (res.state, res.reason)
    assert len(res.steps) == 2


class FailsPartWay(FakeActivities):
    """Engine fake0 fails every attempt after the engine reported 700 prompt tokens."""

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        if activity.info().task_queue == "engine.fake0":
            self.generate_requests.append(req)
            raise ApplicationError("engine fake0: stream cut before [DONE]",
                                   {"prompt_tokens": 700, "cached_tokens": 0,
                                    "completion_tokens": 3}, type="EngineError")
        return await super().generate(req)


async def test_tokens_an_engine_reported_before_failing_count(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FailsPartWay(always(SEARCH), engines=["fake0", "fake1"])
    fakes.forced_routes = ["fake0"]
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=1)
    assert res.state == JobState.LOOP_CAP
    assert fakes.served_by == ["fake1"] and res.steps[0].retries >= 1
    # the failed attempt's 700 + 3 tokens, then the step on fake1 (1000 + 20)
    assert res.usage.prompt_tokens == 1700 and res.usage.completion_tokens == 23


class RetriedAndFailedOver(FakeActivities):
    """As the real worker sums a step's attempts: every attempt on fake0 fails after
    700 prompt tokens (its last error reports all three attempts); on fake1 the first
    attempt fails after 500 and the retry answers, returning that attempt's spend."""

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        n = activity.info().attempt
        if activity.info().task_queue == "engine.fake0":
            raise ApplicationError("engine fake0: stream cut before [DONE]", AttemptSpend(
                attempts=n, prompt_tokens=700 * n, completion_tokens=3 * n,
                cost_usd=0.001 * n).model_dump(), type="EngineError")
        if n == 1:
            raise ApplicationError("engine fake1: error event", AttemptSpend(
                attempts=1, prompt_tokens=500, cached_tokens=400, completion_tokens=5,
                cost_usd=0.0005).model_dump(), type="EngineError")
        result = await super().generate(req)
        return result.model_copy(update={"failed_attempts": AttemptSpend(
            attempts=1, prompt_tokens=500, cached_tokens=400, completion_tokens=5,
            cost_usd=0.0005)})


async def test_every_failed_attempt_of_a_step_counts_in_the_jobs_usage_and_cost(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """Three attempts failed on fake0 (the workflow sees their sum in the last error),
    one on fake1 before its retry answered (the answer carries it): the job's tokens
    and dollars count all four, the step record names them apart from its answer."""
    from tests.workflow.test_replay import _record, _replayer

    fakes = RetriedAndFailedOver(always(SEARCH), engines=["fake0", "fake1"])
    fakes.forced_routes = ["fake0"]
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=1)
        history = await client.get_workflow_handle(res.job_id).fetch_history()
    await _replayer().replay_workflow(history)  # the count-failed-attempts patch's path
    _record("agent_job_failed_attempts.json", history)
    assert res.state == JobState.LOOP_CAP, res.reason
    [step] = res.steps
    assert fakes.served_by == ["fake1"]
    assert (step.prompt_tokens, step.completion_tokens) == (1000, 20)  # the answer's own
    assert step.failed_attempts is not None
    assert (step.failed_attempts.attempts, step.failed_attempts.prompt_tokens,
            step.failed_attempts.completion_tokens) == (4, 2600, 14)
    assert res.usage.prompt_tokens == 2100 + 500 + 1000
    assert res.usage.completion_tokens == 9 + 5 + 20
    assert res.usage.cached_tokens == 400 + step.cached_tokens
    assert res.usage.cost_usd == pytest.approx(0.003 + 0.0005 + (step.cost_usd or 0.0))


async def test_a_payment_for_another_invoice_is_refused_before_any_approval(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    def script(req: GenerateRequest) -> GenerateResult:
        if req.step == 1:  # a large payment: it would wait for a human first
            return reply("approve_payment", '{"invoice_id": "INV9999", "amount": 90000}')
        return reply("finish", '{"outcome": "needs_review"}')

    fakes = FakeActivities(script)
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, profile="invoice-reconciliation", task=INVOICE)
    assert res.state == JobState.FINISHED
    assert res.approvals == [] and fakes.tool_requests == []
    answer = res.transcript[1].content or ""
    assert answer.startswith("refused:") and "INV1001" in answer


async def test_a_job_started_around_the_client_with_a_bad_id_or_a_carry_is_refused(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(SEARCH))
    forged = JobCarry(transcript=[], stored_len=0, steps=[], usage=Usage(cost_usd=0.0),
                      engine=None, invalid_streak=0, next_kind="plan",
                      started_at=datetime(2020, 1, 1, tzinfo=UTC), runs=1)
    async with workers(time_skipping_env, fakes) as client:
        bad_id = await client.execute_workflow(
            AgentJob.run, JobInput(profile="ticket-triage", task=TICKET),
            id=f"job*{uuid.uuid4().hex[:6]}", task_queue=AGENT_TASK_QUEUE)
        with_carry = await run_job(client, carry=forged)
    assert bad_id.state == JobState.INVALID_INPUT and "may hold only" in bad_id.reason
    assert with_carry.state == JobState.INVALID_INPUT
    assert "continue-as-new only" in with_carry.reason
    assert fakes.generate_requests == []


async def test_a_busy_engine_keeps_its_step_and_a_gone_one_fails_it_over(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    # Busy: nobody takes fake0's steps within the pickup timeout, yet its worker
    # heartbeats. The step waits for fake0 rather than moving to cold fake1.
    busy = FakeActivities(always(SEARCH), engines=["fake0", "fake1"])
    busy.forced_routes = ["fake0"] * 5
    async with workers(time_skipping_env, busy, serving=["fake1"]) as client:
        busy.alive.add("fake0")
        # a short pickup timeout: this part waits in real time (the test drives it)
        job = asyncio.ensure_future(run_job(client, max_steps=1, step_pickup_timeout_s=2))
        await asyncio.wait_for(busy.asked_alive.wait(), timeout=60)
        async with Worker(client, task_queue=engine_task_queue("fake0"),
                          activities=[busy.generate, busy.prewarm]):
            res = await asyncio.wait_for(job, timeout=60)
    assert res.state == JobState.LOOP_CAP
    assert busy.served_by == ["fake0"] and busy.alive_asked[0] == "fake0"
    assert res.steps[0].route_reason != "failover"

    # Gone: no worker and no heartbeat: the step fails over, as it always did.
    gone = FakeActivities(always(SEARCH), engines=["fake0", "fake1"])
    gone.forced_routes = ["fake0"]
    async with workers(time_skipping_env, gone, serving=["fake1"]) as client:
        res = await run_job(client, max_steps=1, step_pickup_timeout_s=2)
    assert res.state == JobState.LOOP_CAP and gone.served_by == ["fake1"]
    assert gone.alive_asked == ["fake0"]

    # Unknown: the registry check itself fails (its failure comes back unwrapped from a
    # local activity): the step fails over, the job does not fail as a workflow.
    unknown = FakeActivities(always(SEARCH), engines=["fake0", "fake1"])
    unknown.forced_routes, unknown.alive_fails = ["fake0"], True
    async with workers(time_skipping_env, unknown, serving=["fake1"]) as client:
        res = await run_job(client, max_steps=1, step_pickup_timeout_s=2)
    assert res.state == JobState.LOOP_CAP and unknown.served_by == ["fake1"]
    assert unknown.alive_asked == ["fake0", "fake0"]  # both attempts failed


async def test_a_real_servers_retry_hands_the_failed_attempts_spend_to_the_next(
    dev_server_env: WorkflowEnvironment,
) -> None:
    """On a real Temporal server (the one the stack runs): the real ``generate`` fails
    its first attempt after the engine reported its usage (an error event inside the
    stream); Temporal retries it, handing the next attempt the failed one's heartbeat
    details, and the answer brings that spend to the job's usage."""
    import httpx

    from tests.unit.engine_fakes import (
        GOOD_STREAM,
        call_chunks,
        engine,
        inference,
        role_chunk,
        sse,
        usage_chunk,
    )

    broken = engine(sse(role_chunk(), *call_chunks(), usage_chunk(),
                        {"error": {"message": "detokenizer failed"}}, "[DONE]"))
    good = engine(GOOD_STREAM)
    asked: list[int] = []

    def handle(request: httpx.Request) -> httpx.Response:
        if request.url.path == "/v1/chat/completions":
            asked.append(1)
            return (broken if len(asked) == 1 else good).handler(request)  # type: ignore[return-value]
        return good.handler(request)  # type: ignore[return-value]

    real = inference(httpx.MockTransport(handle))
    fakes = FakeActivities(always(SEARCH), engines=["e0"])
    client = dev_server_env.client
    async with (
        Worker(client, task_queue=AGENT_TASK_QUEUE, workflow_runner=sandbox_runner(),
               workflows=[AgentJob],
               activities=[fakes.route_step, fakes.pick_engine, fakes.record_pause,
                           fakes.engine_alive, fakes.run_tool, fakes.store_transcript,
                           fakes.load_transcript]),
        Worker(client, task_queue=engine_task_queue("e0"), activities=[real.generate]),
    ):
        res = await run_job(client, max_steps=1)
    assert res.state == JobState.LOOP_CAP, res.reason
    assert len(asked) == 2  # one failed attempt, one retry that answered
    [step] = res.steps
    assert step.retries == 1 and step.failed_attempts is not None
    assert (step.failed_attempts.attempts, step.failed_attempts.prompt_tokens,
            step.failed_attempts.completion_tokens) == (1, 300, 12)
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (600, 24)


class DiesAfterTwoFailures(FakeActivities):
    """On fake0 two attempts fail after 700 prompt tokens each (the second reporting
    both), and the third beats their sum, as the real worker's beats carry it, then
    goes silent like a killed worker: its heartbeat times out."""

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        n = activity.info().attempt
        if activity.info().task_queue != "engine.fake0":
            return await super().generate(req)
        if n < 3:
            raise ApplicationError("engine fake0: stream cut", AttemptSpend(
                attempts=n, prompt_tokens=700 * n, completion_tokens=3 * n).model_dump(),
                type="EngineError")
        activity.heartbeat(AttemptSpend(attempts=2, prompt_tokens=1400,
                                        completion_tokens=6).model_dump())
        await asyncio.Event().wait()  # dead: no more beats
        raise AssertionError("unreachable")


async def test_a_last_attempt_that_dies_still_counts_the_attempts_before_it(
    dev_server_env: WorkflowEnvironment,
) -> None:
    """The last attempt's heartbeat times out (its worker died): the workflow reads the
    earlier attempts' spend from the timeout's last heartbeat details, then the step
    fails over and answers on fake1. On a real server (10 s heartbeat timeout)."""
    fakes = DiesAfterTwoFailures(always(SEARCH), engines=["fake0", "fake1"])
    fakes.forced_routes = ["fake0"]
    async with workers(dev_server_env, fakes) as client:
        res = await run_job(client, max_steps=1)
    assert res.state == JobState.LOOP_CAP, res.reason
    [step] = res.steps
    assert step.failed_attempts is not None and step.failed_attempts.attempts == 2
    assert (res.usage.prompt_tokens, res.usage.completion_tokens) == (1400 + 1000, 6 + 20)
