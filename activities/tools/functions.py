"""Python tools by import path: what the agent worker and the plugin loader resolve
``PythonRunner.function`` with (workflow code never imports a tool's module)."""

from __future__ import annotations

import importlib
from typing import Any

from warmloop.workflows.profiles.function_tools import FunctionTool


def resolve_function_tool(path: str) -> FunctionTool:
    """``module:qualname`` to the decorated function; raises ImportError/AttributeError/
    TypeError saying what is wrong; an error raised while importing the tool's module
    is raised as ImportError naming it."""
    module_name, _, qualname = path.partition(":")
    try:
        obj: Any = importlib.import_module(module_name)
    except ImportError:
        raise
    except Exception as e:
        raise ImportError(f"importing {module_name} raised {type(e).__name__}: {e}") from e
    for part in qualname.split("."):
        obj = getattr(obj, part)
    if not isinstance(obj, FunctionTool):
        raise TypeError(f"{path} is not decorated with @warmloop.tool")
    return obj
