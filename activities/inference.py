"""The vLLM client: one ``generate`` activity served by the worker beside each engine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections.abc import AsyncIterator, Callable, Coroutine
from typing import Any, Protocol, TypeGuard

import httpx
import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from warmloop.activities.admission import BatchAdmission
from warmloop.activities.cachebust import CacheBustDetector, reference_family
from warmloop.activities.directory import PrefixDirectory, PromptChain, prompt_chain
from warmloop.activities.grounding import context_text, grounded_constraint, parse_hermes_call
from warmloop.activities.holds import HoldManager, pause_kind
from warmloop.activities.registry import (
    REDIS_ERRORS,
    EngineHeartbeat,
    EngineRegistry,
    RedisOutage,
    TenantUsage,
    step_key,
)
from warmloop.activities.trace_prompts import TracePromptStore
from warmloop.activities.transcripts import TranscriptStore
from warmloop.workflows import tool_loading
from warmloop.workflows.contracts import (
    ENGINE_ERROR,
    AttemptSpend,
    ChatMessage,
    FunctionCall,
    GenerateRequest,
    GenerateResult,
    Lane,
    RouteRequest,
    StepTiming,
    ToolCall,
)
from warmloop.workflows.holding import (
    PREWARM_DECLINED,
    PREWARM_SKIPPED,
    HoldAction,
    prewarm_worthwhile,
)
from warmloop.workflows.pricing import EnginePrice
from warmloop.workflows.profiles import Profile, get_profile
from warmloop.workflows.prompt import (
    assemble_prompt,
    canonical_json,
    prompt_hash,
    request_tools,
)
from warmloop.workflows.routing import RouteDecision
from warmloop.workflows.tenants import cache_salt, scoped
from warmloop.workflows.trace import is_trace_profile

log = structlog.get_logger(__name__)

# Error types the workflow acts on. These two are never retried by Temporal:
CONTEXT_OVERFLOW = "ContextOverflow"
ENGINE_REJECTED = "EngineRejected"
# and this one is: ENGINE_ERROR (workflows/contracts.py)

RECORD_TIMEOUT_S = 2.0
"""Longest a step waits on Redis for its prefix directory and cache-bust records."""
ROUTE_NEXT_BUDGET_S = 0.25
"""Longest a step spends routing its job's next step (``GenerateRequest.route_next``)
before it returns without one: the next step then routes itself, as it would anyway."""
STEP_DONE_TIMEOUT_S = 1.0
"""Longest a step waits on Redis to leave the in-flight set."""
MAX_JOBS_SEEN = 10_000
"""Jobs whose latest step the worker remembers (for holds decided after a step)."""
MAX_UNDONE = 10_000
"""Steps kept to take off the in-flight set once Redis is back (the oldest go first)."""
HOLD_ERRORS: tuple[type[Exception], ...] = (httpx.HTTPError, ValueError, *REDIS_ERRORS)
"""What a hold decision may meet (the engine, Redis): it costs the hold, not the step."""
NEXT_ROUTE_ERRORS: tuple[type[Exception], ...] = (ApplicationError, *REDIS_ERRORS)
"""What routing the next step may meet: a refusal (a tenant's spent hour, no engine), or
Redis away or slow (``TimeoutError``). It costs the next step a route of its own."""


def _prefix_record_skipped(profile: str, reason: str) -> None:
    """Count a step whose directory, accuracy and bust records were not written: the
    directory is advice, so a skip costs a later step's prediction, not this step, and
    operators (and the tests) see how many predictions a Redis blip took away."""
    activity.metric_meter().create_counter(
        "warmloop_prefix_records_skipped",
        "Steps whose prefix-directory records were skipped (Redis away or failing).",
    ).add(1, {"profile": profile, "reason": reason})


class StepRouter(Protocol):
    """What routes a job's next step from the inference worker (``RoutingActivities``,
    the agent worker's own routing code, built once per worker)."""

    async def route_step(self, req: RouteRequest) -> RouteDecision: ...


class InferenceActivities:
    """Talks to one engine through its OpenAI-compatible API.

    Assembles the step's prompt from the profile (stable prefix), the task, the stored
    transcript and the budget tail; streams the response so TTFT is measured; asks for
    the usage chunk so the engine's own ``cached_tokens`` comes back with every step, and
    prices the step at the engine's declared ``price`` (``cost_usd``; None without one).

    A step of a tenant's job carries the tenant's ``cache_salt`` (none for the default
    tenant): its prefix is cached for that tenant alone. ``usage``: each step's tokens
    are counted against the tenant's hourly quota.
    """

    def __init__(self, *, engine_id: str, base_url: str, model: str,
                 http: httpx.AsyncClient, transcripts: TranscriptStore,
                 directory: PrefixDirectory | None = None,
                 registry: EngineRegistry | None = None,
                 detector: CacheBustDetector | None = None,
                 engine_info: Callable[[], EngineHeartbeat | None] | None = None,
                 admission: BatchAdmission | None = None,
                 holds: HoldManager | None = None,
                 price: EnginePrice | None = None,
                 trace_prompts: TracePromptStore | None = None,
                 outage: RedisOutage | None = None,
                 usage: TenantUsage | None = None,
                 grounded_arguments: bool = False,
                 router: StepRouter | None = None) -> None:
        self._engine_id = engine_id
        self._router = router  # routes a job's next step when the step asks (route_next)
        self._grounded = grounded_arguments  # id arguments only from the job's text
        self._usage = usage  # tenants' tokens per hour (their quota)
        self._outage = outage or RedisOutage()
        self._undone: list[str] = []
        """Step keys still in the engine's in-flight set (Redis was away at their end)."""
        self._trace_prompts = trace_prompts  # inline prompts of replayed traces
        self._price = price  # the engine's declared price (else its calibration's)
        self._base = base_url.rstrip("/")
        self._url = self._base + "/v1/chat/completions"
        self._model = model
        self._http = http
        self._transcripts = transcripts
        self._dir = directory
        self._registry = registry
        self._detector = detector
        self._engine_info = engine_info or (lambda: None)
        self._admission = admission
        self._holds = holds
        self._stable_tokens: dict[str, int] = {}
        self._profile_stable: dict[str, int] = {}
        self._tail_overhead: int | None = None
        self._tail_lengths: dict[str, int] = {}
        self._bookkeeping: set[asyncio.Task[None]] = set()
        """Directory, bust and hold work of steps already returned (``drain`` awaits it)."""
        self._latest_step: dict[str, int] = {}
        """The latest step of each recent job that reached this worker, oldest first: a
        hold decided after the job's next step is here would outlive its use."""

    async def _profile(self, req: GenerateRequest) -> Profile:
        """The step's profile: a replayed trace's from ``trace_prompts``, else by name."""
        if self._trace_prompts is not None and is_trace_profile(req.profile):
            return await self._trace_prompts.profile(req.profile)
        return get_profile(req.profile)

    async def _body(self, req: GenerateRequest
                    ) -> tuple[dict[str, Any], Profile, asyncio.Future[Any]]:
        profile = await self._profile(req)
        transcript, stored = await self._transcripts.extend_deferred(
            req.job_id, req.base_len, req.new_messages)
        messages = assemble_prompt(profile, profile.validate_task(req.task), transcript,
                                   tail=req.tail, tools=req.tools)
        salt = cache_salt(req.tenant)
        tools = request_tools(profile, req.tools)
        body = {
            "model": self._model,
            "messages": [m.to_openai() for m in messages],
            "tools": tools,
            # `required` + strict schemas: the engine's guided decoding makes the output
            # a parseable call, even from a weak model.
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": req.max_tokens,
            "temperature": profile.temperature,
            "stream": True,
            "stream_options": {"include_usage": True},
            "priority": req.priority,
            # The prompt's token ids come back in the first chunk: the prefix directory
            # hashes them in the engine's own blocks.
            "return_token_ids": self._dir is not None,
            # vLLM mixes the salt into the prompt's first block: the tenant's own cache
            **({} if salt is None else {"cache_salt": salt}),
        }
        if profile.tools_on_demand:
            body.update(_on_demand_constraint(profile, transcript, req.tools))
        elif self._grounded:
            body.update(grounded_constraint(tools, context_text(req.task, transcript)))
        if req.logprobs:  # a ladder's step: how sure the model was of its call
            body.update({"logprobs": True, "top_logprobs": 0})
        return body, profile, stored

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        entered = time.time()
        self._saw_step(req.job_id, req.step)
        structlog.contextvars.bind_contextvars(
            job_id=req.job_id, step=req.step, engine=self._engine_id
        )
        if self._holds is not None:
            self._holds.resume(req.job_id)
        in_flight = (step_key(req.job_id, req.step, scoped(req.tenant, req.profile))
                     if self._registry is not None else None)
        # a step routed ahead is counted as load here, off its path (its removal waits
        # for this write: one landing after it would leave the step counted)
        counted = (asyncio.create_task(self._step_started(in_flight))
                   if req.mark_in_flight and in_flight is not None else None)
        # this step's earlier attempts' spend: every beat repeats it, so the next attempt
        # reads it even after this one dies without a word
        details = activity.info().heartbeat_details
        earlier = AttemptSpend.from_details(details[0] if details else None)
        beat = _beat(earlier)
        try:
            slot = time.perf_counter()
            async with self._batch_slot(req, beat), _heartbeating(beat):
                admission_ms = (time.perf_counter() - slot) * 1000
                if self._admission is not None and req.lane == Lane.BATCH:
                    # the batch lane's wait for one of the engine's K slots (dashboards)
                    activity.metric_meter().create_histogram_float(
                        "warmloop_batch_admission_wait", "batch step's wait for a slot", "ms"
                    ).record(admission_ms, {"profile": req.profile})
                try:
                    result, last_token = await self._generate(req, entered=entered,
                                                              admission_ms=admission_ms,
                                                              in_flight=in_flight,
                                                              counted=counted)
                except ApplicationError as e:
                    if e.type == ENGINE_ERROR:
                        raise self._failed_attempt(req, e, earlier) from None
                    if earlier.attempts and not e.details:
                        # not the engine's failure, but earlier attempts were: their
                        # spend goes with this last failure to the workflow
                        raise ApplicationError(e.message, earlier.model_dump(), type=e.type,
                                               non_retryable=e.non_retryable) from None
                    raise
                in_flight = None  # taken off the in-flight set beside the records
                if earlier.attempts:
                    result.failed_attempts = earlier
            if self._admission is not None and req.lane == Lane.INTERACTIVE:
                await self._admission.observe_interactive(result.ttft_ms)
            elif self._admission is not None:
                self._admission.observe_batch(result.prompt_tokens,
                                              self._profile_stable.get(req.profile, 0))
        finally:
            if self._registry is not None and in_flight is not None:
                # a step that failed: off the in-flight set before the error returns
                await self._step_done(self._registry, in_flight, after=counted)
            structlog.contextvars.unbind_contextvars("job_id", "step", "engine")
        result.returned_at = time.time()
        if result.timing is not None:
            result.timing.after_ms = max(0.0, (result.returned_at - last_token) * 1000)
        return result

    def _saw_step(self, job_id: str, step: int) -> None:
        latest = max(step, self._latest_step.pop(job_id, 0))
        self._latest_step[job_id] = latest  # (re)inserted last: the newest job
        if len(self._latest_step) > MAX_JOBS_SEEN:
            del self._latest_step[next(iter(self._latest_step))]

    def _after_return(self, work: Coroutine[Any, Any, None]) -> None:
        """Run a step's advisory bookkeeping after the step has returned. The task copies
        the step's context (its log fields, its activity for metrics)."""
        task = asyncio.create_task(work)
        self._bookkeeping.add(task)
        task.add_done_callback(self._bookkeeping_done)

    def _bookkeeping_done(self, task: asyncio.Task[None]) -> None:
        self._bookkeeping.discard(task)
        if not task.cancelled() and task.exception() is not None:
            log.error("step_bookkeeping_failed", error=repr(task.exception()))

    async def drain(self, timeout_s: float = 5.0) -> int:
        """Wait up to ``timeout_s`` for the bookkeeping of steps already returned (a
        worker's shutdown); returns how many were still running and were cancelled. A
        cancelled one costs later steps a prediction or a hold, never a step."""
        if not self._bookkeeping:
            return 0
        _, pending = await asyncio.wait(set(self._bookkeeping), timeout=timeout_s)
        for task in pending:
            task.cancel()
        return len(pending)

    async def _step_started(self, key: str) -> None:
        """Count a step routed ahead (during its job's pause) as load on this engine, beside
        its prompt's assembly. Best effort, like the rest of the in-flight set."""
        registry = self._registry
        assert registry is not None
        await self._outage.attempt(
            "in-flight steps", lambda: registry.step_routed(self._engine_id, key), None,
            timeout_s=STEP_DONE_TIMEOUT_S)

    async def _step_done(self, registry: EngineRegistry, key: str, *,
                         after: asyncio.Task[None] | None = None) -> None:
        """Take the step off the engine's in-flight set. Best effort: the set is the
        router's load signal, and Redis away must not fail a step the engine served. A
        key Redis missed is kept and goes with the next step's, so the router does not
        count it as load for ``INFLIGHT_MAX_AGE_S``."""
        if after is not None:
            await after  # the step's own in-flight write, bounded by its timeout
        keys, self._undone = [*self._undone, key], []

        async def write() -> bool:
            await registry.steps_done([(self._engine_id, k) for k in keys])
            return True

        if not await self._outage.attempt("in-flight steps", write, False,
                                          timeout_s=STEP_DONE_TIMEOUT_S):
            self._undone = [*keys, *self._undone][-MAX_UNDONE:]

    def _failed_attempt(self, req: GenerateRequest, e: ApplicationError,
                        earlier: AttemptSpend) -> ApplicationError:
        """The engine failed this attempt: ``e`` again, its first detail now every
        attempt's spend so far (this one's usage as the engine reported it, at its
        price), also beaten as the activity's heartbeat details: Temporal (1.16 and
        later) sends them with the failure and hands them to the next attempt. This
        attempt's tokens go onto the tenant's hour: the engine computed them."""
        reported = AttemptSpend.from_details(e.details[0] if e.details else None)
        cost = self._step_cost(prompt_tokens=reported.prompt_tokens,
                               cached_tokens=reported.cached_tokens,
                               completion_tokens=reported.completion_tokens)
        this = reported.model_copy(update={
            "attempts": 1, "cost_usd": cost or 0.0, "unpriced_attempts": int(cost is None)})
        spent = earlier.plus(this)
        activity.heartbeat(spent.model_dump())
        if this.tokens:
            self._after_return(self._count_tokens(req.tenant, this.tokens))
        return ApplicationError(e.message, spent.model_dump(), type=ENGINE_ERROR,
                                non_retryable=e.non_retryable)

    @contextlib.asynccontextmanager
    async def _batch_slot(self, req: GenerateRequest,
                          beat: Callable[[], None]) -> AsyncIterator[None]:
        """Batch steps wait for one of the engine's K batch slots; others go straight on.
        ``beat``: the step's heartbeat while it waits."""
        if self._admission is None or req.lane != Lane.BATCH:
            yield
            return
        await self._admission.acquire(req.job_id, on_wait=beat)
        try:
            yield
        finally:
            await self._admission.release()

    @activity.defn(name="prewarm")
    async def prewarm(self, req: GenerateRequest) -> GenerateResult:
        """Prefill a paused job's prompt again (one output token) so that its next step,
        routed here, finds it cached: sent when an approver opens or decides the job's
        pending approval. The workflow does not count it as a step.

        Skipped (nothing sent; ``finish_reason`` ``PREWARM_SKIPPED``) while the engine
        reports requests waiting: ``holding.prewarm_worthwhile``."""
        info = self._engine_info()
        if info is not None and not prewarm_worthwhile(info.waiting):
            return self._not_prewarmed(PREWARM_SKIPPED)
        if await self._hold_declined(req):
            return self._not_prewarmed(PREWARM_DECLINED)
        result = await self.generate(req)
        if self._holds is not None:
            await self._holds.record_prewarm(result.prompt_tokens, result.cached_tokens)
        return result

    def _not_prewarmed(self, reason: str) -> GenerateResult:
        return GenerateResult(engine_id=self._engine_id, model=self._model,
                              finish_reason=reason, prompt_tokens=0, cached_tokens=0,
                              completion_tokens=0, ttft_ms=0.0, latency_ms=0.0)

    async def _hold_declined(self, req: GenerateRequest) -> bool:
        """A pre-warm on an approval's opening (it names the wait it would hold through
        and the prompt's size): whether the hold model would not hold through it, or its
        hold would be let go for room before the decision (``holding.hold_lasts_the_wait``).
        Such a pre-warm is then not sent: let go before the decision, the prompt would be
        computed again by the decision's pre-warm. Advice: any failure sends it."""
        if (self._holds is None or req.prompt_tokens_hint is None or not req.pause_kind
                or req.hold_policy != "cost_model"):
            return False
        try:
            profile = await self._profile(req)
            wait = await self._holds.pause_distribution(profile, req.pause_kind)
            choice = await self._holds.decide(
                profile=profile,
                kind=req.pause_kind, prefix_tokens=req.prompt_tokens_hint,
                policy=req.hold_policy, interactive=req.lane == Lane.INTERACTIVE, pauses=wait)
            if choice is None:
                return False
            if choice.action == HoldAction.HOLD:
                if await self._holds.lasts_the_wait(
                        job_id=req.job_id, profile=profile, kind=req.pause_kind,
                        prompt_tokens=req.prompt_tokens_hint, wait=wait):
                    return False
                reason = "the cap would let it go before the decision"
            else:
                reason = choice.reason
        except Exception as e:  # noqa: BLE001 - advice: the pre-warm goes as before
            log.warning("prewarm_hold_decision_failed", job_id=req.job_id, error=str(e))
            return False
        log.info("prewarm_declined", job_id=req.job_id, kind=req.pause_kind,
                 prompt_tokens=req.prompt_tokens_hint, reason=reason)
        return True

    async def _generate(self, req: GenerateRequest, *, entered: float, admission_ms: float,
                        in_flight: str | None = None, counted: asyncio.Task[None] | None = None
                        ) -> tuple[GenerateResult, float]:
        """The step, and when its last token came (the start of its ``after_ms``).
        ``in_flight``: the step's key in the engine's in-flight set, removed beside the
        step's S3 write and directory records (all on the step's path, none waiting for
        another)."""
        picked_up = time.time()
        body, profile, stored = await self._body(req)
        tail_tokens = (asyncio.ensure_future(self._tail_tokens(req.tail))
                       if self._dir is not None else None)
        started = time.perf_counter()
        sent_at = time.time()
        info = activity.info()
        scheduled = info.current_attempt_scheduled_time.timestamp()
        handed = info.started_time.timestamp()
        dispatch_ms = max(0.0, (sent_at - scheduled) * 1000)
        stream = StepStream()
        try:
            async with self._http.stream("POST", self._url, json=body) as resp:
                if resp.status_code != 200:
                    await self._raise_for(resp)
                async for line in resp.aiter_lines():
                    if stream.feed(line, time.perf_counter()):
                        break
            stream.finish()
        except (BrokenStreamError, httpx.HTTPError) as e:
            if tail_tokens is not None:
                tail_tokens.cancel()
            raise self._engine_error(e, stream) from None
        done = time.perf_counter()
        last_token = time.time()
        first_token, first_delta = stream.first_token, stream.first_delta
        usage = stream.reported()
        prompt_tokens, cached_tokens = usage["prompt_tokens"], usage["cached_tokens"]
        completion_tokens = usage["completion_tokens"]
        calls, prompt_ids = stream.calls, stream.prompt_ids
        content = "".join(stream.content)
        tool_calls = [
            ToolCall(id=c["id"] or f"call-{req.job_id}-{req.step}-{i}",
                     function=FunctionCall(name=c["name"], arguments="".join(c["arguments"])))
            for i, c in sorted(calls.items())
        ]
        if profile.tools_on_demand and not tool_calls:
            content, tool_calls = _on_demand_call(content, f"call-{req.job_id}-{req.step}-0")
        elif self._grounded and not tool_calls:
            content, tool_calls = parse_hermes_call(content, f"call-{req.job_id}-{req.step}-0")
        result = GenerateResult(
            engine_id=self._engine_id,
            model=self._model,
            attempt=activity.info().attempt,
            content=content,
            tool_calls=tool_calls,
            finish_reason=stream.finish_reason,
            logprob_mean=(sum(stream.logprobs) / len(stream.logprobs)
                          if stream.logprobs else None),
            logprob_min=min(stream.logprobs) if stream.logprobs else None,
            logprob_tokens=len(stream.logprobs),
            prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
            completion_tokens=completion_tokens,
            ttft_ms=((first_token or done) - started) * 1000,
            latency_ms=(done - started) * 1000,
            dispatch_ms=dispatch_ms,
            prompt_hash=prompt_hash(body["messages"], body["tools"]),
            cost_usd=self._step_cost(prompt_tokens=prompt_tokens,
                                     cached_tokens=cached_tokens,
                                     completion_tokens=completion_tokens),
            scheduled_at=scheduled,
            timing=StepTiming(
                schedule_to_start_ms=max(0.0, (handed - scheduled) * 1000),
                worker_pickup_ms=max(0.0, (entered - handed) * 1000),
                prompt_ms=max(0.0, (sent_at - entered) * 1000 - admission_ms),
                admission_ms=admission_ms,
                ttft_ms=((first_token or done) - started) * 1000,
                decode_ms=(done - (first_token or done)) * 1000),
        )
        log.info("step_generated", prompt_tokens=result.prompt_tokens,
                 cached_tokens=result.cached_tokens, ttft_ms=round(result.ttft_ms, 1),
                 first_delta_ms=round(((first_delta or done) - started) * 1000, 1),
                 latency_ms=round(result.latency_ms, 1),
                 dispatch_ms=round(dispatch_ms, 1),
                 pickup_ms=round((picked_up - scheduled) * 1000, 1))
        # the tenant's quota lags by the step's bookkeeping, not by a step
        self._after_return(self._count_tokens(req.tenant, prompt_tokens + completion_tokens))
        # On the step's path, all at once: the job's next step may be routed the moment
        # this one returns (a load_tools step the workflow answers itself; the next
        # step's route taken during the pause) and must find this prompt's chain and
        # not see this step as load. The hold decision runs after the step returns.
        off_flight = ([self._step_done(self._registry, in_flight, after=counted)]
                      if self._registry is not None and in_flight is not None else [])
        if tail_tokens is not None and prompt_ids:
            await asyncio.gather(stored, *off_flight, self._record_and_hold(
                req, profile, body, prompt_ids, tail_tokens, result))
        else:
            if tail_tokens is not None:
                tail_tokens.cancel()
            # the step's new messages are in S3 before it counts as done
            await asyncio.gather(stored, *off_flight)
        if req.route_next is not None and not finishes_job(profile, tool_calls):
            # after the directory records: the route must find this prompt's chain
            result.next_route = await self._route_next(req.route_next)
        return result, last_token

    async def _route_next(self, req: RouteRequest) -> RouteDecision | None:
        """The job's next step's route, from this worker's registry and directory reads
        (the same ``route_step`` the agent worker runs), or None for the step to route
        itself: no router here, Redis away or slow, or the step refused (a tenant's spent
        hour, no engine): the step asks again and waits or ends as it should."""
        if self._router is None or self._outage.away:
            return None
        try:
            async with asyncio.timeout(ROUTE_NEXT_BUDGET_S):
                return await self._router.route_step(
                    req.model_copy(update={"last_engine": self._engine_id,
                                           "mark_in_flight": False}))
        except NEXT_ROUTE_ERRORS as e:
            log.info("next_route_skipped", job_id=req.job_id, step=req.step,
                     why=type(e).__name__)
            return None

    async def _count_tokens(self, tenant: str, tokens: int) -> None:
        """The step's tokens onto its tenant's hour (its quota). Best effort: while Redis
        is away they go uncounted, and the quota lets the tenant's jobs on."""
        usage = self._usage
        if usage is None:
            return
        await self._outage.attempt("tenant usage", lambda: usage.add(tenant, tokens), None,
                                   timeout_s=RECORD_TIMEOUT_S)

    async def _record_and_hold(self, req: GenerateRequest, profile: Profile,
                               body: dict[str, Any], prompt_ids: list[int],
                               tail_tokens: asyncio.Future[int],
                               result: GenerateResult) -> None:
        """The step's prefix into the directory and the cache-bust detector (Redis),
        then the hold decision (kept in this process; made after the step returns). All
        advice: losing one costs a cache hit, not the step, so nothing here fails it.
        While Redis is away the records are skipped (logged once per outage) and the
        hold is still kept."""
        try:
            info = self._engine_info()
            block_size = info.block_size if info else 16
            chain = prompt_chain(prompt_ids, block_size, tail_tokens=await tail_tokens,
                                 salt=cache_salt(req.tenant))
            stable = (await self._stable_prefix_tokens(profile, body)
                      if self._detector is not None else None)
        except (httpx.HTTPError, OSError, ValueError, KeyError) as e:
            log.warning("prefix_record_failed", error=str(e))
            _prefix_record_skipped(req.profile, "engine")
            return
        if stable is not None:
            self._profile_stable[profile.name] = stable
        if self._outage.should_try():
            try:
                async with asyncio.timeout(RECORD_TIMEOUT_S):
                    await self._record_prefix(req, profile, chain, stable, result.cached_tokens)
            except REDIS_ERRORS as e:
                self._outage.failed(e, what="prefix directory")
                _prefix_record_skipped(req.profile, "redis")
            except ValueError as e:
                log.warning("prefix_record_failed", error=str(e))
                _prefix_record_skipped(req.profile, "invalid")
            else:
                self._outage.ok()
        else:
            _prefix_record_skipped(req.profile, "redis")
        self._after_return(self._hold_after_return(req, profile, result, prompt_ids, chain,
                                                   body))

    async def _hold_after_return(self, req: GenerateRequest, profile: Profile,
                                 result: GenerateResult, prompt_ids: list[int],
                                 chain: PromptChain, body: dict[str, Any]) -> None:
        try:
            await self._hold_or_release(req, profile, result, prompt_ids, chain, body)
        except HOLD_ERRORS as e:
            log.warning("hold_failed", error=str(e))

    # ---- prefix directory and cache-bust detector ----------------------------------------

    async def _hold_or_release(self, req: GenerateRequest, profile: Profile,
                               result: GenerateResult, prompt_ids: list[int],
                               chain: PromptChain, body: dict[str, Any]) -> None:
        if self._holds is None:
            return
        self._holds.observe_step(uncached_tokens=result.prompt_tokens - result.cached_tokens,
                                 ttft_s=result.ttft_ms / 1000)
        if self._latest_step.get(req.job_id, req.step) > req.step:
            return  # the job's next step is already here: nothing to hold for
        if req.pause_kind is not None:  # replayed: the job waits on the recorded call
            kind = req.pause_kind or None
        elif len(result.tool_calls) == 1:
            call = result.tool_calls[0].function
            kind = pause_kind(profile, call.name, call.arguments)
        else:
            return
        await self._holds.after_step(
            job_id=req.job_id, profile=profile, kind=kind,
            # the reusable full blocks plus one token: a touch then computes that token
            # alone, where a prompt of whole blocks would recompute its last block
            prefix_tokens=prompt_ids[:chain.reusable_blocks * chain.block_size + 1]
            if chain.reusable_blocks else [],
            policy=req.hold_policy, interactive=req.lane == Lane.INTERACTIVE, body=body,
            block_hashes=chain.hashes[:chain.reusable_blocks], block_size=chain.block_size,
            salt=cache_salt(req.tenant), step=req.step)

    async def _record_prefix(self, req: GenerateRequest, profile: Profile, chain: PromptChain,
                             stable_tokens: int | None, cached_tokens: int) -> None:
        """The Redis half of the step's bookkeeping (its inputs are computed before, so
        that a bound on it bounds only Redis)."""
        assert self._dir is not None
        info = self._engine_info()
        block_size = chain.block_size
        detect = self._detector is not None and stable_tokens is not None
        # a tenant's stable prefix is its own (salted) chain, kept under its own name
        owner = scoped(req.tenant, profile.name)
        stable_blocks = (stable_tokens or 0) // block_size
        family = (reference_family(owner, hashes=chain.hashes, stable_blocks=stable_blocks,
                                   tools=req.tools) if detect else None)
        capacity = None
        if info is not None and not info.precise and info.kv_capacity_tokens:
            capacity = info.kv_capacity_tokens // block_size
        # One round trip (it is on the step's path): the job's chain as it stood (the
        # detector's "previous") and the family's reference are read before the new
        # chain is written, with the accuracy counters.
        record = await self._dir.record_step(
            self._engine_id, req.job_id, chain, capacity_blocks=capacity,
            accuracy=(req.expected_cached_tokens, cached_tokens)
            if req.expected_cached_tokens is not None else None,
            read_previous=detect and req.step > 1, family=family, step=req.step)
        if self._detector is not None and stable_tokens is not None:
            await self._detector.judge(
                profile=owner, job_id=req.job_id, step=req.step,
                hashes=chain.hashes, block_size=block_size, stable_blocks=stable_blocks,
                previous=record.previous_job_chain, reference=record.profile_chain,
                tools=req.tools)

    async def _tokenize(self, payload: dict[str, Any]) -> list[int]:
        r = await self._http.post(self._base + "/tokenize",
                                  json={"model": self._model, **payload}, timeout=10.0)
        r.raise_for_status()
        return list(r.json()["tokens"])

    async def _tail_tokens(self, tail: str) -> int:
        """Tokens the volatile tail takes at the end of the prompt: its text, its message
        framing and the generation prompt (the framing is measured once)."""
        if self._tail_overhead is None:
            probe = "x"
            framed = await self._tokenize({
                "messages": [{"role": "system", "content": "s"},
                             {"role": "user", "content": probe}],
                "add_generation_prompt": True})
            head = await self._tokenize({"messages": [{"role": "system", "content": "s"}],
                                         "add_generation_prompt": False})
            bare = await self._tokenize({"prompt": probe, "add_special_tokens": False})
            self._tail_overhead = max(0, len(framed) - len(head) - len(bare))
        n = self._tail_lengths.get(tail)
        if n is None:
            # Tails repeat across jobs (the same step of the same cap): one tokenize call
            # per distinct text, not one per step.
            n = len(await self._tokenize({"prompt": tail, "add_special_tokens": False}))
            if len(self._tail_lengths) >= 4096:
                self._tail_lengths.clear()
            self._tail_lengths[tail] = n
        return n + self._tail_overhead

    async def _stable_prefix_tokens(self, profile: Profile, body: dict[str, Any]) -> int:
        """Length in tokens of what every job of the profile shares (system prompt and
        tools): the common prefix of two renderings that differ only after it."""
        system, tools = body["messages"][0], body["tools"]
        key = canonical_json([system, tools])
        if key not in self._stable_tokens:
            a, b = [await self._tokenize({"messages": [system, {"role": "user", "content": u}],
                                          "tools": tools, "add_generation_prompt": False})
                    for u in ("a", "b")]
            n = 0
            while n < min(len(a), len(b)) and a[n] == b[n]:
                n += 1
            if len(self._stable_tokens) > 256:
                self._stable_tokens.clear()
            self._stable_tokens[key] = n
        return self._stable_tokens[key]

    def _step_cost(self, *, prompt_tokens: int, cached_tokens: int,
                   completion_tokens: int) -> float | None:
        """The step's dollars: at the engine's declared price, else at the price its
        calibration gives (its GPU hour over its measured throughput); None without
        either."""
        price = self._price
        if price is None:
            info = self._engine_info()
            if info is None or info.calibration is None:
                return None
            price = info.calibration.engine_price()
        return price.cost(prompt_tokens=prompt_tokens, cached_tokens=cached_tokens,
                          completion_tokens=completion_tokens)

    def _engine_error(self, cause: Exception, stream: StepStream) -> ApplicationError:
        """The step failed on the engine's side of a 200 answer (``ENGINE_ERROR``),
        with the tokens the engine reported before it failed: they were computed, and
        the engine's price applies to them."""
        what = (str(cause) if isinstance(cause, BrokenStreamError)
                else f"the stream broke: {type(cause).__name__}: {cause}")
        usage = stream.reported()
        log.warning("step_stream_failed", error=what, **usage)
        return ApplicationError(f"engine {self._engine_id}: {what}", usage, type=ENGINE_ERROR)

    async def _raise_for(self, resp: httpx.Response) -> None:
        body = (await resp.aread()).decode(errors="replace")[:500]
        if resp.status_code == 400 and "context length" in body:
            raise ApplicationError(f"prompt exceeds the engine's context: {body}",
                                   type=CONTEXT_OVERFLOW, non_retryable=True)
        if 400 <= resp.status_code < 500:
            raise ApplicationError(f"engine {self._engine_id} rejected the request "
                                   f"({resp.status_code}): {body}",
                                   type=ENGINE_REJECTED, non_retryable=True)
        # 5xx: retryable; Temporal's retry policy decides how often.
        raise ApplicationError(f"engine {self._engine_id} error {resp.status_code}: {body}",
                               type=ENGINE_ERROR)


def finishes_job(profile: Profile, calls: list[ToolCall]) -> bool:
    """Whether the step called a tool that ends the job (no next step to route)."""
    ending = {t.name for t in profile.tools if t.finishes_job}
    return any(c.function.name in ending for c in calls)


def _on_demand_constraint(profile: Profile, transcript: list[ChatMessage],
                          tools: list[str] | None) -> dict[str, Any]:
    """An on-demand step's constraint, apart from its ``tools``: those stay the same on
    every step (the chat template renders them into the cached prefix), while what the
    model may call grows as it loads tools. ``tool_choice: none`` leaves vLLM's own
    tool constraint out and its output as text; ``structured_outputs.json`` (vLLM 0.32:
    ``guided_json`` is dropped) is the exactly-one-call schema of the offered tools."""
    loaded = tool_loading.loaded_from_transcript(profile, transcript, tools)
    offered = tool_loading.offered(profile, transcript, tools)
    return {"tool_choice": "none",
            "structured_outputs": {"json": tool_loading.constraint_schema(
                profile, offered, loaded, tools)}}


def _on_demand_call(content: str, call_id: str) -> tuple[str, list[ToolCall]]:
    """An on-demand step's call, read from its constrained text (``[{"name",
    "parameters"}]``); the text unchanged and no call when it is not one (cut by
    max_tokens), which the workflow reads as an invalid step."""
    parsed = tool_loading.parse_call(content)
    if parsed is None:
        return content, []
    name, arguments = parsed
    return "", [ToolCall(id=call_id, function=FunctionCall(name=name, arguments=arguments))]


class BrokenStreamError(Exception):
    """The engine's stream is not a whole, well-formed step."""


class StepStream:
    """One step's SSE stream from vLLM's OpenAI-compatible server, read strictly.

    Only a stream of well-formed chunks that carries its usage and ends with
    ``[DONE]`` is a step. Anything else is the engine's failure (``feed`` and
    ``finish`` raise ``BrokenStreamError``): read leniently, an error event, a cut or
    a garbled chunk became an empty or partial tool call, which the workflow then
    blamed on the model (an invalid call) instead of retrying or failing over."""

    def __init__(self) -> None:
        self.content: list[str] = []
        self.calls: dict[int, dict[str, Any]] = {}
        self.usage: dict[str, int] | None = None
        self.prompt_ids: list[int] = []
        self.finish_reason: str | None = None
        self.first_token: float | None = None
        """When the first chunk with choices came (vLLM streams the role chunk when the
        first token is sampled; a tool call's first delta waits for its name)."""
        self.first_delta: float | None = None
        """When the first content or tool-call delta came."""
        self.done = False
        self.logprobs: list[float] = []
        """The output tokens' log-probabilities, when the request asked for them."""
        self._event = ""

    def reported(self) -> dict[str, int]:
        """The usage the engine reported (zeros before it did)."""
        return dict(self.usage or {"prompt_tokens": 0, "cached_tokens": 0,
                                   "completion_tokens": 0})

    def feed(self, line: str, now: float) -> bool:
        """Take one line of the stream; True at ``[DONE]`` (read no further)."""
        if not line:
            self._event = ""  # a blank line ends an event
            return False
        name, _, value = line.partition(":")
        value = value.removeprefix(" ")
        if name == "event":
            self._event = value.strip()
            return False
        if name != "data":
            return False  # comments (":..."), id, retry and unknown fields: SSE ignores them
        if value.strip() == "[DONE]":
            self.done = True
            return True
        try:
            chunk = json.loads(value)
        except (ValueError, RecursionError):
            raise BrokenStreamError(
                f"the engine sent data that is not JSON: {value[:120]!r}") from None
        if self._event == "error" or (isinstance(chunk, dict) and (
                "error" in chunk or chunk.get("object") == "error")):
            raise BrokenStreamError(f"an error event inside the stream: {_error_text(chunk)}")
        if not isinstance(chunk, dict):
            raise BrokenStreamError(f"the engine sent a chunk that is not an object: "
                                    f"{value[:120]!r}")
        self._take(chunk, now)
        return False

    def finish(self) -> None:
        """The stream ended: it must have said ``[DONE]``, and given its usage."""
        if not self.done:
            raise BrokenStreamError("the stream ended before [DONE]")
        if self.usage is None:
            raise BrokenStreamError("the stream carried no usage (asked for with "
                                    "stream_options.include_usage)")

    def _take(self, chunk: dict[str, Any], now: float) -> None:
        usage = chunk.get("usage")
        if usage:  # null (or empty) in every chunk but the last
            self.usage = _usage(usage)
        ids = chunk.get("prompt_token_ids")
        if ids:
            if not isinstance(ids, list) or not all(_is_count(i) for i in ids):
                raise BrokenStreamError("the prompt's token ids are not token ids")
            self.prompt_ids = ids
        choices = _typed(chunk.get("choices"), list, "choices") or []
        if self.first_token is None and choices:
            self.first_token = now
        for choice in choices:
            if not isinstance(choice, dict):
                raise BrokenStreamError(f"a choice that is not an object: {choice!r:.80}")
            delta = _typed(choice.get("delta"), dict, "a delta") or {}
            content = _typed(delta.get("content"), str, "content")
            tool_calls = _typed(delta.get("tool_calls"), list, "tool calls") or []
            if self.first_delta is None and (content or tool_calls):
                self.first_delta = now
            if content:
                self.content.append(content)
            for tc in tool_calls:
                self._take_call(tc)
            self._take_logprobs(choice.get("logprobs"))
            self.finish_reason = (_typed(choice.get("finish_reason"), str, "a finish reason")
                                  or self.finish_reason)

    def _take_logprobs(self, lp: Any) -> None:
        """Per-token log-probabilities (asked for by a ladder's step); a garbled entry
        is dropped, not the step: they only inform an escalation."""
        if not isinstance(lp, dict) or not isinstance(lp.get("content"), list):
            return
        for entry in lp["content"]:
            v = entry.get("logprob") if isinstance(entry, dict) else None
            if isinstance(v, int | float) and not isinstance(v, bool) and math.isfinite(v):
                self.logprobs.append(float(v))

    def _take_call(self, tc: Any) -> None:
        if not isinstance(tc, dict):
            raise BrokenStreamError(f"a tool call delta that is not an object: {tc!r:.80}")
        index = tc.get("index")
        if index is not None and not _is_count(index):
            raise BrokenStreamError(f"a tool call index that is not one: {index!r:.80}")
        slot = self.calls.setdefault(index or 0, {"id": "", "name": "", "arguments": []})
        slot["id"] = _typed(tc.get("id"), str, "a tool call id") or slot["id"]
        fn = _typed(tc.get("function"), dict, "a function") or {}
        slot["name"] += _typed(fn.get("name"), str, "a function name") or ""
        slot["arguments"].append(_typed(fn.get("arguments"), str, "arguments") or "")


def _is_count(v: Any) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def _typed(value: Any, kind: type, what: str) -> Any:
    """``value`` if it is absent (None) or of ``kind``; else the stream is broken."""
    if value is None or isinstance(value, kind):
        return value
    raise BrokenStreamError(f"{what} of the wrong type: {value!r:.80}")


def _usage(usage: Any) -> dict[str, int]:
    if not isinstance(usage, dict):
        raise BrokenStreamError(f"a usage that is not an object: {usage!r:.80}")
    details = _typed(usage.get("prompt_tokens_details"), dict, "prompt token details") or {}
    given = {"prompt_tokens": usage.get("prompt_tokens"),
             "cached_tokens": (0 if details.get("cached_tokens") is None
                               else details["cached_tokens"]),
             "completion_tokens": usage.get("completion_tokens")}
    counts: dict[str, int] = {}
    for field, n in given.items():
        if not _is_count(n):
            raise BrokenStreamError(f"the usage's {field} is not a token count: {n!r:.80}")
        counts[field] = n
    return counts


def _error_text(chunk: Any) -> str:
    """The message of an error event, in vLLM's shapes (``{"error": {...}}``, the older
    ``{"object": "error", "message": ...}``) or whatever else it is."""
    if isinstance(chunk, dict):
        error = chunk.get("error")
        if isinstance(error, dict) and error.get("message"):
            return str(error["message"])[:500]
        if chunk.get("message"):
            return str(chunk["message"])[:500]
        if isinstance(error, str) and error:
            return error[:500]
    return json.dumps(chunk)[:500]


def _beat(earlier: AttemptSpend) -> Callable[[], None]:
    """A step's heartbeat: with its earlier attempts' spend as the details, when any
    (a beat's details replace the last ones: a bare beat would lose them)."""
    if not earlier.attempts:
        return lambda: activity.heartbeat()
    details = earlier.model_dump()
    return lambda: activity.heartbeat(details)


@contextlib.asynccontextmanager
async def _heartbeating(beat_once: Callable[[], None] | None = None,
                        interval_s: float = 2.0) -> AsyncIterator[None]:
    """Heartbeat while a step runs, even while the engine queues it and streams nothing:
    the heartbeat says the worker is alive (so a dead one is noticed in seconds); a
    stalled engine is caught by the HTTP read timeout instead. ``beat_once``: one beat
    (default: a bare ``activity.heartbeat()``).

    The first beat waits ``interval_s``: a step that ends sooner sends none. Each beat
    the SDK sends is a write to the workflow's history shard (and an action Temporal
    Cloud bills), and the embedded server has one shard for every workflow: a 100-job
    burst's heartbeats were a fifth of its writes. The heartbeat timeout runs from the
    activity's start whether or not it beats, so a dead worker is noticed as soon."""

    async def beat() -> None:
        while True:
            await asyncio.sleep(interval_s)
            (beat_once or activity.heartbeat)()

    task = asyncio.ensure_future(beat())
    try:
        yield
    finally:
        task.cancel()
