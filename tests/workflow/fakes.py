"""Scripted stand-ins for the I/O activities, for time-skipping workflow tests only.

The tests that prove features against real engines live in tests/integration.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from workflows.contracts import (
    EngineChoice,
    FunctionCall,
    GenerateRequest,
    GenerateResult,
    PickEngineRequest,
    StoreTranscriptRequest,
    ToolCall,
    ToolRequest,
    ToolResult,
)

Script = Callable[[GenerateRequest], GenerateResult]


def reply(name: str | None, arguments: str = "{}", *, content: str = "",
          engine_id: str = "fake0") -> GenerateResult:
    calls = [] if name is None else [ToolCall(id=f"call-{name}", function=FunctionCall(
        name=name, arguments=arguments))]
    return GenerateResult(engine_id=engine_id, content=content, tool_calls=calls,
                          prompt_tokens=1000, cached_tokens=896, completion_tokens=20,
                          ttft_ms=5.0, latency_ms=9.0)


class FakeActivities:
    def __init__(self, script: Script, engines: list[str] | None = None) -> None:
        self.script = script
        self.engines = engines or ["fake0"]
        self.generate_requests: list[GenerateRequest] = []
        self.tool_requests: list[ToolRequest] = []
        self.picks: list[PickEngineRequest] = []
        self.stored: list[StoreTranscriptRequest] = []
        self._rr = itertools.count()

    @activity.defn(name="pick_engine")
    async def pick_engine(self, req: PickEngineRequest) -> EngineChoice:
        self.picks.append(req)
        live = [e for e in self.engines if e not in req.exclude]
        if not live:
            raise ApplicationError("no live engine", non_retryable=True)
        return EngineChoice(engine_id=live[next(self._rr) % len(live)],
                            reason="failover" if req.exclude else "round_robin")

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        self.generate_requests.append(req)
        return self.script(req)

    @activity.defn(name="run_tool")
    async def run_tool(self, req: ToolRequest) -> ToolResult:
        self.tool_requests.append(req)
        return ToolResult(ok=True, output=f"{req.name} ok")

    @activity.defn(name="store_transcript")
    async def store_transcript(self, req: StoreTranscriptRequest) -> str:
        self.stored.append(req)
        return f"transcripts/{req.job_id}.json"
