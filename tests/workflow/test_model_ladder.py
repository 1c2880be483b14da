"""The model ladder in AgentJob (issue 20): each step on the cheap model's pool first,
asked again of the larger model's pool when it escalates, and back down after."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import Iterator

import pytest
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import TICKET, workers
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    GenerateRequest,
    GenerateResult,
    JobInput,
    JobResult,
    JobState,
)
from warmloop.workflows.ladder import HardCall, ModelLadder
from warmloop.workflows.profiles import REGISTRY, get_profile

PROFILE = "ticket-triage-laddered"
LADDER = ModelLadder(models=("small", "large"), min_mean_logprob=-0.5,
                     hard_calls=(HardCall(tool="draft_reply"),))
ENGINES = {"s0": "small", "s1": "small", "l0": "large"}


@pytest.fixture
def laddered() -> Iterator[str]:
    REGISTRY.add(dataclasses.replace(get_profile("ticket-triage"), name=PROFILE,
                                     ladder=LADDER), source="test")
    try:
        yield PROFILE
    finally:
        REGISTRY.remove(PROFILE)


def sure(r: GenerateResult, mean: float) -> GenerateResult:
    return r.model_copy(update={"logprob_mean": mean, "logprob_min": mean * 3,
                                "logprob_tokens": 12})


LOOKUP = reply("lookup_customer", json.dumps({"customer_id": "C100"}))
SEARCH = reply("search_kb", json.dumps({"topic": "crash"}))
FINISH = reply("finish", json.dumps({"resolution": "resolved", "priority": "high"}))


async def run(client: Client, **kw: object) -> JobResult:
    return await client.execute_workflow(
        AgentJob.run, JobInput(profile=PROFILE, task=TICKET, **kw),  # type: ignore[arg-type]
        id=f"ladder-{uuid.uuid4().hex[:6]}", task_queue=AGENT_TASK_QUEUE)


async def test_unsure_and_invalid_calls_go_one_model_up_and_the_next_step_comes_back_down(
    time_skipping_env: WorkflowEnvironment, laddered: str,
) -> None:
    asks: list[tuple[str | None, bool]] = []

    def script(req: GenerateRequest) -> GenerateResult:
        asks.append((req.model, req.logprobs))
        n = len(asks)
        if req.model == "large":
            return {2: LOOKUP, 5: SEARCH, 7: FINISH}.get(n, FINISH)
        # 1: unsure -> 2 on large; 3: a sure search, kept; 4: invalid -> 5 on large;
        # 6: unsure -> 7 on large (which finishes)
        return {1: sure(LOOKUP, -2.0), 3: sure(SEARCH, -0.1),
                4: sure(reply("no_such_tool"), -0.1), 6: sure(FINISH, -3.0)}[n]

    fakes = FakeActivities(script, engines=list(ENGINES), models=ENGINES)
    async with workers(time_skipping_env, fakes) as client:
        res = await run(client)
    assert res.state == JobState.FINISHED, res.reason
    assert [m for m, _ in asks] == ["small", "large", "small", "small", "large", "small",
                                    "large"]
    # only the cheap rung is asked for logprobs (the top one decides nothing more)
    assert [lp for _, lp in asks] == [True, False, True, True, False, True, False]
    # each ask ran in its model's pool, routed with that model
    assert [ENGINES[e] for e in fakes.served_by] == [m for m, _ in asks]
    assert [r.model for r in fakes.routes] == [m for m, _ in asks]
    assert [(s.model, s.escalated) for s in res.steps] == [
        ("small", "low_confidence"), ("large", None), ("small", None),
        ("small", "invalid"), ("large", None), ("small", "low_confidence"), ("large", None)]
    # an escalated ask's call never reaches the transcript: the model reads one call a step
    tools = [m.tool_calls[0].function.name for m in res.transcript if m.tool_calls]
    assert tools == ["lookup_customer", "search_kb", "search_kb", "finish"]
    # the upper rung keeps no hold (the job goes back down); the cheap rung does
    held = {r.model: r.hold_policy for r in fakes.generate_requests}
    assert held == {"small": "cost_model", "large": "never"}
    # each ask is a model step: its tokens count
    assert res.usage.steps == 7


async def test_a_call_cut_at_its_budget_is_asked_of_the_larger_model_with_more(
    time_skipping_env: WorkflowEnvironment, laddered: str,
) -> None:
    # The small model's call is cut at the plan tier (144): the large model is asked
    # with twice that, and the next step, valid, is back on the tiers.
    cut = sure(reply(None, content='[{"name":"lookup_customer","arguments":{"cust'),
               -0.1).model_copy(update={"finish_reason": "length"})
    asks: list[GenerateRequest] = []

    def script(req: GenerateRequest) -> GenerateResult:
        asks.append(req)
        if len(asks) == 1:  # cut where the engine cuts: at the step's budget
            return cut.model_copy(update={"completion_tokens": req.max_tokens})
        return LOOKUP if len(asks) == 2 else sure(FINISH, -0.1)

    fakes = FakeActivities(script, engines=list(ENGINES), models=ENGINES)
    async with workers(time_skipping_env, fakes) as client:
        res = await run(client)
    assert [(r.model, r.max_tokens) for r in asks] == [("small", 144), ("large", 288),
                                                       ("small", 160)]
    assert res.steps[0].escalated == "invalid"
    assert "cut at the step's 144-token budget" in (res.steps[0].error or "")


async def test_a_hard_call_is_always_made_by_the_top_model(
    time_skipping_env: WorkflowEnvironment, laddered: str,
) -> None:
    reply_call = reply("draft_reply", json.dumps({"kb_article": "KB101", "tone": "formal"}))

    def script(req: GenerateRequest) -> GenerateResult:
        if req.model == "large":
            return FINISH if req.step > 2 else reply_call
        return sure(reply_call, -0.01)

    fakes = FakeActivities(script, engines=list(ENGINES), models=ENGINES)
    async with workers(time_skipping_env, fakes) as client:
        res = await run(client, max_steps=6)
    assert [(s.model, s.escalated) for s in res.steps][:2] == [("small", "hard_tool"),
                                                              ("large", None)]


async def test_a_ladder_that_stays_up_runs_later_steps_on_the_model_it_reached(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    REGISTRY.add(dataclasses.replace(get_profile("ticket-triage"), name=PROFILE,
                                     ladder=LADDER.model_copy(update={"stay_escalated": "job"})),
                 source="test")
    try:
        models: list[str | None] = []

        def script(req: GenerateRequest) -> GenerateResult:
            models.append(req.model)
            if req.model == "small":
                return sure(LOOKUP, -2.0)
            return SEARCH if len(models) < 4 else FINISH

        fakes = FakeActivities(script, engines=list(ENGINES), models=ENGINES)
        async with workers(time_skipping_env, fakes) as client:
            res = await run(client, max_steps=8)
    finally:
        REGISTRY.remove(PROFILE)
    assert res.state == JobState.FINISHED
    assert models == ["small", "large", "large", "large"]


async def test_a_fleet_without_the_cheap_model_ends_the_job_with_the_reason(
    time_skipping_env: WorkflowEnvironment, laddered: str,
) -> None:
    fakes = FakeActivities(lambda r: FINISH, engines=["l0"], models={"l0": "large"})
    async with workers(time_skipping_env, fakes) as client:
        res = await run(client)
    assert res.state == JobState.INVALID_INPUT
    assert "small" in res.reason


def test_a_profile_with_a_ladder_and_a_model_is_refused() -> None:
    with pytest.raises(ValueError, match="drop model"):
        dataclasses.replace(get_profile("ticket-triage"), name="x", model="m", ladder=LADDER)
    with pytest.raises(ValueError, match="unknown tool"):
        dataclasses.replace(get_profile("ticket-triage"), name="x", ladder=LADDER.model_copy(
            update={"hard_calls": (HardCall(tool="pay_everyone"),)}))
