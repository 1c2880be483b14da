"""Hedged tool calls on the real stack (the session's: its workers load the hedge plugin,
whose tools this test serves on the hedge bench's tool port): a slow read-only call gets
a second request whose answer the job reads while the first is cancelled; a job that
turns hedging off, and a side-effect tool, never get one; with no statistics the tool's
prior sets the threshold."""

from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any

import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio.client import Client

from bench.hedge import TOOL_URL, disconnected, serving, tool_times
from bench.hedge_plugin import PROFILE_NAME, URL_ENV
from warmloop.activities.pauses import PAUSES_KEY, tool_kind
from warmloop.activities.tools.hedging import hedge_counts
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput

pytestmark = pytest.mark.integration

SLOW_S = 4.0
"""How long each job's first (unmarked) request takes; every other request answers at
once. The prior's p95 (median 0.1 s, p90 0.3 s) is about 0.4 s."""


class ScriptedTool:
    def __init__(self) -> None:
        self.requests: list[tuple[str, str, bool]] = []
        """(path, job, marked as a hedge)"""
        self.hung_up: list[str] = []
        self._slowed: set[str] = set()
        self.app = Starlette(routes=[Route(p, self.handle, methods=["POST"])
                                     for p in ("/lookup", "/note")])

    async def handle(self, request: Request) -> Response:
        job = request.headers.get("x-warmloop-job", "")
        hedge = request.headers.get("x-warmloop-hedge") == "1"
        self.requests.append((request.url.path, job, hedge))
        if not hedge and job not in self._slowed:
            self._slowed.add(job)
            answer = asyncio.ensure_future(asyncio.sleep(SLOW_S))
            gone = asyncio.ensure_future(disconnected(request))
            done, _ = await asyncio.wait({answer, gone}, return_when=asyncio.FIRST_COMPLETED)
            answer.cancel()
            gone.cancel()
            if gone in done:
                self.hung_up.append(job)
                return Response(status_code=499)
        return JSONResponse({"answer": "fine", "hedge": hedge})

    def of(self, job: str, *, path: str = "/lookup", hedge: bool | None = None) -> int:
        return sum(1 for p, j, h in self.requests
                   if j == job and p == path and (hedge is None or h == hedge))


async def test_a_slow_read_only_call_is_hedged_and_a_side_effect_never_is(
        client: Client, redis: aioredis.Redis) -> None:
    assert os.environ[URL_ENV] == TOOL_URL  # set by tests/conftest.py
    tool = ScriptedTool()
    async with serving(tool.app):
        # no statistics: the threshold is the tool's prior
        for name in ("lookup", "note"):
            await redis.delete(PAUSES_KEY.format(PROFILE_NAME, tool_kind(name)))
        before = await hedge_counts(redis)
        tag = uuid.uuid4().hex[:6]
        jobs = {"hedged": (["lookup"], True), "plain": (["lookup"], False),
                "effect": (["note"], True)}
        handles: dict[str, Any] = {}
        for name, (tools, hedge) in jobs.items():
            handles[name] = await client.start_workflow(
                AgentJob.run,
                JobInput(profile=PROFILE_NAME, task={"case_id": "S0001", "text": "a case"},
                         max_steps=4, tools=tools, hold_policy="never", hedge_tools=hedge),
                id=f"hedge-it-{name}-{tag}", task_queue=AGENT_TASK_QUEUE)
        for h in handles.values():
            await h.result()
        times = {name: (await tool_times(h))[0] for name, h in handles.items()}
        after = await hedge_counts(redis)

    hedged, plain, effect = (handles[n].id for n in ("hedged", "plain", "effect"))
    assert all(times.values()), f"a job made no tool call: {times}"
    # the hedged job read the second request's answer long before the first's would come
    assert tool.of(hedged, hedge=True) == 1 and tool.hung_up == [hedged]
    assert times["hedged"][0] < SLOW_S * 1000 / 2  # ms
    assert after.get((PROFILE_NAME, "lookup", "hedge_won"), 0) \
        - before.get((PROFILE_NAME, "lookup", "hedge_won"), 0) == 1
    # hedging off: the job waited the slow request out
    assert tool.of(plain, hedge=True) == 0 and times["plain"][0] >= SLOW_S * 1000
    # a side effect: one request per call, however slow
    assert tool.of(effect, path="/note", hedge=True) == 0
    assert tool.of(effect, path="/note") == len(times["effect"])
    assert times["effect"][0] >= SLOW_S * 1000
    assert (PROFILE_NAME, "note", "calls") not in after
