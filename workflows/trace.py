"""The trace format of ``warmloop replay``: one recorded agent job per JSONL line.

A line names a registered profile, or carries an inline system prompt (and, if the
trace has them, its tool schemas); then the task, and per step the assistant's tool
call, the tool's result, the pause before the next step and the output tokens::

    {"profile": "ticket-triage", "task": {"ticket_id": "T1001", ...},
     "steps": [{"call": {"name": "lookup_customer", "arguments": {"customer_id": "C115"}},
                "result": "{\\"plan\\": \\"pro\\"}", "pause_s": 1.5, "output_tokens": 24},
               ...]}
    {"system_prompt": "You reconcile ...", "tools": [{"type": "function", "function": {...}}],
     "task": "free text, or an object", "steps": [...]}

Replay runs every step on the real engines but appends the recorded call and result,
so every configuration sees the same prompts. An inline prompt is stored once under
its content hash (``trace:<hash>``, see ``activities/trace_prompts.py``), never in
workflow history; the workflow only sees a stand-in profile of that name.

Pure: no I/O, imported by the workflow sandbox.
"""

from __future__ import annotations

import hashlib
import json
import statistics
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from warmloop.workflows.contracts import FunctionCall, Lane, ReplayScript, ReplayStep, ToolCall
from warmloop.workflows.profiles import Profile, ToolSpec
from warmloop.workflows.prompt import canonical_json
from warmloop.workflows.tenants import DEFAULT_TENANT, TenantName

TRACE_PROFILE_PREFIX = "trace:"
"""Profile names of inline prompts: ``trace:<16 hex of the prompt's sha256>``."""


def is_trace_profile(name: str) -> bool:
    return name.startswith(TRACE_PROFILE_PREFIX)


class TraceError(ValueError):
    """Bad trace lines; each message starts ``line N: field: ...``."""

    def __init__(self, errors: list[str]) -> None:
        self.errors = errors
        more = f" (and {len(errors) - 1} more bad line(s))" if len(errors) > 1 else ""
        super().__init__(errors[0] + more)


# ---- the format ----------------------------------------------------------------------


class TraceCall(BaseModel):
    """The assistant's tool call as recorded."""

    model_config = ConfigDict(extra="forbid")

    name: str = Field(min_length=1, max_length=64)
    arguments: Any = Field(default_factory=dict)
    """A JSON object, or the raw JSON text the model produced."""
    id: str | None = Field(default=None, min_length=1, max_length=64)

    @field_validator("arguments")
    @classmethod
    def _object_or_text(cls, v: Any) -> Any:
        if not isinstance(v, (dict, str)):
            raise ValueError("must be a JSON object or the call's raw JSON text")
        return v

    def arguments_text(self) -> str:
        return self.arguments if isinstance(self.arguments, str) else json.dumps(
            self.arguments, ensure_ascii=False)


class TraceStep(BaseModel):
    model_config = ConfigDict(extra="forbid")

    call: TraceCall
    result: str = ""
    """What the tool returned (what the model read next); may be empty on the last step."""
    pause_s: float = Field(default=0.0, ge=0, le=86_400)
    """Seconds the job waited after this step (the tool, or a human) before the next."""
    output_tokens: int = Field(ge=1, le=32_768)
    """Completion tokens the model produced for this step."""


class TraceFunction(BaseModel):
    model_config = ConfigDict(extra="allow")

    name: str = Field(min_length=1, max_length=64)


class TraceTool(BaseModel):
    """An OpenAI tool schema, sent to the engines as given."""

    model_config = ConfigDict(extra="allow")

    type: Literal["function"]
    function: TraceFunction


class TraceJob(BaseModel):
    """One line of a trace: one recorded job."""

    model_config = ConfigDict(extra="forbid")

    profile: str | None = Field(default=None, min_length=1)
    system_prompt: str | None = Field(default=None, min_length=1)
    tools: list[TraceTool] | None = Field(default=None, min_length=1)
    """With system_prompt only: the tool schemas the model was offered. Without them,
    each tool the trace calls with this prompt is offered with open parameters."""
    task: Any
    """An object (validated by the profile, if one is named) or free text."""
    steps: list[TraceStep] = Field(min_length=1, max_length=10_000)
    arrival_s: float | None = Field(default=None, ge=0, le=1e11)
    """When the job arrived, in seconds on any clock the trace shares (epoch seconds
    will do; the earliest line's is the replay's start): ``warmloop replay --arrivals``
    starts each job then, as production did, instead of keeping a window of jobs
    running. Bounded so that epoch milliseconds are refused, not replayed 1,000x slow."""
    lane: Lane = Lane.INTERACTIVE
    """The lane the job ran in (a batch job goes through the engines' batch admission)."""
    tenant: TenantName = DEFAULT_TENANT
    """Whose job it was: the replay runs it as the tenant's (``<tenant>/<id>``, its
    requests salted with the tenant's ``cache_salt``), so tenants' prompts share no
    cache in the replay, as they shared none in production."""

    @field_validator("task")
    @classmethod
    def _task(cls, v: Any) -> Any:
        if isinstance(v, str) and v:
            return v
        if isinstance(v, dict):
            return v
        raise ValueError("must be a JSON object or a non-empty string")

    @model_validator(mode="after")
    def _one_prompt(self) -> TraceJob:
        if (self.profile is None) == (self.system_prompt is None):
            raise ValueError("give exactly one of profile (a registered agent) and "
                             "system_prompt (an inline prompt)")
        if self.profile is not None and not isinstance(self.task, dict):
            raise ValueError("task: must be a JSON object for a profile")
        if self.tools is not None:
            if self.profile is not None:
                raise ValueError("tools: only with system_prompt (a profile brings its own)")
            names = [t.function.name for t in self.tools]
            dup = sorted({n for n in names if names.count(n) > 1})
            if dup:
                raise ValueError(f"tools: {', '.join(dup)} given twice")
            for i, s in enumerate(self.steps):
                if s.call.name not in names:
                    raise ValueError(f"steps.{i}.call.name: {s.call.name!r} is not one of the "
                                     f"line's tools ({', '.join(sorted(names))})")
        return self

    @property
    def task_object(self) -> dict[str, Any]:
        return self.task if isinstance(self.task, dict) else {"text": self.task}


def _messages(e: ValidationError) -> str:
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"])
    msg = str(err["msg"]).removeprefix("Value error, ")
    return f"{where}: {msg}" if where else msg


def parse_trace(lines: Iterable[str]) -> list[tuple[int, TraceJob]]:
    """(line number, job) for each non-blank line; ``TraceError`` naming every bad line
    (``line 3: steps.0.output_tokens: Input should be greater than or equal to 1``)."""
    jobs: list[tuple[int, TraceJob]] = []
    errors: list[str] = []
    for n, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            raw = json.loads(line)
        except json.JSONDecodeError as e:
            errors.append(f"line {n}: not valid JSON: {e.msg} (column {e.colno})")
            continue
        if not isinstance(raw, dict):
            errors.append(f"line {n}: must be one JSON object, got {type(raw).__name__}")
            continue
        try:
            jobs.append((n, TraceJob.model_validate(raw)))
        except ValidationError as e:
            errors.append(f"line {n}: {_messages(e)}")
    if errors:
        raise TraceError(errors)
    if not jobs:
        raise TraceError(["the trace has no jobs"])
    return jobs


def check_profile_job(n: int, job: TraceJob, profile: Profile) -> None:
    """A line naming a profile: its task must validate as the profile's task."""
    try:
        profile.validate_task(job.task_object)
    except ValidationError as e:
        raise TraceError([f"line {n}: task.{_messages(e)}"]) from None


# ---- inline prompts ------------------------------------------------------------------


class InlinePrompt(BaseModel):
    """An inline system prompt and its tools, stored once under its content hash."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    system_prompt: str
    tools: list[dict[str, Any]]
    """OpenAI tool schemas, in name order (the stable prefix never reorders)."""
    finish_tools: list[str]
    """Tools that ended a job of the trace (its last recorded call)."""
    pauses: dict[str, tuple[float, float]] = Field(default_factory=dict)
    """Per tool: median and p90 seconds of the trace's pauses after it; the hold decision's
    prior for this prompt's tools."""

    @property
    def name(self) -> str:
        digest = hashlib.sha256(canonical_json(self.model_dump(mode="json")).encode())
        return TRACE_PROFILE_PREFIX + digest.hexdigest()[:16]

    def tool_schemas(self, only: list[str] | None = None) -> list[dict[str, Any]]:
        return [t for t in self.tools if only is None or t["function"]["name"] in only]


def _open_tool(name: str) -> dict[str, Any]:
    """A tool known only by the calls a trace makes to it."""
    return {"type": "function",
            "function": {"name": name, "description": "", "parameters": {"type": "object"}}}


def _q(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, round(q * (len(s) - 1)))]


def inline_prompts(jobs: list[tuple[int, TraceJob]]) -> dict[int, InlinePrompt]:
    """The inline prompt of each line that has one (by line number). Lines with the same
    system prompt and tools share one prompt: the same name, the same cached prefix."""
    groups: dict[str, list[tuple[int, TraceJob]]] = {}
    for n, job in jobs:
        if job.system_prompt is None:
            continue
        tools = None if job.tools is None else [t.model_dump(mode="json") for t in job.tools]
        groups.setdefault(canonical_json([job.system_prompt, tools]), []).append((n, job))
    out: dict[int, InlinePrompt] = {}
    for members in groups.values():
        first = members[0][1]
        assert first.system_prompt is not None
        called = {s.call.name for _, j in members for s in j.steps}
        schemas = ([t.model_dump(mode="json") for t in first.tools] if first.tools is not None
                   else [_open_tool(n) for n in called])
        pauses: dict[str, list[float]] = {}
        for _, j in members:
            for s in j.steps[:-1]:
                pauses.setdefault(s.call.name, []).append(s.pause_s)
        prompt = InlinePrompt(
            system_prompt=first.system_prompt,
            tools=sorted(schemas, key=lambda t: t["function"]["name"]),
            finish_tools=sorted({j.steps[-1].call.name for _, j in members}),
            pauses={k: (statistics.median(v), _q(v, 0.9)) for k, v in sorted(pauses.items())},
        )
        for n, _ in members:
            out[n] = prompt
    return out


class _AnyTask(BaseModel):
    """An inline prompt's task: whatever the trace gives, sent as given."""

    model_config = ConfigDict(extra="allow")


class _NoArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")


@dataclass(frozen=True)
class RecordedTool(ToolSpec):
    """A tool of an inline prompt, known by its schema only (the replay never runs it)."""

    schema_json: str = "{}"

    def openai_schema(self) -> dict[str, Any]:
        return dict(json.loads(self.schema_json))


def trace_profile(name: str, prompt: InlinePrompt) -> Profile:
    """The profile the inference worker assembles an inline prompt's steps with."""
    tools = []
    for schema in prompt.tools:
        tool = schema["function"]["name"]
        median, p90 = prompt.pauses.get(tool, (1.0, 5.0))
        tools.append(RecordedTool(
            name=tool, description=str(schema["function"].get("description", "")),
            args=_NoArgs, finishes_job=tool in prompt.finish_tools,
            pause_median_s=max(median, 0.05), pause_p90_s=max(p90, median, 0.05),
            schema_json=json.dumps(schema)))
    return Profile(name=name, system_prompt=prompt.system_prompt, task_model=_AnyTask,
                   tools=tuple(tools))


def stand_in_profile(name: str) -> Profile:
    """What the workflow knows of an inline-prompt job: its name. The prompt stays in
    the store; the inference worker resolves it (``trace_profile``)."""
    return Profile(name=name, system_prompt="", task_model=_AnyTask, tools=(
        RecordedTool(name="finish", description="", args=_NoArgs, finishes_job=True),))


# ---- replay scripts and digests ------------------------------------------------------


def replay_script(job: TraceJob, pause_kinds: list[str]) -> ReplayScript:
    """The workflow's script of a line; ``pause_kinds[i]`` is what the job waits on after
    step i (the last step waits on nothing)."""
    steps = []
    for i, s in enumerate(job.steps):
        last = i == len(job.steps) - 1
        steps.append(ReplayStep(
            call=ToolCall(id=s.call.id or f"call-{i + 1}",
                          function=FunctionCall(name=s.call.name,
                                                arguments=s.call.arguments_text())),
            result=s.result, pause_s=0.0 if last else s.pause_s,
            output_tokens=s.output_tokens, pause_kind="" if last else pause_kinds[i]))
    return ReplayScript(steps=steps)


def prompt_digest(hashes: Iterable[tuple[int, int, str]]) -> str:
    """One digest over per-step prompt hashes ``(trace job, step, hash)``, in trace order:
    two runs that sent the same prompts print the same digest."""
    h = hashlib.sha256()
    for job, step, ph in sorted(hashes):
        h.update(f"{job}:{step}:{ph}\n".encode())
    return h.hexdigest()[:16]
