"""Data contracts shared by workflows, activities, workers and the CLI.

Pure pydantic models: the workflow sandbox imports this module, so it must stay free
of I/O and of anything non-deterministic.
"""

from __future__ import annotations

import re
from datetime import datetime
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from warmloop.workflows.budgets import JobLimits, Usage
from warmloop.workflows.holding import HoldPolicy
from warmloop.workflows.routing import RouteDecision, RouteReason, RoutingPolicy

AGENT_TASK_QUEUE = "warmloop-agent"

MAX_ID_LEN = 200
_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:@-]*")


def id_problem(kind: str, value: str) -> str | None:
    """Why ``value`` cannot name a job or batch, in one line; None when it can.

    Ids become S3 keys (1,024 bytes at most, with a prefix and a message index), Redis
    keys matched by glob patterns (``*?[]`` would match other jobs) and text printed
    with rich markup (``[...]`` would be read as markup): letters, digits and
    ``. _ : @ -``, starting with a letter or digit, up to MAX_ID_LEN characters."""
    if not value:
        return f"{kind} id is empty"
    if len(value) > MAX_ID_LEN:
        return f"{kind} id is {len(value)} characters long; at most {MAX_ID_LEN}"
    if not _ID.fullmatch(value):
        return (f"{kind} id {value[:60]!r} may hold only letters, digits and . _ : @ - "
                "(starting with a letter or digit)")
    return None


def _is_default_tenant(tenant: str) -> bool:
    """The default tenant is left out of payloads: a default-tenant job's input and
    requests are byte for byte what they were before tenants (and workers from before
    tenants read them)."""
    return tenant == "default"


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
    """The job cannot run as given: its task did not validate against its profile, no
    engine serves the profile's model, or it has a cost cap and no engine serving its
    model declares a price (only reachable by bypassing the client-side check)."""
    TRANSCRIPT_LOST = "TRANSCRIPT_LOST"
    """A new run could not read the transcript its previous run moved to S3 (too big to
    carry): the store lost it. Its steps and spend are kept; its messages are in the
    previous run's history."""
    BUDGET_EXHAUSTED = "BUDGET_EXHAUSTED"
    """The job's token or cost cap was spent."""
    TIMED_OUT = "TIMED_OUT"
    """The job's wall-time cap passed."""
    QUOTA_EXHAUSTED = "QUOTA_EXHAUSTED"
    """The job's tenant spent its tokens for the hour, and waiting for the next hour
    would pass the job's wall-time cap (``warmloop.workflows.tenants``)."""
    REJECTED = "REJECTED"
    """A human rejected a call whose approval rule ends the job on rejection."""
    CANCELLED = "CANCELLED"
    """Cancelled on request (`warmloop cancel`)."""


TERMINAL_STATES = frozenset(JobState) - {JobState.RUNNING}


class JobInput(BaseModel):
    """Input of one ``AgentJob`` workflow."""

    model_config = ConfigDict(extra="forbid")

    profile: str = Field(min_length=1, description="Name of a registered agent profile.")
    task: dict[str, Any] = Field(description="The task record; validated by the profile.")
    max_steps: int | None = Field(
        default=None, ge=1, le=10_000,
        description="Step cap; shorthand for limits.max_steps. The profile's when None.",
    )
    limits: JobLimits | None = Field(
        default=None, description="Caps for this job; the profile's defaults when None."
    )
    lane: Lane = Lane.INTERACTIVE
    tenant: str = Field(
        default="default", exclude_if=_is_default_tenant,
        description="Whose job it is (warmloop.workflows.tenants): its engine requests carry "
        "the tenant's cache_salt, its keys are the tenant's, its quota applies. A job of "
        "another tenant than the default one runs as workflow <tenant>/<job id>.")
    engine_id: str | None = Field(
        default=None, description="Pin the job to this engine instead of routing it."
    )
    submitted_by: str | None = Field(
        default=None, max_length=200,
        description="The verified subject who submitted the job (the CLI sets it from the "
        "user's token); approval rules refuse this person deciding the job's approvals.")
    hold_policy: HoldPolicy = Field(
        default="cost_model",
        description="While the job waits on a tool or a human: keep its prefix warm when "
        "the cost model says it pays (cost_model), always (always_hold), or leave it to the "
        "engine's LRU (never). The last two are baselines for benchmarks.")
    routing: RoutingPolicy = Field(
        default="cache_aware",
        description="How each step picks its engine. cache_aware: where its prefix is "
        "warm, within load limits. round_robin and least_loaded are baselines for "
        "benchmarks; they ignore the caches.",
    )
    step_pickup_timeout_s: float = Field(
        default=30.0, gt=0, le=600,
        description="How long a step may wait for its engine's worker to pick it up before "
        "the engine is taken for dead and the step fails over to another.",
    )
    tools: list[str] | None = Field(
        default=None, min_length=1,
        description="Offer only these tools of the profile (default: all). Without the "
        "finish tool a job runs until a cap: soak and history tests use that.",
    )
    continue_as_new_after_steps: int | None = Field(
        default=None, ge=1,
        description="Continue-as-new every N steps even when the server does not suggest it "
        "(keeps each run's history short; used by tests to force the boundary).",
    )
    hedge_tools: bool = Field(
        default=True,
        description="Hedge the profile's read-only tools: a call that runs past its "
        "observed p95 gets a second identical request and the first answer wins. Never "
        "applies to side-effect tools. Off: a baseline for benchmarks.")
    context_hygiene: Literal["off", "cost_model", "every_step"] | None = Field(
        default=None,
        description="Compact large or stale tool outputs out of the transcript: at a "
        "continue-as-new point when the cost model says it pays (cost_model), never "
        "(off), or every step (every_step: a baseline for benchmarks that throws the "
        "cached prefix away). None: the profile's setting.")
    carry: JobCarry | None = Field(
        default=None, description="Internal: state carried across continue-as-new."
    )
    replay: ReplayScript | None = Field(
        default=None, description="Replay these recorded steps (`warmloop replay`): each "
        "runs on the real engines through routing and holds, but the transcript gets the "
        "recorded call and result, not the generated ones.",
    )


class FunctionCall(BaseModel):
    name: str
    arguments: str
    """Raw JSON text as the model produced it: validated by the workflow, never trusted."""


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ReplayStep(BaseModel):
    """One recorded step of a replayed job: the engines are asked for ``output_tokens``
    tokens, then ``call`` and ``result`` are appended instead of what they generated, and
    the job waits ``pause_s`` (a workflow timer) before its next step."""

    model_config = ConfigDict(extra="forbid")

    call: ToolCall
    result: str = ""
    pause_s: float = Field(default=0.0, ge=0)
    output_tokens: int = Field(ge=1)
    pause_kind: str = ""
    """What the job waits on after this step (``tool:<name>`` or ``approval:<kind>``), for
    the inference worker's hold decision; "": nothing (the job's last step)."""


class ReplayScript(BaseModel):
    """The recorded steps of one job of a trace (``warmloop.workflows.trace``)."""

    model_config = ConfigDict(extra="forbid")

    steps: list[ReplayStep] = Field(min_length=1)
    ask_approvals: bool = False
    """Ask real approvers for the recorded calls the profile's rules cover, as a live
    step does (a rehearsal or demo with real people); a rejection replaces the recorded
    result. Off: approvals are part of the recorded pauses (benchmarks)."""


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
    reason: RouteReason


class PickEngineRequest(BaseModel):
    """Input of ``pick_engine``, the placement of histories recorded before routing ran
    per step (kept so those workflows replay)."""

    job_id: str
    profile: str
    exclude: list[str] = Field(default_factory=list, description="Engines known to be failing.")
    model: str | None = None
    """Only engines serving this model; None: any."""
    require_price: bool = False
    """Only engines that declare a price (the job has a cost cap)."""


class EngineAliveRequest(BaseModel):
    """Is the engine a step could not be handed to alive (its worker heartbeating a
    healthy engine into the registry)? Then it is busy, not gone."""

    engine_id: str


class RouteRequest(BaseModel):
    """Input of ``route_step``: where should this job's next step run?"""

    job_id: str
    step: int
    profile: str
    policy: RoutingPolicy = "cache_aware"
    last_engine: str | None = None
    """The engine of the job's previous step: its whole transcript is likely cached there."""
    tools: list[str] | None = None
    """The tools the job offers: part of its stable prefix."""
    lane: Lane = Lane.INTERACTIVE
    exclude: list[str] = Field(default_factory=list, description="Engines that failed this step.")
    model: str | None = None
    """The model the job's profile needs: only engines serving it; None: any engine."""
    require_price: bool = False
    """The job has a cost cap: only engines that declare a price."""
    tenant: str = Field(default="default", exclude_if=_is_default_tenant)
    """The job's tenant: only its own cached prefixes count, and its quota applies."""
    mark_in_flight: bool = True
    """Count the step as load on the chosen engine now. False for a route taken ahead,
    while the job waits on its tool: a waiting step is not load; its worker counts it
    when it picks the step up (``GenerateRequest.mark_in_flight``)."""


class GenerateRequest(BaseModel):
    """One model step, by reference: the worker assembles the prompt.

    History stays O(steps): only the messages new since the last step travel; the
    transcript itself lives in S3, one object per message.
    """

    job_id: str
    step: int
    profile: str
    task: dict[str, Any]
    base_len: int = Field(ge=0, description="Transcript messages already stored.")
    new_messages: list[ChatMessage] = Field(default_factory=list)
    """Messages to store at positions base_len, base_len+1, ... before this step."""
    tail: str = Field(description="The volatile tail: the budget line the model reads.")
    tools: list[str] | None = None
    """The profile's tools offered in this job; None: all."""
    max_tokens: int = Field(ge=1)
    priority: int = 0
    """vLLM request priority (lower first); see warmloop.workflows.lanes."""
    lane: Lane = Lane.INTERACTIVE
    """Batch steps wait for the engine's batch admission; interactive ones never do."""
    hold_policy: HoldPolicy = "cost_model"
    expected_cached_tokens: int | None = None
    """The router's prediction for this step; the worker scores the prefix directory's
    accuracy against the engine's reported cached tokens."""
    pause_kind: str | None = None
    """A replayed step: what the job waits on after it (``tool:<name>``, ``approval:<kind>``;
    "": nothing), decided by the recorded call, not the generated one. None: a live step."""
    tenant: str = Field(default="default", exclude_if=_is_default_tenant)
    """The job's tenant: the request carries its ``cache_salt`` (none for the default)."""
    prompt_tokens_hint: int | None = Field(default=None, ge=1)
    """A pre-warm on an approval's opening: the job's prompt as its last step measured it,
    which the worker's hold decision prices before anything is sent (``prewarm``)."""
    model: str | None = None
    """A model ladder's rung: the step is routed only to engines serving this model.
    None: the profile's ``model`` (any engine when that is None too)."""
    logprobs: bool = False
    """Ask the engine for the log-probability of every output token (a ladder decides
    by them); the result carries their mean and minimum."""
    mark_in_flight: bool = False
    """The worker counts the step as load on its engine when it picks it up: its route
    was taken ahead, during the job's pause, and did not (``RouteRequest.mark_in_flight``)."""
    route_next: RouteRequest | None = None
    """Route the job's next step here, after this one's last token and its directory
    records, and return it as ``GenerateResult.next_route``: the next step then starts
    without a routing round trip of its own. ``last_engine`` is this worker's engine."""


class StepTiming(BaseModel):
    """Where one step's wall time went, stage by stage along its critical path (ms).

    Exists because everything here but the engine's TTFT and decode is warmloop's own
    cost, which a client calling the engine directly does not pay: each stage is
    measured where it happens, so a slower step path shows which stage grew. Stages
    timed on different hosts (``schedule_to_start_ms``, ``return_ms``) compare their
    clocks and are clamped at 0; skewed clocks blur them."""

    routing_ms: float = 0.0
    """The workflow starting the step -> generate scheduled: the route activity's round
    trip through Temporal and the workflow task that schedules generate."""
    schedule_to_start_ms: float = 0.0
    """generate scheduled -> Temporal handing it to the inference worker (matching)."""
    worker_pickup_ms: float = 0.0
    """Handed to the worker -> the activity's code running (SDK, the worker's event loop)."""
    prompt_ms: float = 0.0
    """The hold resumed, the transcript read and the prompt assembled."""
    admission_ms: float = 0.0
    """Waiting for a batch slot (batch lane only)."""
    ttft_ms: float = 0.0
    """The request leaving -> the engine's first token: its queue and prefill."""
    decode_ms: float = 0.0
    """First token -> last."""
    after_ms: float = 0.0
    """Last token -> the activity returning: the step's messages stored, the prefix
    directory, registry and hold written."""
    return_ms: float = 0.0
    """The activity returning -> the workflow running again with its result."""

    @property
    def overhead_ms(self) -> float:
        """Everything but the engine's own queue, prefill and decode."""
        return (self.routing_ms + self.schedule_to_start_ms + self.worker_pickup_ms
                + self.prompt_ms + self.admission_ms + self.after_ms + self.return_ms)


STEP_STAGES = tuple(StepTiming.model_fields)
"""The stages in path order (for reports)."""


class AttemptSpend(BaseModel):
    """What a step's failed attempts made an engine compute (a stream cut after the
    prompt was prefilled, an error event after tokens were decoded). Exists because
    those tokens were spent: the job's token caps, its cost and its tenant's hour count
    them, though only the step's last answer reaches the workflow. ``generate`` keeps
    it across Temporal's retries of one step in its heartbeat details, sends it as an
    ``ENGINE_ERROR``'s first detail, and returns it with the attempt that succeeds."""

    attempts: int = Field(default=0, ge=0)
    """Failed attempts counted (those that reported nothing count too)."""
    prompt_tokens: int = Field(default=0, ge=0)
    cached_tokens: int = Field(default=0, ge=0)
    completion_tokens: int = Field(default=0, ge=0)
    cost_usd: float = Field(default=0.0, ge=0)
    """At each engine's price; attempts on unpriced engines add nothing here."""
    unpriced_attempts: int = Field(default=0, ge=0)
    """Attempts whose engine declares no price: ``cost_usd`` is then a lower bound."""

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.completion_tokens

    def plus(self, other: AttemptSpend) -> AttemptSpend:
        return AttemptSpend(
            attempts=self.attempts + other.attempts,
            prompt_tokens=self.prompt_tokens + other.prompt_tokens,
            cached_tokens=self.cached_tokens + other.cached_tokens,
            completion_tokens=self.completion_tokens + other.completion_tokens,
            cost_usd=self.cost_usd + other.cost_usd,
            unpriced_attempts=self.unpriced_attempts + other.unpriced_attempts)

    @classmethod
    def from_details(cls, details: object) -> AttemptSpend:
        """Read from an error's or a heartbeat's first detail; nothing (zero) when it is
        absent or not one (a detail written by an older worker has no ``attempts``: its
        counts are one attempt's)."""
        if not isinstance(details, dict):
            return cls()
        try:
            spend = cls.model_validate(details)
        except ValueError:
            return cls()
        if "attempts" not in details:
            spend.attempts = 1
        return spend


class GenerateResult(BaseModel):
    """What the engine returned for one step, with its own usage figures."""

    engine_id: str
    model: str = "tiny"
    attempt: int = 1
    """Temporal's attempt number: retries are attempt - 1."""
    next_route: RouteDecision | None = None
    """The job's next step's route, taken by the worker when asked
    (``GenerateRequest.route_next``); None when it was not asked or could not tell."""
    content: str = ""
    tool_calls: list[ToolCall] = Field(default_factory=list)
    finish_reason: str | None = None
    prompt_tokens: int
    cached_tokens: int
    """From the engine's ``usage.prompt_tokens_details.cached_tokens``: the ground truth."""
    completion_tokens: int
    ttft_ms: float
    """To the engine's first token: its first streamed chunk (vLLM sends it when the first
    token is sampled), not the first parsed tool-call delta, which comes several decode
    steps later."""
    latency_ms: float
    dispatch_ms: float = 0.0
    """From Temporal scheduling this attempt to the request leaving for the engine:
    the orchestration overhead the step pays before the engine sees it."""
    cost_usd: float | None = None
    """What the step cost at its engine's declared price (priced by the engine's worker);
    None: the engine declares no price."""
    prompt_hash: str | None = None
    """sha256 of the messages and tools the engine was sent
    (``warmloop.workflows.prompt.prompt_hash``): equal prompts, equal hashes."""
    timing: StepTiming | None = None
    """The stages the worker timed; the workflow adds routing and return."""
    scheduled_at: float | None = None
    """When Temporal scheduled this attempt (epoch s)."""
    returned_at: float | None = None
    """When the activity returned (epoch s)."""
    logprob_mean: float | None = None
    """Mean log-probability of the output tokens (``GenerateRequest.logprobs``)."""
    logprob_min: float | None = None
    logprob_tokens: int = 0
    failed_attempts: AttemptSpend | None = None
    """What this step's earlier attempts (Temporal's retries on this engine) spent
    before they failed; None on its first attempt."""


class ToolRequest(BaseModel):
    job_id: str
    step: int
    profile: str
    task_id: str = ""
    """Id of the task record (ticket, invoice) that side effects apply to."""
    name: str
    arguments: dict[str, Any]
    hedge: bool = False
    """The job allows hedging this call (``JobInput.hedge_tools``); the worker hedges it
    only when the tool is declared read-only."""


class ToolResult(BaseModel):
    ok: bool
    output: str
    """What the model reads; cut to the profile's max_tool_output_chars."""
    output_key: str | None = None
    """S3 key of the whole output, when it was cut."""


class StepRecord(BaseModel):
    """Per-step accounting, kept in the job result."""

    step: int
    kind: str = "execute"
    cost_usd: float | None = 0.0
    """None: the step's engine declares no price."""
    retries: int = 0
    """Failed attempts of this step's generate (engine errors, failovers)."""
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
    predicted_cached_tokens: int | None = None
    """What the router expected the engine to hold for this step."""
    dispatch_ms: float = 0.0
    """Temporal scheduling generate -> the request leaving for the engine."""
    route_ms: float = 0.0
    """Time the routing activity took to decide."""
    prompt_hash: str | None = None
    """The step's GenerateResult.prompt_hash (recorded for replayed steps)."""
    timing: StepTiming | None = None
    """Where the step's time went; None for steps recorded before it was measured."""
    model: str | None = None
    """The served model that made the step (a ladder's rung); None before ladders."""
    escalated: str | None = None
    """This step's call was asked again of the next model up, and why
    (``warmloop.workflows.ladder.EscalationReason``: invalid, low_confidence, ...)."""
    failed_attempts: AttemptSpend | None = None
    """What the step's failed attempts spent (retries and failovers): in the job's
    usage and cost, not in this record's token figures, which are its answer's."""


ENGINE_ERROR = "EngineError"
"""The engine failed the step: a 5xx, an error event inside its 200 stream, a stream
cut before ``[DONE]`` or without its usage, data that is not the chunks it should be,
a connection lost. Retryable: Temporal retries the step, then the workflow fails it
over to another engine. Never the model's fault, so never an invalid tool call. Its
first detail is what the step's attempts on that engine spent before they failed (an
``AttemptSpend``: the usage each engine reported, zeros if none, summed over the
retries)."""

INLINE_TRANSCRIPT_BYTES = 256 * 1024
"""A transcript up to this size (its messages' JSON) travels inline: in ``JobResult``,
the continue-as-new carry and one ``store_transcript`` call. A bigger one moves through
S3 in chunks, so no payload nears Temporal's 2 MB limit (past it, the workflow task
fails and retries forever: the job hangs in RUNNING and its wall cap never fires)."""
TRANSCRIPT_CHUNK_BYTES = 512 * 1024
"""The most message bytes one transcript activity call carries, either way."""


class StoreTranscriptRequest(BaseModel):
    """Messages ``base_len..`` of a job's transcript, appended to its message store in S3;
    ``complete``: the whole transcript is then also written as one object, whose key the
    activity returns. A small transcript is one call (base_len 0, complete)."""

    job_id: str
    transcript: list[ChatMessage]
    base_len: int = Field(default=0, ge=0)
    complete: bool = True


class LoadTranscriptRequest(BaseModel):
    """Read a job's stored messages from ``start``, at most ``max_bytes`` of them (at
    least one): a new run after continue-as-new loads a big transcript in chunks."""

    job_id: str
    start: int = Field(ge=0)
    end: int = Field(ge=0)
    """One past the last message wanted."""
    max_bytes: int = Field(default=TRANSCRIPT_CHUNK_BYTES, gt=0)


class PendingApproval(BaseModel):
    """A tool call waiting for a human decision."""

    approval_id: str
    job_id: str
    kind: str
    tool: str
    arguments: dict[str, Any]
    step: int
    approvers: list[str]
    requested_at: datetime
    deadline: datetime
    escalated: bool = False
    profile: str = ""
    amount: float | None = None
    """The value of the rule's field when it is a number (a payment's amount)."""
    approvals_needed: int = 1
    """2 under a two-person rule (the rule's ``two_approvers_over``): two different people."""
    approved_by: list[str] = Field(default_factory=list)
    """Verified subjects who approved so far (the first of a two-person rule waits here)."""


class Decision(BaseModel):
    """Input of the ``decide`` Update."""

    model_config = ConfigDict(extra="forbid")

    approval_id: str
    approve: bool
    assertion: str = Field(default="", max_length=4096)
    """The approvals service's signed assertion for exactly this decision (who, which
    job and approval, approve or reject, the comment's digest, expiry). Required: the
    validator refuses a decision without a valid one, before anything reaches history."""
    approver: str = ""
    """Deprecated and ignored: the decider is the assertion's verified subject. Kept so
    histories recorded before assertions still replay."""
    comment: str = Field(default="", max_length=2000)


class ApprovalViewed(BaseModel):
    """Input of the ``viewed`` signal: an approver opened a pending approval. The job
    warms its prefix again at once, so the step after the decision finds it cached."""

    model_config = ConfigDict(extra="forbid")

    approval_id: str
    viewer: str = ""


class RecordPauseRequest(BaseModel):
    profile: str
    kind: str
    """``tool:<name>`` or ``approval:<kind>``."""
    seconds: float = Field(ge=0)


class ApprovalRecord(BaseModel):
    """How an approval ended, kept in the job result."""

    approval: PendingApproval
    outcome: Literal["approved", "rejected", "timed_out"]
    decided_by: str
    comment: str = ""
    decided_at: datetime


class JobCarry(BaseModel):
    """What a job carries across continue-as-new, so the next run resumes exactly:
    the same transcript (so the prompt stays byte-identical), engine and spend."""

    transcript: list[ChatMessage]
    stored_len: int
    steps: list[StepRecord]
    usage: Usage
    engine: EngineChoice | None
    invalid_streak: int
    next_kind: str
    started_at: datetime
    runs: int
    approvals: list[ApprovalRecord] = Field(default_factory=list)
    ladder_reached: int = 0
    """The highest model-ladder rung a step of the job kept (``stay_escalated: job``)."""
    cut_at: int | None = None
    """The budget the last step was cut at with no valid call (the next step gets more)."""
    transcript_len: int | None = None
    """Set when the transcript was too big to carry (``INLINE_TRANSCRIPT_BYTES``): it is
    in the job's message store in S3, ``transcript`` is empty, and the next run loads
    these many messages in chunks."""


class JobStatus(BaseModel):
    """Answer of the ``status`` query."""

    job_id: str
    profile: str
    state: JobState
    step: int
    engine_id: str | None
    usage: Usage = Field(default_factory=Usage)
    pending_approvals: list[PendingApproval] = Field(default_factory=list)
    approvals: list[ApprovalRecord] = Field(default_factory=list)
    """Decisions made so far (the inbox's history)."""
    submitted_by: str | None = None
    task: dict[str, Any] | None = None
    """The job's task record (what an approver reads before the transcript)."""


class JobResult(BaseModel):
    """How a job ended, its transcript and its per-step accounting."""

    job_id: str
    profile: str
    state: JobState
    reason: str
    final: dict[str, Any] | None = None
    steps: list[StepRecord] = Field(default_factory=list)
    transcript: list[ChatMessage] = Field(default_factory=list)
    """The transcript, when it is at most ``INLINE_TRANSCRIPT_BYTES`` or could not be
    stored; else empty, and the whole is at ``transcript_key``."""
    transcript_key: str | None = Field(
        default=None, description="S3 key of the stored transcript."
    )
    transcript_messages: int = 0
    """Messages in the transcript, inline or not."""
    usage: Usage = Field(default_factory=Usage)
    approvals: list[ApprovalRecord] = Field(default_factory=list)
    runs: int = Field(default=1, description="Workflow runs (1 + continue-as-new count).")

    @property
    def tool_call_success_rate(self) -> float:
        """Valid tool calls / model steps."""
        return sum(s.valid for s in self.steps) / len(self.steps) if self.steps else 0.0

    @property
    def cache_hit_share(self) -> float:
        u = self.usage
        return u.cached_tokens / u.prompt_tokens if u.prompt_tokens else 0.0



JobInput.model_rebuild()
