"""``AgentJob``: one agent task as a durable loop of model steps and tool calls.

Each step: assemble the prompt (stable prefix first, append-only transcript), run
``generate`` on the task queue of the job's engine, validate the tool call, run the
tool, append its result. The job ends on the profile's finish tool or a cap, always
with its transcript; no ending is a workflow failure.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

from pydantic import BaseModel, ValidationError
from temporalio import workflow
from temporalio.common import RetryPolicy
from temporalio.exceptions import ActivityError, ApplicationError, TimeoutError

from workflows.contracts import (
    AGENT_TASK_QUEUE,
    ChatMessage,
    EngineChoice,
    GenerateRequest,
    GenerateResult,
    JobInput,
    JobResult,
    JobState,
    JobStatus,
    PickEngineRequest,
    StepRecord,
    StoreTranscriptRequest,
    ToolRequest,
    ToolResult,
    engine_task_queue,
)
from workflows.profiles import Profile, UnknownProfileError, get_profile
from workflows.profiles.base import ToolCallError
from workflows.prompt import assemble_prompt

GENERATE_START_TO_CLOSE = timedelta(seconds=90)
GENERATE_RETRY = RetryPolicy(
    maximum_attempts=3,
    initial_interval=timedelta(milliseconds=500),
    non_retryable_error_types=["ContextOverflow", "EngineRejected"],
)
MAX_FAILOVERS = 2
SHORT_ACTIVITY = timedelta(seconds=30)
PICK_RETRY = RetryPolicy(maximum_attempts=5, initial_interval=timedelta(seconds=1))


def _error_type(err: ActivityError) -> str | None:
    cause = err.cause
    return cause.type if isinstance(cause, ApplicationError) else None


@workflow.defn
class AgentJob:
    def __init__(self) -> None:
        self._job_id = ""
        self._profile = ""
        self._state = JobState.RUNNING
        self._step = 0
        self._engine: EngineChoice | None = None

    @workflow.query
    def status(self) -> JobStatus:
        return JobStatus(
            job_id=self._job_id,
            profile=self._profile,
            state=self._state,
            step=self._step,
            engine_id=self._engine.engine_id if self._engine else None,
        )

    @workflow.run
    async def run(self, job: JobInput) -> JobResult:
        self._job_id = workflow.info().workflow_id
        self._profile = job.profile
        try:
            profile = get_profile(job.profile)
            task = profile.validate_task(job.task)
        except (UnknownProfileError, ValidationError) as e:
            return await self._end(JobState.INVALID_INPUT, f"invalid job input: {e}", [], [])

        max_steps = job.max_steps or profile.default_max_steps
        if job.engine_id:
            self._engine = EngineChoice(engine_id=job.engine_id, reason="pinned")
        transcript: list[ChatMessage] = []
        steps: list[StepRecord] = []
        invalid_streak = 0

        for step in range(1, max_steps + 1):
            self._step = step
            messages = assemble_prompt(profile, task, transcript, step=step, max_steps=max_steps)
            request = GenerateRequest(
                job_id=self._job_id, step=step, messages=messages,
                tools=profile.tool_schemas(), max_tokens=profile.step_max_tokens,
            )
            outcome = await self._generate(
                request, pickup_timeout=timedelta(seconds=job.step_pickup_timeout_s)
            )
            if isinstance(outcome, JobState):
                reason = {
                    JobState.CONTEXT_EXHAUSTED: "the transcript no longer fits the context window",
                    JobState.ENGINE_UNAVAILABLE: "no live engine could serve the step",
                }[outcome]
                return await self._end(outcome, reason, transcript, steps)
            gen, route_reason = outcome

            record: dict[str, Any] = dict(
                step=step, engine_id=gen.engine_id, route_reason=route_reason,
                prompt_tokens=gen.prompt_tokens, cached_tokens=gen.cached_tokens,
                completion_tokens=gen.completion_tokens, ttft_ms=gen.ttft_ms,
                latency_ms=gen.latency_ms,
            )
            try:
                spec, args = self._validate(profile, gen)
            except ToolCallError as e:
                steps.append(StepRecord(**record, tool=None, valid=False, error=str(e)))
                transcript.extend(self._repair_messages(gen, str(e)))
                invalid_streak += 1
                workflow.logger.warning("invalid tool call", extra={"step": step, "error": str(e)})
                if invalid_streak >= profile.max_invalid_calls:
                    return await self._end(
                        JobState.INVALID_OUTPUT,
                        f"{invalid_streak} invalid tool calls in a row; last: {e}",
                        transcript, steps,
                    )
                continue
            invalid_streak = 0
            call = gen.tool_calls[0]
            steps.append(StepRecord(**record, tool=spec.name, valid=True))
            transcript.append(ChatMessage(role="assistant", content="", tool_calls=[call]))

            if spec.finishes_job:
                transcript.append(ChatMessage(role="tool", tool_call_id=call.id, content="done"))
                return await self._end(JobState.FINISHED, f"{spec.name} called", transcript,
                                       steps, final=args)
            result = await self._run_tool(profile, step, spec.name, args)
            transcript.append(ChatMessage(role="tool", tool_call_id=call.id, content=result.output))

        return await self._end(JobState.LOOP_CAP, f"step cap of {max_steps} reached",
                               transcript, steps)

    async def _pick(self, exclude: list[str]) -> EngineChoice | None:
        try:
            return await workflow.execute_activity(
                "pick_engine",
                PickEngineRequest(job_id=self._job_id, profile=self._profile, exclude=exclude),
                task_queue=AGENT_TASK_QUEUE, start_to_close_timeout=SHORT_ACTIVITY,
                retry_policy=PICK_RETRY, result_type=EngineChoice,
            )
        except ActivityError:
            return None

    async def _generate(
        self, request: GenerateRequest, *, pickup_timeout: timedelta
    ) -> tuple[GenerateResult, str] | JobState:
        """Run one step on the job's engine, failing over to another when it is gone."""
        failed: list[str] = []
        route_reason: str
        for _ in range(MAX_FAILOVERS + 1):
            if self._engine is None:
                self._engine = await self._pick(failed)
                if self._engine is None:
                    return JobState.ENGINE_UNAVAILABLE
                route_reason = self._engine.reason
            else:
                route_reason = "pinned" if self._engine.reason == "pinned" else "sticky"
            try:
                gen = await workflow.execute_activity(
                    "generate", request,
                    task_queue=engine_task_queue(self._engine.engine_id),
                    start_to_close_timeout=GENERATE_START_TO_CLOSE,
                    # not picked up in time: the engine's worker is gone, fail over
                    schedule_to_start_timeout=pickup_timeout,
                    retry_policy=GENERATE_RETRY, result_type=GenerateResult,
                )
                return gen, route_reason
            except ActivityError as e:
                if _error_type(e) == "ContextOverflow":
                    return JobState.CONTEXT_EXHAUSTED
                lost = self._engine.engine_id
                workflow.logger.warning(
                    "step failed on engine, failing over",
                    extra={"engine": lost, "timeout": isinstance(e.cause, TimeoutError)},
                )
                failed.append(lost)
                self._engine = None
        return JobState.ENGINE_UNAVAILABLE

    @staticmethod
    def _validate(profile: Profile, gen: GenerateResult) -> tuple[Any, dict[str, Any]]:
        if len(gen.tool_calls) != 1:
            raise ToolCallError(
                f"expected exactly one tool call, got {len(gen.tool_calls)}"
                + (f" and text {gen.content[:80]!r}" if gen.content else "")
            )
        call = gen.tool_calls[0]
        return profile.validate_call(call.function.name, call.function.arguments)

    @staticmethod
    def _repair_messages(gen: GenerateResult, error: str) -> list[ChatMessage]:
        """Tell the model what was wrong, by appending (the prefix stays append-only)."""
        if gen.tool_calls:
            call = gen.tool_calls[0]
            return [
                ChatMessage(role="assistant", content=gen.content, tool_calls=[call]),
                ChatMessage(role="tool", tool_call_id=call.id, content=f"error: {error}"),
            ]
        return [
            ChatMessage(role="assistant", content=gen.content[:500]),
            ChatMessage(role="user", content=f"error: {error}. Reply with exactly one tool call."),
        ]

    async def _run_tool(self, profile: Profile, step: int, name: str,
                        args: dict[str, Any]) -> ToolResult:
        try:
            return await workflow.execute_activity(
                "run_tool",
                ToolRequest(job_id=self._job_id, step=step, profile=profile.name, name=name,
                            arguments=args),
                task_queue=AGENT_TASK_QUEUE,
                start_to_close_timeout=timedelta(seconds=profile.tool_timeout_s),
                retry_policy=RetryPolicy(maximum_attempts=3), result_type=ToolResult,
            )
        except ActivityError as e:
            # The model reads the failure and carries on; the job does not crash.
            return ToolResult(ok=False, output=f"tool {name} failed: {e.cause or e}")

    async def _end(self, state: JobState, reason: str, transcript: list[ChatMessage],
                   steps: list[StepRecord], final: BaseModel | dict[str, Any] | None = None,
                   ) -> JobResult:
        self._state = state
        key = None
        if transcript:
            try:
                key = await workflow.execute_activity(
                    "store_transcript",
                    StoreTranscriptRequest(job_id=self._job_id, transcript=transcript),
                    task_queue=AGENT_TASK_QUEUE, start_to_close_timeout=SHORT_ACTIVITY,
                    retry_policy=RetryPolicy(maximum_attempts=5), result_type=str,
                )
            except ActivityError:
                workflow.logger.warning("transcript not stored in S3; kept in the result")
        workflow.logger.info("job ended", extra={"state": state.value, "reason": reason})
        return JobResult(
            job_id=self._job_id, profile=self._profile, state=state, reason=reason,
            final=final if isinstance(final, dict) or final is None else final.model_dump(),
            steps=steps, transcript=transcript, transcript_key=key,
        )
