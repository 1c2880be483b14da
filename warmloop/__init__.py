"""warmloop: durable Temporal agent jobs on warm vLLM prefix caches.

The public API. Bring your own agent as a profile (Python or YAML), its tools as
functions (``@tool``), HTTP endpoints or your own Temporal activities, and submit jobs
with ``JobClient``. Everything else lives in the subpackages ``warmloop.workflows``
(pure: contracts and policies), ``warmloop.activities`` (I/O), ``warmloop.workers``
(processes, CLI) and ``warmloop.infra`` (the embedded stack).
"""

from typing import TYPE_CHECKING, Any

from warmloop.activities.tools.base import ToolOutcome, Toolset
from warmloop.workers.jobs import (
    BatchListing,
    InvalidJobError,
    JobClient,
    JobListing,
    UnservableJobError,
)
from warmloop.workers.plugins import LoadedPlugins, PluginError, load_plugins
from warmloop.workers.settings import EngineEndpoint, Settings
from warmloop.workers.temporal_plugin import WarmloopPlugin
from warmloop.workflows.budgets import JobLimits, OutputBudgets
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    JobInput,
    JobResult,
    JobState,
    JobStatus,
    Lane,
    ToolRequest,
    ToolResult,
)
from warmloop.workflows.ladder import HardCall, ModelLadder
from warmloop.workflows.profiles import (
    REGISTRY,
    ActivityRunner,
    ApprovalRule,
    HttpRunner,
    Profile,
    PythonRunner,
    ToolRetry,
    ToolSpec,
    get_profile,
)
from warmloop.workflows.profiles.function_tools import FunctionTool, ToolContext, tool

if TYPE_CHECKING:
    from warmloop.workers.openai_agents import WarmloopModelProvider, warmloop_agents_plugin

__all__ = [
    "AGENT_TASK_QUEUE", "REGISTRY", "ActivityRunner", "ApprovalRule", "BatchListing",
    "EngineEndpoint",
    "FunctionTool", "HardCall", "HttpRunner", "InvalidJobError", "JobClient", "JobInput",
    "JobLimits", "JobListing", "JobResult", "JobState", "JobStatus", "Lane", "LoadedPlugins",
    "ModelLadder", "OutputBudgets", "PluginError", "Profile", "PythonRunner", "Settings",
    "ToolContext", "ToolOutcome", "ToolRequest", "ToolResult", "ToolRetry", "ToolSpec",
    "Toolset", "UnservableJobError", "WarmloopModelProvider", "WarmloopPlugin", "get_profile",
    "load_plugins", "tool", "warmloop_agents_plugin",
]
_AGENTS = {"WarmloopModelProvider", "warmloop_agents_plugin"}


def __getattr__(name: str) -> Any:
    """The OpenAI Agents SDK integration, imported on first use: it needs the optional
    ``warmloop[agents]`` extra, and ``import warmloop`` must work without it."""
    if name in _AGENTS:
        from warmloop.workers import openai_agents

        return getattr(openai_agents, name)
    raise AttributeError(f"module 'warmloop' has no attribute {name!r}")
__version__ = "0.1.0"
