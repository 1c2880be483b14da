"""Agent profiles: a stable system prompt, a task schema and a set of strict tools.

Which profiles exist is decided by the plugins a process loads
(``warmloop.workers.plugins``), the bundled ones included; look them up here.
"""

from warmloop.workflows.profiles.base import (
    ActivityRunner,
    ApprovalRule,
    HttpRunner,
    Profile,
    PythonRunner,
    ToolCallError,
    ToolRetry,
    ToolRunner,
    ToolSpec,
)
from warmloop.workflows.profiles.registry import (
    REGISTRY,
    DuplicateProfileError,
    RegisteredProfile,
    UnknownProfileError,
    get_profile,
)

__all__ = [
    "REGISTRY", "ActivityRunner", "ApprovalRule", "DuplicateProfileError", "HttpRunner",
    "Profile", "PythonRunner", "RegisteredProfile", "ToolCallError", "ToolRetry",
    "ToolRunner", "ToolSpec", "UnknownProfileError", "get_profile",
]
