"""Scripted stand-ins for the I/O activities, for time-skipping workflow tests only.

The tests that prove features against real engines live in tests/integration.
"""

from __future__ import annotations

import asyncio
import itertools
from collections.abc import Callable

from temporalio import activity
from temporalio.exceptions import ApplicationError

from warmloop.activities.inference import finishes_job
from warmloop.workflows.contracts import (
    ChatMessage,
    EngineAliveRequest,
    EngineChoice,
    FunctionCall,
    GenerateRequest,
    GenerateResult,
    LoadTranscriptRequest,
    PickEngineRequest,
    RecordPauseRequest,
    RouteRequest,
    StoreTranscriptRequest,
    ToolCall,
    ToolRequest,
    ToolResult,
)
from warmloop.workflows.lanes import BatchWindow, BatchWindowRequest
from warmloop.workflows.pricing import EnginePrice
from warmloop.workflows.profiles import get_profile
from warmloop.workflows.prompt import assemble_prompt
from warmloop.workflows.routing import (
    EngineCandidate,
    EngineOffer,
    RouteDecision,
    UnservableStepError,
    choose_engine,
    eligible_engines,
)

Script = Callable[[GenerateRequest], GenerateResult]


def reply(name: str | None, arguments: str = "{}", *, content: str = "",
          engine_id: str = "fake0") -> GenerateResult:
    calls = [] if name is None else [ToolCall(id=f"call-{name}", function=FunctionCall(
        name=name, arguments=arguments))]
    return GenerateResult(engine_id=engine_id, content=content, tool_calls=calls,
                          prompt_tokens=1000, cached_tokens=896, completion_tokens=20,
                          ttft_ms=5.0, latency_ms=9.0)



FAKE_ENGINE_PRICE = EnginePrice(gpu_usd_per_hour=0.80, prefill_tokens_per_s=20_000,
                                decode_tokens_per_s=130)
"""What a fake engine declares: fixed here, so the cost caps the tests set bite at the
step they expect whatever the embedded engines' calibration says."""

class FakeActivities:
    """Records what the workflow asked for; keeps each job's transcript the way the
    real inference worker does (append at base_len), so prompts can be rebuilt."""

    def __init__(self, script: Script, engines: list[str] | None = None,
                 tool_output: Callable[[ToolRequest], ToolResult] | None = None, *,
                 models: dict[str, str] | None = None,
                 prices: dict[str, EnginePrice | None] | None = None) -> None:
        self.script = script
        self.engines = engines or ["fake0"]
        self.models = models or {}
        """Model each engine serves (default "tiny")."""
        self.prices = prices
        """Price each engine declares (None: none); default: all at the embedded price.
        Like the real worker, generate fills a step's cost_usd from it."""
        self.tool_output = tool_output or (lambda r: ToolResult(ok=True, output=f"{r.name} ok"))
        self.generate_requests: list[GenerateRequest] = []
        self.prompts: list[list[ChatMessage]] = []
        self.transcripts: dict[str, list[ChatMessage]] = {}
        self.tool_requests: list[ToolRequest] = []
        self.picks: list[PickEngineRequest] = []
        self.routes: list[RouteRequest] = []
        self.forced_routes: list[str] = []
        """Engines the next routes go to regardless of the score (e.g. a dead one)."""
        self.stored: list[StoreTranscriptRequest] = []
        self.chunks_stored: list[StoreTranscriptRequest] = []
        """Chunked appends (their messages dropped, to keep memory down)."""
        self.loads: list[LoadTranscriptRequest] = []
        self.pauses: list[RecordPauseRequest] = []
        self.prewarms: list[GenerateRequest] = []
        self.served_by: list[str] = []
        """The engine whose task queue each generate ran on."""
        self.hang: dict[str, int] = {}
        """Activity ("generate", "run_tool", "route_step") -> which of its calls (1-based)
        never answers: that call sets ``hanging`` and waits until it is cancelled."""
        self.hanging = asyncio.Event()
        self.alive: set[str] = set(self.engines)
        """Engines the registry says are alive (a worker heartbeats them)."""
        self.alive_asked: list[str] = []
        self.asked_alive = asyncio.Event()
        self.alive_fails = False
        """``engine_alive`` fails every call (nobody can tell: the step fails over)."""
        self.pause_stats_fail = False
        """``record_pause`` fails every call (its statistics are best effort)."""
        self.windows: list[BatchWindow | None] = []
        """What ``batch_window`` answers, one per call (the last repeats); None fails it."""
        self.window_asks: list[BatchWindowRequest] = []
        self._calls: dict[str, int] = {}
        self._rr = itertools.count()

    async def _maybe_hang(self, name: str) -> None:
        self._calls[name] = self._calls.get(name, 0) + 1
        if self.hang.get(name) == self._calls[name]:
            self.hanging.set()
            await asyncio.Event().wait()  # until the worker cancels it

    def model_of(self, engine: str) -> str:
        return self.models.get(engine, "tiny")

    def price_of(self, engine: str) -> EnginePrice | None:
        return FAKE_ENGINE_PRICE if self.prices is None else self.prices.get(engine)

    def _eligible(self, model: str | None, require_price: bool) -> list[str]:
        """The engines that may serve the job, refused the way route_step refuses."""
        offers = [EngineOffer(engine_id=e, model=self.model_of(e),
                              priced=self.price_of(e) is not None) for e in self.engines]
        try:
            return eligible_engines(offers, model=model, require_price=require_price)
        except UnservableStepError as e:
            raise ApplicationError(str(e), type=e.error_type, non_retryable=True) from None

    @activity.defn(name="record_pause")
    async def record_pause(self, req: RecordPauseRequest) -> None:
        self.pauses.append(req)
        if self.pause_stats_fail:
            raise ApplicationError("pause statistics unavailable")

    @activity.defn(name="prewarm")
    async def prewarm(self, req: GenerateRequest) -> GenerateResult:
        self.prewarms.append(req)
        return reply(None)

    @activity.defn(name="route_step")
    async def route_step(self, req: RouteRequest) -> RouteDecision:
        """The real scoring function over engines with no load and no cache knowledge."""
        self.routes.append(req)
        await self._maybe_hang("route_step")
        fit = self._eligible(req.model, req.require_price)
        live = [e for e in fit if e not in req.exclude]
        if not live:
            raise ApplicationError("no live engine", non_retryable=True)
        if self.forced_routes:
            return RouteDecision(engine_id=self.forced_routes.pop(0), reason="least_loaded")
        return choose_engine([EngineCandidate(engine_id=e) for e in live], job_id=req.job_id,
                             last_engine=req.last_engine, failover=bool(req.exclude),
                             policy=req.policy)

    @activity.defn(name="engine_alive")
    async def engine_alive(self, req: EngineAliveRequest) -> bool | None:
        self.alive_asked.append(req.engine_id)
        self.asked_alive.set()
        if self.alive_fails:
            raise ApplicationError("registry client broken")
        return req.engine_id in self.alive

    @activity.defn(name="batch_window")
    async def batch_window(self, req: BatchWindowRequest) -> BatchWindow:
        self.window_asks.append(req)
        answers = self.windows or [BatchWindow(window=3, fit=3, why="fake fleet: fit 3")]
        answer = answers[min(len(self.window_asks), len(answers)) - 1]
        if answer is None:
            raise ApplicationError("registry worker gone")
        return answer

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
        held = self.transcripts.get(req.job_id, [])
        assert len(held) >= req.base_len, "workflow skipped transcript messages"
        self.transcripts[req.job_id] = held[: req.base_len] + req.new_messages
        profile = get_profile(req.profile)
        self.prompts.append(assemble_prompt(profile, profile.validate_task(req.task),
                                            self.transcripts[req.job_id], tail=req.tail))
        self.generate_requests.append(req)
        await self._maybe_hang("generate")
        result = self.script(req)
        engine = activity.info().task_queue.removeprefix("engine.")
        self.served_by.append(engine)
        price = self.price_of(engine)
        if result.cost_usd is None and price is not None:
            result = result.model_copy(update={"cost_usd": price.cost(
                prompt_tokens=result.prompt_tokens, cached_tokens=result.cached_tokens,
                completion_tokens=result.completion_tokens)})
        if req.route_next is not None and not finishes_job(profile, result.tool_calls):
            # as the real worker: the job's next step routed here, by route_step itself;
            # a refusal leaves the next step to route itself
            try:
                nxt: RouteDecision | None = await self.route_step(req.route_next.model_copy(
                    update={"last_engine": engine, "mark_in_flight": False}))
            except ApplicationError:
                nxt = None
            result = result.model_copy(update={"next_route": nxt})
        return result

    @activity.defn(name="run_tool")
    async def run_tool(self, req: ToolRequest) -> ToolResult:
        self.tool_requests.append(req)
        await self._maybe_hang("run_tool")
        return self.tool_output(req)

    @activity.defn(name="store_transcript")
    async def store_transcript(self, req: StoreTranscriptRequest) -> str:
        """As the real one: a small transcript in one call; a big one appended to the
        message store (``transcripts``) in chunks, then recorded whole."""
        if req.base_len == 0 and req.complete:
            self.stored.append(req)
        else:
            held = self.transcripts.get(req.job_id, [])
            if len(held) < req.base_len:
                raise ApplicationError("gap", type="TranscriptGap", non_retryable=True)
            self.transcripts[req.job_id] = held[: req.base_len] + req.transcript
            self.chunks_stored.append(req.model_copy(update={"transcript": []}))
            if req.complete:
                self.stored.append(StoreTranscriptRequest(
                    job_id=req.job_id, transcript=self.transcripts[req.job_id]))
        return f"transcripts/{req.job_id}.json"

    @activity.defn(name="load_transcript")
    async def load_transcript(self, req: LoadTranscriptRequest) -> list[ChatMessage]:
        held = self.transcripts.get(req.job_id, [])
        if len(held) < req.end:
            raise ApplicationError("gap", type="TranscriptGap", non_retryable=True)
        out: list[ChatMessage] = []
        size = 0
        for m in held[req.start:req.end]:
            n = len(m.model_dump_json())
            if out and size + n > req.max_bytes:
                break
            out.append(m)
            size += n
        self.loads.append(req)
        return out
