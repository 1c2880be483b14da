"""Prompt assembly: stable content first, then the task, then the append-only
transcript, then the small volatile tail. Nothing volatile ever precedes stable
content, so every step's prompt extends the cached prefix of the one before."""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel

from warmloop.workflows.contracts import ChatMessage
from warmloop.workflows.profiles import Profile


def canonical_json(value: object) -> str:
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=False)


def stable_prefix_hash(profile: Profile) -> str:
    """Hash of what every job of ``profile`` shares: system prompt and tool schemas."""
    h = hashlib.sha256(profile.system_prompt.encode())
    h.update(canonical_json(profile.tool_schemas()).encode())
    return h.hexdigest()[:16]


def task_message(task: BaseModel) -> ChatMessage:
    body = canonical_json(task.model_dump(mode="json"))
    return ChatMessage(role="user", content="Task:\n" + body)


def assemble_prompt(
    profile: Profile,
    task: BaseModel,
    transcript: list[ChatMessage],
    *,
    tail: str,
) -> list[ChatMessage]:
    """The messages of one step. ``transcript`` is append-only across steps; ``tail``
    (the budget line from ``warmloop.workflows.budgets.remaining_text``) is the only part that
    changes between steps, and it comes last."""
    return [
        ChatMessage(role="system", content=profile.system_prompt),
        task_message(task),
        *transcript,
        ChatMessage(role="user", content=tail),
    ]


def prompt_hash(messages: list[dict[str, Any]], tools: list[dict[str, Any]]) -> str:
    """sha256 of a request's messages and tools (canonical JSON): the same prompt gives
    the same hash on any engine, in any run (``warmloop replay`` compares them)."""
    return hashlib.sha256(canonical_json([messages, tools]).encode()).hexdigest()[:32]
