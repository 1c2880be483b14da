"""``@warmloop.tool``: a Python function as a tool, its argument model from its hints.

The decorator does no I/O and registers nothing global: the tool's ``ToolSpec`` names
the function by import path (``module:qualname``), and the agent worker, which loads
the same plugin, resolves that path when the model calls the tool.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal, get_type_hints

from pydantic import BaseModel, ConfigDict, create_model

from warmloop.workflows.profiles.base import PythonRunner, ToolRetry, ToolSpec


@dataclass(frozen=True)
class ToolContext:
    """What a tool function may ask for with a parameter annotated ``ToolContext``
    (never shown to the model): which job and step called it, and the key a side
    effect should be made idempotent with."""

    job_id: str
    step: int
    task_id: str
    idempotency_key: str
    """``<job>:<step>:<tool>``: the same for every retry of one call; for a tool with an
    ``effect_key``, ``<job>:<tool>:<digest of the effect's identity>``, the same for
    every call that changes the same thing (``<tenant>/*`` in place of the job
    with ``effect_scope="tenant"``: the same in every job of the tenant)."""


class FunctionTool:
    """A decorated tool function: still callable as before, plus its ``spec``."""

    def __init__(self, fn: Callable[..., Any], spec: ToolSpec, context_param: str | None
                 ) -> None:
        self.fn = fn
        self.spec = spec
        self.context_param = context_param
        self.is_async = inspect.iscoroutinefunction(fn)
        self.__doc__ = fn.__doc__
        self.__name__ = getattr(fn, "__name__", spec.name)
        self.__qualname__ = getattr(fn, "__qualname__", spec.name)
        self.__module__ = fn.__module__

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.fn(*args, **kwargs)

    def __repr__(self) -> str:
        return f"<warmloop tool {self.spec.name} ({self.__module__}:{self.__qualname__})>"


def tool(
    fn: Callable[..., Any] | None = None, *, name: str | None = None,
    description: str | None = None, side_effect: bool = False, finishes_job: bool = False,
    max_calls: int | None = None, timeout_s: float = 30.0, max_attempts: int = 3,
    retry_initial_interval_s: float = 0.5, non_retryable: tuple[str, ...] = (),
    pause_median_s: float = 1.0, pause_p90_s: float = 5.0,
    effect_key: tuple[str, ...] | None = None, task_args: tuple[str, ...] = (),
    read_only: bool = False, effect_scope: Literal["job", "tenant"] = "job",
) -> Any:
    """Make a function a tool. Its parameters become the tool's arguments: every one
    must be annotated, and strings must be bounded (``Literal[...]`` or
    ``Annotated[str, Field(pattern=...)]``), or the decorator raises at import time.
    A parameter annotated ``ToolContext`` receives the call's context instead.

    The function may be sync (it runs in a thread) or async. It returns what the model
    reads: a string, any JSON value, or a pydantic model. An expected failure should be
    returned as text for the model (``"not found: ..."``); a raised exception is retried
    (``max_attempts``) and then reported to the model as a failed tool.

    ``side_effect=True``: the worker records the call's result in the effect ledger and a
    retry of the same call returns it without calling the function again; the function
    should still pass ``ToolContext.idempotency_key`` to whatever it changes.

    ``effect_key`` (opt-in, with ``side_effect=True``): the parameters that, with the tool
    and the task's record id, identify what the call changes; the function then runs
    once per that identity in a job, not once per step (``ToolSpec.effect_key``);
    ``effect_scope="tenant"``: once per identity across all of the tenant's jobs
    (``ToolSpec.effect_scope``).
    ``task_args``: parameters that must name the job's own task record, or the call is
    refused before the function runs (``ToolSpec.task_args``).

    ``read_only=True`` (never with ``side_effect``): the function changes nothing, so a
    call past the tool's observed p95 may get a second identical call, the first answer
    winning (``ToolSpec.read_only``). An async function's losing call is cancelled; a
    sync function's runs on in its thread until it returns (Python cannot stop a thread).
    """

    def wrap(f: Callable[..., Any]) -> FunctionTool:
        hints = get_type_hints(f, include_extras=True)
        fields: dict[str, Any] = {}
        context_param = None
        for pname, param in inspect.signature(f).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {f.__qualname__}: *args/**kwargs cannot be arguments")
            hint = hints.get(pname)
            if hint is None:
                raise TypeError(f"tool {f.__qualname__}: parameter {pname!r} needs a type hint")
            if hint is ToolContext:
                context_param = pname
                continue
            default = ... if param.default is param.empty else param.default
            fields[pname] = (hint, default)
        tool_name = name or f.__name__
        args: type[BaseModel] = create_model(  # type: ignore[call-overload]
            f"{tool_name.title().replace('_', '')}Args",
            __config__=ConfigDict(extra="forbid"), **fields)
        doc = description or inspect.getdoc(f)
        if not doc:
            raise TypeError(f"tool {f.__qualname__}: give it a docstring or a description "
                            "(the model reads it)")
        spec = ToolSpec(
            name=tool_name, description=doc, args=args, finishes_job=finishes_job,
            max_calls=max_calls, side_effect=side_effect, effect_key=effect_key,
            effect_scope=effect_scope,
            task_args=task_args, timeout_s=timeout_s,
            retry=ToolRetry(max_attempts=max_attempts,
                            initial_interval_s=retry_initial_interval_s,
                            non_retryable=non_retryable),
            pause_median_s=pause_median_s, pause_p90_s=pause_p90_s,
            runner=None if finishes_job else PythonRunner(f"{f.__module__}:{f.__qualname__}"),
            read_only=read_only,
        )
        return FunctionTool(f, spec, context_param)

    return wrap if fn is None else wrap(fn)

