"""The inference worker routes a job's next step as the step ends (``route_next``), and
whatever goes wrong there costs the next step a route of its own, never this step."""

from __future__ import annotations

import asyncio

from redis.exceptions import ConnectionError as RedisConnectionError
from temporalio.exceptions import ApplicationError

from tests.unit.engine_fakes import (
    engine,
    generate,
    inference,
    role_chunk,
    sse,
    step_request,
    usage_chunk,
)
from warmloop.activities.registry import RedisOutage
from warmloop.workflows.contracts import RouteRequest
from warmloop.workflows.routing import RouteDecision
from warmloop.workflows.tenants import TENANT_QUOTA_EXCEEDED

NEXT = RouteRequest(job_id="j1", step=2, profile="ticket-triage", last_engine="elsewhere",
                    mark_in_flight=True)


class Router:
    """Answers, refuses, fails or hangs, as told; records what it was asked."""

    def __init__(self, answer: RouteDecision | BaseException | None = None) -> None:
        self.answer = answer
        self.asked: list[RouteRequest] = []

    async def route_step(self, req: RouteRequest) -> RouteDecision:
        self.asked.append(req)
        if self.answer is None:
            await asyncio.Event().wait()  # hangs
        if isinstance(self.answer, BaseException):
            raise self.answer
        assert self.answer is not None
        return self.answer


SOMEWHERE = RouteDecision(engine_id="e0", reason="sticky", expected_cached_tokens=256)


async def test_a_step_returns_its_jobs_next_route_taken_from_here() -> None:
    router = Router(SOMEWHERE)
    res = await generate(inference(engine(), router=router), step_request(route_next=NEXT))
    assert res.next_route == SOMEWHERE
    # routed as from this engine, and not counted as load while the job waits on its tool
    assert [(r.step, r.last_engine, r.mark_in_flight) for r in router.asked] == [
        (2, "e0", False)]


async def test_a_step_that_was_not_asked_routes_nothing() -> None:
    router = Router(SOMEWHERE)
    res = await generate(inference(engine(), router=router), step_request())
    assert res.next_route is None and router.asked == []


async def test_a_finishing_step_routes_nothing() -> None:
    finish = sse(role_chunk(), {"choices": [{"index": 0, "delta": {"tool_calls": [{
        "index": 0, "id": "call-9", "type": "function", "function": {
            "name": "finish", "arguments": '{"resolution": "done", "priority": "low"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
        usage_chunk(), "[DONE]")
    router = Router(SOMEWHERE)
    res = await generate(inference(engine(finish), router=router), step_request(route_next=NEXT))
    assert res.tool_calls[0].function.name == "finish"
    assert res.next_route is None and router.asked == []


async def test_a_refusal_leaves_the_next_step_to_route_itself() -> None:
    refused = ApplicationError("tenant acme has used its tokens", {"retry_after_s": 60},
                               type=TENANT_QUOTA_EXCEEDED, non_retryable=True)
    res = await generate(inference(engine(), router=Router(refused)),
                         step_request(route_next=NEXT))
    assert res.next_route is None and res.tool_calls  # the step itself is whole


async def test_redis_failing_or_away_leaves_the_next_step_to_route_itself() -> None:
    failing = Router(RedisConnectionError("connection refused"))
    res = await generate(inference(engine(), router=failing), step_request(route_next=NEXT))
    assert res.next_route is None and len(failing.asked) == 1
    away = RedisOutage()
    away.failed(RedisConnectionError("gone"), what="test")
    assert away.away
    unasked = Router(SOMEWHERE)
    res = await generate(inference(engine(), router=unasked, outage=away),
                         step_request(route_next=NEXT))
    assert res.next_route is None and unasked.asked == []  # not even tried while away


async def test_a_hung_router_costs_the_step_its_budget_and_no_more() -> None:
    hung = Router(None)
    # generate() bounds the whole step at 10 s: a route that waited on the router for
    # good would fail this test, not stall it
    res = await generate(inference(engine(), router=hung), step_request(route_next=NEXT))
    assert res.next_route is None and len(hung.asked) == 1
