"""A profile as data: the document a YAML profile file holds, validated with pydantic.

Pure: the plugin loader reads the file and hands the parsed mapping here, so the same
validation serves files, entry points that return mappings, and tests.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from warmloop.workflows.budgets import JobLimits, OutputBudgets
from warmloop.workflows.hygiene import ContextHygiene
from warmloop.workflows.ladder import ModelLadder
from warmloop.workflows.profiles.base import (
    ActivityRunner,
    ApprovalRule,
    HttpRunner,
    Profile,
    PythonRunner,
    ToolRetry,
    ToolRunner,
    ToolSpec,
    first_error,
)
from warmloop.workflows.profiles.schema import SchemaError, model_from_schema

NAME_PATTERN = r"^[a-z0-9][a-z0-9._-]{0,62}$"


class ProfileDocumentError(ValueError):
    """A profile document is invalid; the message names the field."""


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class HttpToolDoc(_Strict):
    url: str = Field(pattern=r"^https?://", description="POST target; arguments as JSON.")
    headers: dict[str, str] = Field(default_factory=dict)
    max_response_bytes: int = Field(default=65_536, ge=1, le=16 * 1024 * 1024)


class ActivityToolDoc(_Strict):
    name: str = Field(min_length=1, description="Temporal activity name.")
    task_queue: str = Field(min_length=1, description="Queue the user's worker polls.")
    pickup_timeout_s: float = Field(default=60.0, gt=0, le=86_400)


class ToolDoc(_Strict):
    """One tool. Exactly one of ``python``, ``http``, ``activity`` says where it runs,
    unless it finishes the job (then it never runs)."""

    name: str = Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")
    description: str = Field(min_length=1, max_length=2000)
    arguments: dict[str, Any] | None = Field(
        default=None, description="JSON Schema of the arguments (an object). Optional for "
        "a python tool: its function's type hints give it.")
    finishes_job: bool = False
    python: str | None = Field(default=None, pattern=r"^[A-Za-z_][\w.]*:[A-Za-z_][\w.]*$",
                               description="module:function decorated with @warmloop.tool")
    http: HttpToolDoc | None = None
    activity: ActivityToolDoc | None = None
    side_effect: bool = False
    read_only: bool = Field(
        default=False, description="The tool changes nothing: a slow call may be hedged "
        "with a second identical request (JobInput.hedge_tools). Never with side_effect.")
    effect_key: list[str] | None = Field(
        default=None, description="Arguments that, with the tool and the task's record "
        "id, identify the side effect: it applies once per identity in a job ([] once per "
        "task record). Unset: once per step.")
    effect_scope: Literal["job", "tenant"] = Field(
        default="job", description="Where an effect_key identity applies once: within the "
        "job, or across every job of the tenant (an invoice paid once, whichever job asks).")
    task_args: list[str] = Field(
        default_factory=list, description="Arguments that must name the job's own task "
        "record; a call naming another is refused.")
    max_calls: int | None = Field(default=None, ge=1)
    timeout_s: float = Field(default=30.0, gt=0, le=3600)
    max_attempts: int = Field(default=3, ge=1, le=20)
    retry_initial_interval_s: float = Field(default=0.5, gt=0, le=600)
    pause_median_s: float = Field(default=1.0, gt=0)
    pause_p90_s: float = Field(default=5.0, gt=0)

    @model_validator(mode="after")
    def _one_runner(self) -> ToolDoc:
        kinds = [k for k in ("python", "http", "activity") if getattr(self, k) is not None]
        if len(kinds) > 1:
            raise ValueError(f"give one of python, http, activity, not {' and '.join(kinds)}")
        if not kinds and not self.finishes_job:
            raise ValueError("say where the tool runs: python, http or activity")
        if self.arguments is None and self.python is None:
            raise ValueError("arguments: a JSON Schema is required (only python tools may "
                             "take it from their function)")
        return self

    def runner(self) -> ToolRunner | None:
        if self.python is not None:
            return PythonRunner(function=self.python)
        if self.http is not None:
            return HttpRunner(url=self.http.url, headers=tuple(sorted(self.http.headers.items())),
                              max_response_bytes=self.http.max_response_bytes)
        if self.activity is not None:
            return ActivityRunner(activity=self.activity.name,
                                  task_queue=self.activity.task_queue,
                                  pickup_timeout_s=self.activity.pickup_timeout_s)
        return None


class ApprovalDoc(_Strict):
    kind: str = Field(pattern=r"^[a-z0-9_-]{1,40}$")
    tool: str
    approvers: list[str] = Field(min_length=1)
    deadline_s: float = Field(gt=0)
    field: str | None = None
    op: Literal["gt", "ge", "eq", "in"] = "gt"
    value: Any = None
    on_timeout: Literal["escalate", "reject"] = "reject"
    escalate_to: list[str] = Field(default_factory=list)
    escalation_deadline_s: float = Field(default=0.0, ge=0)
    on_reject: Literal["continue", "end"] = "continue"
    pause_median_s: float = Field(default=1200.0, gt=0)
    pause_p90_s: float = Field(default=3600.0, gt=0)
    two_approvers_over: float | None = Field(default=None, ge=0)
    submitter_may_approve: bool = False


class ProfileDocument(_Strict):
    """What a YAML profile file holds."""

    name: str = Field(pattern=NAME_PATTERN)
    system_prompt: str = Field(min_length=1, description="The stable prefix: nothing "
                               "volatile (dates, ids) may appear in it.")
    task_schema: dict[str, Any] = Field(description="JSON Schema (an object) of the task.")
    task_id_field: str = "id"
    tools: list[ToolDoc] = Field(min_length=1)
    approvals: list[ApprovalDoc] = Field(default_factory=list)
    limits: JobLimits = Field(default_factory=JobLimits)
    budgets: OutputBudgets = Field(default_factory=OutputBudgets)
    model: str | None = None
    max_invalid_calls: int = Field(default=3, ge=1, le=100)
    max_tool_output_chars: int = Field(default=8192, ge=256, le=1_000_000)
    temperature: float = Field(default=1.0, ge=0, le=2)
    hygiene: ContextHygiene | None = Field(
        default=None, description="Context hygiene: archive large or stale tool outputs "
        "when it pays (warmloop.workflows.hygiene.ContextHygiene); unset: off.")
    tools_on_demand: bool = Field(
        default=False, description="A compact tool index in the prompt and a load_tools "
        "call instead of every schema on every step (many tools, few used per job).")
    ladder: ModelLadder | None = Field(
        default=None, description="Small model first: models cheapest first, the logprob "
        "threshold and the hard calls (warmloop.workflows.ladder.ModelLadder); unset: off.")


def profile_from_document(
    data: Any, *, python_tool: Callable[[str], ToolSpec] | None = None
) -> Profile:
    """Validate a parsed profile document and build the ``Profile``.

    ``python_tool`` resolves ``module:function`` to the function's ``ToolSpec`` (the
    loader imports it); needed only for python tools whose arguments the document leaves
    to the function. Raises ``ProfileDocumentError`` whose message starts with the field.
    """
    try:
        doc = ProfileDocument.model_validate(data)
    except ValidationError as e:
        raise ProfileDocumentError(first_error(e, whole="document")) from None
    try:
        task_model = model_from_schema(f"{doc.name}_task", doc.task_schema,
                                       where="task_schema")
        tools = tuple(_tool(doc.name, i, t, python_tool) for i, t in enumerate(doc.tools))
    except SchemaError as e:
        raise ProfileDocumentError(str(e)) from None
    if doc.task_id_field not in task_model.model_fields:
        raise ProfileDocumentError(f"task_id_field: {doc.task_id_field!r} is not a property "
                                   "of task_schema")
    approvals = tuple(
        ApprovalRule(kind=a.kind, tool=a.tool, approvers=tuple(a.approvers),
                     deadline_s=a.deadline_s, field=a.field, op=a.op, value=a.value,
                     on_timeout=a.on_timeout, escalate_to=tuple(a.escalate_to),
                     escalation_deadline_s=a.escalation_deadline_s, on_reject=a.on_reject,
                     pause_median_s=a.pause_median_s, pause_p90_s=a.pause_p90_s,
                     two_approvers_over=a.two_approvers_over,
                     submitter_may_approve=a.submitter_may_approve)
        for a in doc.approvals)
    try:
        return Profile(name=doc.name, system_prompt=doc.system_prompt, task_model=task_model,
                       tools=tools, task_id_field=doc.task_id_field, approvals=approvals,
                       limits=doc.limits, budgets=doc.budgets, model=doc.model,
                       max_invalid_calls=doc.max_invalid_calls,
                       max_tool_output_chars=doc.max_tool_output_chars,
                       temperature=doc.temperature, hygiene=doc.hygiene,
                       tools_on_demand=doc.tools_on_demand, ladder=doc.ladder)
    except ValueError as e:
        raise ProfileDocumentError(str(e)) from None


def _tool(profile: str, i: int, t: ToolDoc,
          python_tool: Callable[[str], ToolSpec] | None) -> ToolSpec:
    where = f"tools.{i}"
    runner = t.runner()
    if t.arguments is not None:
        args = model_from_schema(f"{profile}_{t.name}_args", t.arguments,
                                 where=f"{where}.arguments", strict_tool=True)
    else:
        assert t.python is not None  # the document's validator made sure
        if python_tool is None:
            raise SchemaError(f"{where}.arguments: required here (python tools are not "
                              "resolved in this process)")
        try:
            args = python_tool(t.python).args
        except (ImportError, AttributeError, TypeError, ValueError) as e:
            raise SchemaError(f"{where}.python: cannot use {t.python}: {e}") from None
    try:
        return ToolSpec(
            name=t.name, description=t.description, args=args, finishes_job=t.finishes_job,
            max_calls=t.max_calls, side_effect=t.side_effect,
            effect_key=None if t.effect_key is None else tuple(t.effect_key),
            effect_scope=t.effect_scope, task_args=tuple(t.task_args), timeout_s=t.timeout_s,
            retry=ToolRetry(max_attempts=t.max_attempts,
                            initial_interval_s=t.retry_initial_interval_s),
            pause_median_s=t.pause_median_s, pause_p90_s=t.pause_p90_s, runner=runner,
            read_only=t.read_only)
    except ValueError as e:
        raise SchemaError(f"{where}: {e}") from None
