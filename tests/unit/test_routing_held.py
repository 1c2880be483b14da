"""Where less is held: the router counts the tokens an engine's holds keep as taken KV.

vLLM counts a held block as free (cached, no request uses it), so two idle engines
read the same KV usage whatever one of them holds. bench-pauses' outlying repeats came
from that tie: a new prefix family placed beside a held one, on an engine whose holds'
cap cannot keep both, lost its approval holds for room."""

from __future__ import annotations

import pytest
from temporalio.testing import ActivityEnvironment

from tests.routing_stubs import EmptyDirectory
from warmloop.activities.registry import EngineHeartbeat
from warmloop.activities.routing import RoutingActivities
from warmloop.workflows.contracts import RouteRequest
from warmloop.workflows.routing import EngineCandidate, kv_taken, pick_engine

JOBS = [f"job-{i}" for i in range(40)]


def test_held_tokens_are_counted_as_taken() -> None:
    assert kv_taken(0.0, held_tokens=1_537, capacity_tokens=8_192) == pytest.approx(0.1876, 1e-3)
    assert kv_taken(0.25, held_tokens=2_048, capacity_tokens=8_192) == 0.5
    assert kv_taken(0.9, held_tokens=4_096, capacity_tokens=8_192) == 1.0  # at most all
    assert kv_taken(0.3, held_tokens=0, capacity_tokens=8_192) == 0.3
    assert kv_taken(0.3, held_tokens=4_096, capacity_tokens=0) == 0.3  # capacity unknown


def test_a_cold_start_tie_goes_where_less_is_held() -> None:
    def chosen(held_e0: int) -> set[str]:
        out = set()
        for job in JOBS:
            cands = [EngineCandidate(engine_id="e0", kv_usage=kv_taken(
                         0.0, held_tokens=held_e0, capacity_tokens=8_192)),
                     EngineCandidate(engine_id="e1")]
            c, reason, _ = pick_engine(cands, job_id=job)
            assert reason == "least_loaded"
            out.add(c.engine_id)
        return out

    assert chosen(0) == {"e0", "e1"}  # a true tie is spread job by job
    assert chosen(1_537) == {"e1"}


def test_load_still_comes_before_what_is_held() -> None:
    busy = EngineCandidate(engine_id="e1", running=1)
    holding = EngineCandidate(engine_id="e0", kv_usage=kv_taken(
        0.0, held_tokens=2_458, capacity_tokens=8_192))
    assert {pick_engine([holding, busy], job_id=j)[0].engine_id for j in JOBS} == {"e0"}


class Registry:
    """Two idle engines as their heartbeats say; ``e0``'s worker holds ``held`` tokens."""

    def __init__(self, held: int, gateway_held: int = 0) -> None:
        self.hbs = [EngineHeartbeat(engine_id=e, task_queue=f"engine.{e}", model="tiny",
                                    url="u", healthy=True, kv_capacity_tokens=8_192,
                                    held_tokens=held if e == "e0" else 0, at=0.0)
                    for e in ("e0", "e1")]
        self.gateway_held = gateway_held

    async def live(self) -> list[EngineHeartbeat]:
        return self.hbs

    async def in_flight_steps(self, ids: list[str]) -> dict[str, list[str]]:
        return {e: [] for e in ids}

    asked_gateways = 0

    async def gateways(self) -> list[str]:
        self.asked_gateways += 1
        return ["gw"] if self.gateway_held else []

    async def gateways_held(self, names: list[str]) -> dict[str, int]:
        assert names == ["gw"]
        return {"e1": self.gateway_held}

    async def step_routed(self, engine_id: str, key: str) -> None:
        pass


async def _routed(held: int, gateway_held: int = 0) -> set[str]:
    acts = RoutingActivities(Registry(held, gateway_held), object(),  # type: ignore[arg-type]
                             directory=EmptyDirectory())  # type: ignore[arg-type]
    env = ActivityEnvironment()
    return {(await env.run(acts.route_step, RouteRequest(
        job_id=j, step=1, profile="support-escalation"))).engine_id for j in JOBS}


async def test_route_step_reads_the_held_tokens_from_the_heartbeat() -> None:
    assert await _routed(0) == {"e0", "e1"}
    assert await _routed(1_537) == {"e1"}


async def test_route_step_counts_the_gateways_held_tokens() -> None:
    # a gateway's holds are in no heartbeat: the registry's gateway entries say them
    assert await _routed(0, gateway_held=1_537) == {"e0"}
    # the worker's on e0 and a gateway's on e1: the one holding less gets them all
    assert await _routed(1_000, gateway_held=1_537) == {"e0"}
    assert await _routed(1_537, gateway_held=1_000) == {"e1"}


async def test_the_gateways_are_listed_once_a_second_not_every_route() -> None:
    now = [100.0]
    registry = Registry(0)
    acts = RoutingActivities(registry, object(),  # type: ignore[arg-type]
                             directory=EmptyDirectory(),  # type: ignore[arg-type]
                             clock=lambda: now[0])
    env = ActivityEnvironment()
    for j in JOBS[:5]:
        await env.run(acts.route_step, RouteRequest(job_id=j, step=1, profile="support"))
    assert registry.asked_gateways == 1
    now[0] += 1.0
    registry.gateway_held = 1_537  # a gateway began holding on e1
    assert (await env.run(acts.route_step, RouteRequest(
        job_id=JOBS[0], step=1, profile="support"))).engine_id == "e0"
    assert registry.asked_gateways == 2
