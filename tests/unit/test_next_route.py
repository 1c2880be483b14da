"""The inference worker routes a job's next step as the step ends (``route_next``), and
whatever goes wrong there costs the next step a route of its own, never this step."""

from __future__ import annotations

import asyncio
import time

import redis.asyncio as aioredis
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
from warmloop.activities.directory import PrefixDirectory, PromptChain
from warmloop.activities.registry import EngineHeartbeat, EngineRegistry, RedisOutage, step_key
from warmloop.activities.routing import JustServed, RoutingActivities
from warmloop.workflows.contracts import RouteRequest
from warmloop.workflows.routing import RouteDecision, block_hashes
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

    async def route_after_step(self, req: RouteRequest, served: JustServed) -> RouteDecision:
        return await self.route_step(req)


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


# ---- beside the records ---------------------------------------------------------------


class BesideRouter(Router):
    """Records what the worker said it had just served."""

    def __init__(self, answer: RouteDecision | BaseException | None) -> None:
        super().__init__(answer)
        self.served: list[JustServed] = []

    async def route_after_step(self, req: RouteRequest, served: JustServed) -> RouteDecision:
        self.served.append(served)
        return await self.route_step(req)


async def test_the_next_route_runs_beside_the_records_told_their_chain(
        redis: aioredis.Redis) -> None:
    router = BesideRouter(SOMEWHERE)
    directory = PrefixDirectory(redis)
    registry = EngineRegistry(redis, ttl_s=5)
    res = await generate(inference(engine(), router=router, directory=directory,
                                   registry=registry),
                         step_request(route_next=NEXT))
    assert res.next_route == SOMEWHERE
    [served] = router.served
    recorded = await directory.job_chain("j1")
    # the chain the route was told is the one the records wrote, on this engine
    assert recorded is not None and served.hashes == recorded[0] and recorded[1] == "e0"
    assert served.engine_id == "e0" and served.hashes
    assert served.step_key == step_key("j1", 1, "ticket-triage")
    assert await registry.in_flight_steps(["e0"]) == {"e0": []}  # and it is off


def _hb(engine_id: str, *, running: int = 0) -> EngineHeartbeat:
    return EngineHeartbeat(engine_id=engine_id, task_queue=f"engine.{engine_id}", model="tiny",
                           url=f"http://{engine_id}", healthy=True, running=running,
                           block_size=16, at=time.time())


async def test_a_route_beside_the_records_sees_what_they_are_writing(
        redis: aioredis.Redis) -> None:
    registry, directory = EngineRegistry(redis, ttl_s=5), PrefixDirectory(redis)
    await registry.heartbeat(_hb("e0"))
    await registry.heartbeat(_hb("e1"))
    # The directory still has the job's previous step, on e1 (the records of the step
    # just served on e0 have not landed), and that step still counts on e0: 8 there,
    # the load limit, against 7 on e1.
    old = block_hashes(list(range(160)), 16)
    await directory.record_step("e1", "j1", PromptChain(
        hashes=old, tokens=160, block_size=16, reusable_blocks=len(old)), capacity_blocks=None)
    key = step_key("j1", 1, "ticket-triage")
    await registry.step_routed("e0", key)
    for i in range(7):
        await registry.step_routed("e0", f"other:{i}|p")
        await registry.step_routed("e1", f"more:{i}|p")
    new = block_hashes(list(range(640)), 16)
    req = RouteRequest(job_id="j1", step=2, profile="ticket-triage", last_engine="e0",
                       mark_in_flight=False)
    acts = RoutingActivities(registry, redis, directory=directory)
    beside = await acts.route_after_step(req, JustServed(engine_id="e0", hashes=new,
                                                         step_key=key))
    assert (beside.engine_id, beside.reason, beside.expected_cached_tokens) == (
        "e0", "sticky", 640)
    # counting the step that ended as load passes its engine over
    loaded = await acts.route_after_step(req, JustServed(engine_id="e0", hashes=new))
    assert loaded.engine_id == "e1"
    # and without being told, the same moment reads the stale chain
    stale = await acts.route_step(req)
    assert stale.expected_cached_tokens != 640


async def test_beside_the_records_a_failing_or_hung_router_costs_only_the_next_route(
        redis: aioredis.Redis) -> None:
    for router in (BesideRouter(RedisConnectionError("connection refused")),
                   BesideRouter(None)):  # hangs: generate() bounds the step at 10 s
        directory = PrefixDirectory(redis)
        res = await generate(inference(engine(), router=router, directory=directory),
                             step_request(route_next=NEXT))
        assert res.next_route is None and res.tool_calls and len(router.served) == 1
        assert await directory.job_chain("j1") is not None  # the records landed
