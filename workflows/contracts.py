"""Data contracts shared by workflows, activities, workers and the CLI.

Pure pydantic models: the workflow sandbox imports this module, so it must stay free
of I/O and of anything non-deterministic.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

AGENT_TASK_QUEUE = "warmloop-agent"


def engine_task_queue(engine_id: str) -> str:
    """Task queue served by the inference worker that sits beside engine ``engine_id``."""
    return f"engine.{engine_id}"


class Lane(StrEnum):
    """Latency class of a job: interactive steps go before batch steps."""

    INTERACTIVE = "interactive"
    BATCH = "batch"


class JobState(StrEnum):
    """Where a job is, or how it ended. Every ending keeps the transcript."""

    RUNNING = "RUNNING"
    FINISHED = "FINISHED"
    """The model called the profile's finish tool."""
    LOOP_CAP = "LOOP_CAP"
    """The step cap was reached before the model finished."""
    INVALID_OUTPUT = "INVALID_OUTPUT"
    """The model produced too many invalid tool calls in a row."""
    CONTEXT_EXHAUSTED = "CONTEXT_EXHAUSTED"
    """The transcript no longer fits the engine's context window."""
    ENGINE_UNAVAILABLE = "ENGINE_UNAVAILABLE"
    """No live engine could serve a step, even after failover."""
    INVALID_INPUT = "INVALID_INPUT"
    """The job's task did not validate against its profile (only reachable by
    bypassing the client-side check)."""


class JobInput(BaseModel):
    """Input of one ``AgentJob`` workflow."""

    model_config = ConfigDict(extra="forbid")

    profile: str = Field(min_length=1, description="Name of a registered agent profile.")
    task: dict[str, Any] = Field(description="The task record; validated by the profile.")
    max_steps: int | None = Field(
        default=None, ge=1, le=200, description="Step cap; the profile's default when None."
    )
    lane: Lane = Lane.INTERACTIVE
    engine_id: str | None = Field(
        default=None, description="Pin the job to this engine instead of routing it."
    )
    step_pickup_timeout_s: float = Field(
        default=30.0, gt=0, le=600,
        description="How long a step may wait for its engine's worker to pick it up before "
        "the engine is taken for dead and the step fails over to another.",
    )


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """Raw JSON text as the model produced it: validated by the workflow, never trusted."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    """One OpenAI-style chat message, as sent to the engine."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str = ""
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def to_openai(self) -> dict[str, Any]:
        return self.model_dump(exclude_none=True)


class EngineChoice(BaseModel):
    """Which engine serves a job's steps, and why it was picked."""

    engine_id: str
    reason: Literal["pinned", "round_robin", "failover"]


class PickEngineRequest(BaseModel):
    job_id: str
    profile: str
    exclude: list[str] = Field(default_factory=list, description="Engines known to be failing.")


class GenerateRequest(BaseModel):
    """One model step: the assembled prompt and its output budget."""

    job_id: str
    step: int
    messages: list[ChatMessage]
    tools: list[dict[str, Any]]
    max_tokens: int = Field(ge=1)
    priority: int = 0


class GenerateResult(BaseModel):
    """What the engine returned for one step, with its own usage figures."""

    engine_id: str
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int
    cached_tokens: int
    """From the engine's ``usage.prompt_tokens_details.cached_tokens``: the ground truth."""
    completion_tokens: int
    ttft_ms: float
    latency_ms: float


class ToolRequest(BaseModel):
    job_id: str
    step: int
    profile: str
    name: str
    arguments: dict[str, Any]


class ToolResult(BaseModel):
    ok: bool
    output: str


class StepRecord(BaseModel):
    """Per-step accounting, kept in the job result."""

    step: int
    engine_id: str
    route_reason: str
    tool: str | None
    valid: bool
    error: str | None = None
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float
    latency_ms: float


class StoreTranscriptRequest(BaseModel):
    job_id: str
    transcript: list[ChatMessage]


class JobStatus(BaseModel):
    """Answer of the ``status`` query."""

    job_id: str
    profile: str
    state: JobState
    step: int
    engine_id: str | None


class JobResult(BaseModel):
    """How a job ended, its transcript and its per-step accounting."""

    job_id: str
    profile: str
    state: JobState
    reason: str
    final: dict[str, Any] | None = None
    steps: list[StepRecord] = Field(default_factory=list)
    transcript: list[ChatMessage] = Field(default_factory=list)
    transcript_key: str | None = Field(
        default=None, description="S3 key of the stored transcript."
    )

    @property
    def prompt_tokens(self) -> int:
        return sum(s.prompt_tokens for s in self.steps)

    @property
    def cached_tokens(self) -> int:
        return sum(s.cached_tokens for s in self.steps)
