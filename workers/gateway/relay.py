"""Relaying an engine's answer: its bytes unchanged, and a look at what it says.

The client gets the engine's bytes as they are (its JSON; its server-sent events as
they arrive), but for a usage event the gateway asked for itself (a tenant's stream
whose client did not: ``Call.hidden_usage``). The gateway reads a copy for what it needs
to know about the session: the usage (``cached_tokens`` for the metrics, the tokens for
a tenant's hour) and the tool calls asked for (what the session will pause on).

Hazard: when an engine dies mid-stream, the client must get a clean error, not a
half event glued to it. So events are passed on whole: each piece of the stream is
sent up to its last complete event, and the rest waits for the next piece (vLLM writes
each event in one piece, so nothing waits in practice).
"""

from __future__ import annotations

import contextlib
import json
import re
from dataclasses import dataclass, field
from typing import Any

_MARKERS = (b'"usage":{', b'"usage": {', b'"tool_calls"', b'"finish_reason":"',
            b'"finish_reason": "')
"""An event is parsed only when it may carry something the gateway reads."""


@dataclass
class Outcome:
    """What the engine's answer told the gateway."""

    prompt_tokens: int | None = None
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    tool_names: list[str] = field(default_factory=list)
    finish_reason: str | None = None
    done: bool = False
    """A stream said ``[DONE]``."""

    def take(self, chunk: Any) -> None:
        """Read one response object or stream chunk (leniently: it is the client's to
        judge; anything odd is ignored here)."""
        if not isinstance(chunk, dict):
            return
        usage = chunk.get("usage")
        if isinstance(usage, dict):
            self._usage(usage)
        choices = chunk.get("choices")
        for choice in choices if isinstance(choices, list) else []:
            if isinstance(choice, dict):
                self._choice(choice)

    def _usage(self, usage: dict[str, Any]) -> None:
        prompt = usage.get("prompt_tokens")
        if isinstance(prompt, int):
            self.prompt_tokens = prompt
        completion = usage.get("completion_tokens")
        if isinstance(completion, int):
            self.completion_tokens = completion
        details = usage.get("prompt_tokens_details")
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        self.cached_tokens = cached if isinstance(cached, int) else 0

    def _choice(self, choice: dict[str, Any]) -> None:
        part = choice.get("delta") or choice.get("message")
        calls = part.get("tool_calls") if isinstance(part, dict) else None
        for call in calls if isinstance(calls, list) else []:
            fn = call.get("function") if isinstance(call, dict) else None
            name = fn.get("name") if isinstance(fn, dict) else None
            if isinstance(name, str) and name:
                self.tool_names.append(name)
        reason = choice.get("finish_reason")
        if isinstance(reason, str):
            self.finish_reason = reason


def read_body(content: bytes) -> Outcome:
    """What a whole (non-streamed) answer says."""
    outcome = Outcome()
    with contextlib.suppress(ValueError, RecursionError):
        outcome.take(json.loads(content))
    return outcome


class EventRelay:
    """Splits a stream into whole events to pass on, reading each on the way.

    ``drop_usage_event``: the engine was asked for a usage event the client did not ask
    for (``Call.hidden_usage``); it is read, and left out of what is passed on (the
    event whose ``choices`` is empty and which carries ``usage``, as vLLM ends such a
    stream). Every other byte is passed on as it came."""

    def __init__(self, *, drop_usage_event: bool = False) -> None:
        self._pending = b""
        self._drop_usage = drop_usage_event
        self.outcome = Outcome()

    def take(self, data: bytes) -> bytes:
        """The whole events ``data`` completes (possibly none yet)."""
        buf = self._pending + data
        end = _last_event_end(buf)
        ready, self._pending = buf[:end], buf[end:]
        if ready:
            self._read(ready)
            if self._drop_usage and b'"usage"' in ready:
                events = _EVENT.findall(ready)
                tail = ready[sum(map(len, events)):]  # a blank line past the last event
                ready = b"".join(e for e in events if not _usage_only(e)) + tail
        return ready

    def flush(self) -> bytes:
        """What is left when the stream ends (an unterminated last event)."""
        rest, self._pending = self._pending, b""
        if rest:
            self._read(rest)
            if self._drop_usage and _usage_only(rest):
                return b""
        return rest

    def _read(self, events: bytes) -> None:
        for line in events.splitlines():
            if not line.startswith(b"data:"):
                continue
            value = line[5:].strip()
            if value == b"[DONE]":
                self.outcome.done = True
            elif any(m in value for m in _MARKERS):
                try:
                    self.outcome.take(json.loads(value))
                except (ValueError, RecursionError):
                    continue


_EVENT = re.compile(rb".*?(?:\r\n\r\n|\n\n)", re.S)
"""One whole event with the blank line that ends it."""


def _usage_only(event: bytes) -> bool:
    """Whether ``event`` is a stream's usage event: ``choices`` empty, ``usage`` an
    object (vLLM's last event before ``[DONE]`` when ``include_usage`` is asked)."""
    for line in event.splitlines():
        if line.startswith(b"data:") and b'"usage"' in line:
            try:
                chunk = json.loads(line[5:])
            except (ValueError, RecursionError):
                return False
            return (isinstance(chunk, dict) and chunk.get("choices") == []
                    and isinstance(chunk.get("usage"), dict))
    return False


def _last_event_end(buf: bytes) -> int:
    """Index just past the last blank line (an event's end) in ``buf``; 0 if none."""
    return max(buf.rfind(b"\n\n") + 2 if b"\n\n" in buf else 0,
               buf.rfind(b"\r\n\r\n") + 4 if b"\r\n\r\n" in buf else 0)


def error_object(message: str, *, kind: str, code: int | str | None = None,
                 param: str | None = None) -> dict[str, Any]:
    """An OpenAI-style error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def error_event(message: str, *, code: int = 502) -> bytes:
    """The event that ends a stream whose engine failed: OpenAI's clients raise an
    ``APIError`` with this message on an event carrying ``error``."""
    body = error_object(message, kind="engine_error", code=code)
    return b"data: " + json.dumps(body).encode() + b"\n\n"
