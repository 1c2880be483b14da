"""What a tool answered, as the model will read it: pure helpers shared by the workflow
(activity tools) and the agent worker's ``run_tool`` (toolsets, functions, HTTP)."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel

from warmloop.workflows.contracts import ToolResult


def idempotency_key(job_id: str, step: int, tool: str) -> str:
    """The same for every retry of one call, different for every call: what a side
    effect is applied once by (the ledger, ``Idempotency-Key``, ``ToolContext``)."""
    return f"{job_id}:{step}:{tool}"


def effect_idempotency_key(job_id: str, step: int, tool: str, identity: str | None, *,
                           owner: str | None = None) -> str:
    """The key a side effect is made idempotent with downstream (``Idempotency-Key``,
    ``ToolContext.idempotency_key``, a user's activity): ``idempotency_key`` when the
    tool declares no identity; else the same for every call that changes the same thing
    (``ToolSpec.effect_identity``), whatever its step, so the service dedupes it too:
    within the job, or within ``owner`` (``ToolSpec.effect_owner``: the tenant, for an
    effect applied once across its jobs). The identity is hashed: it may hold any
    argument value, and a header must stay short and ASCII."""
    if identity is None:
        return idempotency_key(job_id, step, tool)
    digest = hashlib.sha256(identity.encode()).hexdigest()[:32]
    return f"{owner or job_id}:{tool}:{digest}"


def cut_for_prompt(text: str, limit: int) -> str:
    """``text`` as the transcript keeps it: at most ``limit`` characters, and a note of
    how much was cut."""
    if len(text) <= limit:
        return text
    return text[:limit] + f"\n[cut: {len(text) - limit} more characters]"


def as_model_text(value: Any) -> str:
    """What a tool returned, as text: a string as it is, a pydantic model or any JSON
    value serialised (keys sorted, so the prompt is the same every time)."""
    if isinstance(value, str):
        return value
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    return json.dumps(value, sort_keys=True, default=str)


def activity_tool_result(raw: Any) -> ToolResult:
    """What a user's tool activity returned: ``{"ok": bool, "output": ...}`` says itself
    whether the call worked (an expected failure the model should correct); anything
    else is a success whose text is ``as_model_text`` of it."""
    if isinstance(raw, dict) and isinstance(raw.get("ok"), bool):
        rest = {k: v for k, v in raw.items() if k != "ok"}
        body = rest["output"] if set(rest) == {"output"} else rest
        return ToolResult(ok=raw["ok"], output=as_model_text(body))
    return ToolResult(ok=True, output=as_model_text(raw))
