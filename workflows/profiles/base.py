"""What an agent profile is made of."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from pydantic import BaseModel, ValidationError


class UnknownProfileError(ValueError):
    """A job named a profile that is not registered."""


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

    def openai_schema(self) -> dict[str, Any]:
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


class ToolCallError(ValueError):
    """The model's tool call cannot be run: unknown tool or invalid arguments."""


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
    default_max_steps: int = 8
    step_max_tokens: int = 96
    """Output budget per step: enough for one bounded tool call."""
    max_invalid_calls: int = 3
    """Consecutive invalid tool calls tolerated before the job ends as INVALID_OUTPUT."""
    tool_timeout_s: float = 30.0
    _by_name: dict[str, ToolSpec] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "_by_name", {t.name: t for t in self.tools})
        if not any(t.finishes_job for t in self.tools):
            raise ValueError(f"profile {self.name!r} needs a tool with finishes_job=True")

    def tool_schemas(self) -> list[dict[str, Any]]:
        """Tool schemas in canonical (name) order, so the prefix never reorders."""
        return [self._by_name[n].openai_schema() for n in sorted(self._by_name)]

    def validate_task(self, task: dict[str, Any]) -> BaseModel:
        return self.task_model.model_validate(task)

    def validate_call(self, name: str, raw_arguments: str) -> tuple[ToolSpec, dict[str, Any]]:
        """Parse and validate one tool call; raises ``ToolCallError`` saying what is wrong."""
        spec = self._by_name.get(name)
        if spec is None:
            raise ToolCallError(
                f"unknown tool {name!r}; call one of: {', '.join(sorted(self._by_name))}"
            )
        try:
            parsed = json.loads(raw_arguments or "{}")
        except json.JSONDecodeError as e:
            raise ToolCallError(f"arguments of {name} are not valid JSON: {e.msg}") from None
        try:
            args = spec.args.model_validate(parsed)
        except ValidationError as e:
            first = e.errors()[0]
            where = ".".join(str(p) for p in first["loc"]) or "arguments"
            raise ToolCallError(f"invalid arguments for {name}: {where}: {first['msg']}") from None
        return spec, args.model_dump(mode="json")
