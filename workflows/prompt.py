"""Prompt assembly: stable content first, then the task, then the append-only
transcript, then the small volatile tail. Nothing volatile ever precedes stable
content, so every step's prompt extends the cached prefix of the one before."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel

from warmloop.workflows import tool_loading
from warmloop.workflows.contracts import ChatMessage
from warmloop.workflows.profiles import Profile


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def stable_prefix_hash(profile: Profile, *, tools: list[str] | None = None) -> str:
    """Hash of what every job of ``profile`` (offering ``tools``; None: all) shares: its
    system message and the tool schemas its requests render (on demand: the index in
    the system message, and only the always-available schemas)."""
    h = hashlib.sha256(system_content(profile, tools=tools).encode())
    h.update(canonical_json(request_tools(profile, tools)).encode())
    return h.hexdigest()[:16]


def system_content(profile: Profile, *, tools: list[str] | None = None) -> str:
    """The system message: the profile's prompt (on demand, then the tool index)."""
    if profile.tools_on_demand:
        return tool_loading.system_content(profile, tools)
    return profile.system_prompt


def request_tools(profile: Profile, tools: list[str] | None = None) -> list[dict[str, Any]]:
    """The ``tools`` of every request of a job offering ``tools`` (None: all): the same
    on every step, since the chat template renders them into the stable prefix. On
    demand: only ``load_tools`` and the finishing tools; the rest are loaded into the
    transcript."""
    if profile.tools_on_demand:
        return tool_loading.rendered_schemas(profile, tools)
    return profile.tool_schemas(tools)


def task_message(task: BaseModel) -> ChatMessage:
    body = canonical_json(task.model_dump(mode="json"))
    return ChatMessage(role="user", content="Task:\n" + body)


def assemble_prompt(
    profile: Profile,
    task: BaseModel,
    transcript: list[ChatMessage],
    *,
    tail: str,
    tools: list[str] | None = None,
) -> list[ChatMessage]:
    """The messages of one step. ``transcript`` is append-only across steps; ``tail``
    (the budget line from ``warmloop.workflows.budgets.remaining_text``) is the only part that
    changes between steps, and it comes last. ``tools``: those the job offers (None:
    all); an on-demand profile's index lists only those."""
    return [
        ChatMessage(role="system", content=system_content(profile, tools=tools)),
        task_message(task),
        *transcript,
        ChatMessage(role="user", content=tail),
    ]


def prompt_hash(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """sha256 of a request's messages and tools (canonical JSON): the same prompt gives
    the same hash on any engine, in any run (``warmloop replay`` compares them)."""
    return hashlib.sha256(canonical_json([messages, tools]).encode()).hexdigest()[:32]
