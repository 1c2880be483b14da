"""Grounded arguments: an id argument may only name an id the job has already seen.

A small model copies ids badly: asked to look up customer ``C128`` it writes ``C129``,
and the job goes on about someone else. Every id argument in the bundled profiles is a
string with a ``pattern`` (``^C\\d{3}$``, ``^INV\\d{4,6}$``), so the ids a job has seen
are easy to find: the substrings of its task, calls and tool results that match the
pattern. With grounding on, guided decoding restricts each such argument to those
values (an ``enum``); an argument with no match in the job's text keeps its pattern.
Numbers are grounded the same way: a ``number`` or ``integer`` argument (an amount to
approve) may only be a number literal of the job's text, within the schema's bounds.

The constraint travels apart from the prompt: the request keeps its ``tools`` unchanged
(the chat template renders them into the cached prefix, so an enum there would change
the prefix every step) and sends ``tool_choice: none`` with a structural tag of the
hermes call form (``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, what
vLLM's hermes parser builds for ``tool_choice: required``), whose JSON schemas carry the
enums. The engine then returns the call as text, which ``parse_hermes_call`` reads.

Hazard: grounding trusts the job's own text. A tool result or task that mentions an id
makes it callable; a model must still pick the right one among them. A number the
model must compute (a sum no tool returned) cannot be written with grounding on: turn
it off for such agents (``WARMLOOP_GROUNDED_ARGUMENTS=false``).
"""

from __future__ import annotations

import copy
import json
import math
import re
from typing import Any

from warmloop.workflows.contracts import ChatMessage, FunctionCall, ToolCall

START_TAG = "<tool_call>"
END_TAG = "</tool_call>"
MAX_CANDIDATES = 64
"""Most values an id argument's enum lists (the earliest seen): a grammar over thousands
of ids compiles slowly, and a job that saw that many is not what grounding is for."""
MAX_NUMBER_CANDIDATES = 256
"""Most values a number argument's enum lists (the earliest seen): an invoice of many
lines shows four numbers a line before its total."""
# a number on its own: not the digits of an id, a date ("2025-03-01") or a version
_NUMBER = re.compile(r"(?<![A-Za-z0-9_.-])-?[0-9]+(?:\.[0-9]+)?(?![A-Za-z0-9_-]|\.[0-9])")


def context_text(task: dict[str, Any], transcript: list[ChatMessage]) -> str:
    """What the job has seen: its task, every message's text and every call's arguments."""
    parts = [json.dumps(task, sort_keys=True)]
    for m in transcript:
        if m.content:
            parts.append(m.content)
        for c in m.tool_calls or []:
            parts.append(c.function.arguments)
    return "\n".join(parts)


def _unanchored(pattern: str) -> re.Pattern[str] | None:
    body = pattern.removeprefix("^").removesuffix("$")
    try:
        # not inside a longer word: "C12" must not ground from "C123"
        return re.compile(rf"(?<![A-Za-z0-9_])(?:{body})(?![A-Za-z0-9_])")
    except re.error:
        return None


def seen_values(pattern: str, context: str) -> list[str]:
    """Distinct substrings of ``context`` that match ``pattern`` whole, in order of
    first appearance (at most ``MAX_CANDIDATES``)."""
    rx = _unanchored(pattern)
    if rx is None:
        return []
    full = re.compile(pattern)
    out: dict[str, None] = {}
    for m in rx.finditer(context):
        if full.fullmatch(m.group(0)) and m.group(0) not in out:
            out[m.group(0)] = None
            if len(out) >= MAX_CANDIDATES:
                break
    return list(out)


def seen_numbers(schema: dict[str, Any], context: str) -> list[int | float]:
    """Distinct number literals of ``context`` that ``schema`` (a ``number`` or
    ``integer`` property) admits, in order of first appearance."""
    integer = schema.get("type") == "integer"
    out: dict[str, int | float] = {}
    for m in _NUMBER.finditer(context):
        text = m.group(0)
        if text in out or (integer and "." in text):
            continue
        value: int | float = float(text) if "." in text else int(text)
        if (value < schema.get("minimum", -math.inf) or value > schema.get("maximum", math.inf)
                or value <= schema.get("exclusiveMinimum", -math.inf)
                or value >= schema.get("exclusiveMaximum", math.inf)):
            continue
        out[text] = value
        if len(out) >= MAX_NUMBER_CANDIDATES:
            break
    return list(out.values())


def ground_parameters(parameters: dict[str, Any], context: str) -> dict[str, Any]:
    """A copy of a tool's parameter schema whose patterned string properties and number
    properties are restricted to the values of ``context`` that they admit."""
    out = copy.deepcopy(parameters)
    for prop in (out.get("properties") or {}).values():
        if not isinstance(prop, dict) or "enum" in prop:
            continue
        kind = prop.get("type")
        if kind == "string" and isinstance(prop.get("pattern"), str):
            values = seen_values(prop["pattern"], context)
            if values:
                prop.pop("pattern")
                prop["enum"] = values
        elif kind in ("number", "integer"):
            numbers = seen_numbers(prop, context)
            if numbers:
                for bound in ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum"):
                    prop.pop(bound, None)
                prop["enum"] = numbers
    return out


def grounded_constraint(tools: list[dict[str, Any]], context: str) -> dict[str, Any]:
    """The request fields that make the step one hermes-form call to one of ``tools``,
    its id and number arguments grounded in ``context`` (replaces ``tool_choice``)."""
    tags = [{"type": "tag",
             "begin": f'{START_TAG}{{"name": "{t["function"]["name"]}", "arguments": ',
             # one whitespace at most between JSON tokens (the ", " and ": " of the form
             # models write): a free-whitespace grammar lets a weak model pad until its
             # max_tokens and never close the call
             "content": {"type": "json_schema", "max_whitespace_cnt": 1,
                         "json_schema": ground_parameters(t["function"]["parameters"], context)},
             "end": "}" + END_TAG}
            for t in tools]
    tag = {"type": "structural_tag",
           "format": {"type": "tags_with_separator", "tags": tags, "separator": "",
                      "at_least_one": True, "stop_after_first": True}}
    # skip_special_tokens off: <tool_call> may be a special token of the model's tokenizer
    return {"tool_choice": "none", "skip_special_tokens": False,
            "structured_outputs": {"structural_tag": json.dumps(tag)}}


def parse_hermes_call(content: str, call_id: str) -> tuple[str, list[ToolCall]]:
    """The one call in a grounded step's text (its closing tag may be cut short); the
    text unchanged and no call when it is not one (its JSON cut by ``max_tokens``, say),
    which the workflow reads as an invalid step."""
    text = content.strip()
    if not text.startswith(START_TAG):
        return content, []
    body = text[len(START_TAG):]
    # the closing tag may be cut by max_tokens after a whole call (as vLLM's parser reads)
    for n in range(len(END_TAG), 0, -1):
        if body.endswith(END_TAG[:n]):
            body = body[:-n]
            break
    try:
        value = json.loads(body)
    except ValueError:
        return content, []
    if not isinstance(value, dict):
        return content, []
    name, arguments = value.get("name"), value.get("arguments")
    if not isinstance(name, str) or not isinstance(arguments, dict):
        return content, []
    return "", [ToolCall(id=call_id, function=FunctionCall(
        name=name, arguments=json.dumps(arguments, ensure_ascii=False)))]
