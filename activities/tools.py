"""Tools the agents call, run as the ``run_tool`` activity on the agent task queue."""

from __future__ import annotations

import abc
import json
from importlib import resources
from typing import Any

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from workflows.contracts import ToolRequest, ToolResult

log = structlog.get_logger(__name__)


class Toolset(abc.ABC):
    """The tools of one profile."""

    profile: str

    @abc.abstractmethod
    def run(self, req: ToolRequest) -> ToolResult:
        """Run one validated call. Expected failures (not found, ...) are results the model
        reads, with ``ok=False``; only unexpected errors raise."""


def _load_json(package: str, name: str) -> Any:
    return json.loads(resources.files(package).joinpath(name).read_text())


class TicketTriageTools(Toolset):
    """Tools over the bundled customers and knowledge base.

    Side effects (priority, drafted reply) are keyed by (job, step): a retried or
    replayed activity writes the same record again instead of a second one.
    """

    profile = "ticket-triage"

    def __init__(self, customers: dict[str, Any], kb: dict[str, Any]) -> None:
        self._customers = customers
        self._kb = kb
        self.effects: dict[tuple[str, int], dict[str, Any]] = {}

    @classmethod
    def bundled(cls) -> TicketTriageTools:
        pkg = "activities.data.ticket_triage"
        return cls(_load_json(pkg, "customers.json"), _load_json(pkg, "kb.json"))

    def run(self, req: ToolRequest) -> ToolResult:
        a = req.arguments
        match req.name:
            case "lookup_customer":
                c = self._customers.get(a["customer_id"])
                if c is None:
                    return ToolResult(ok=False, output=f"no customer {a['customer_id']}")
                return ToolResult(ok=True, output=json.dumps(c, sort_keys=True))
            case "search_kb":
                hits = [{"id": k, "title": v["title"]} for k, v in sorted(self._kb.items())
                        if v["topic"] == a["topic"]]
                return ToolResult(ok=True, output=json.dumps(hits))
            case "set_priority":
                self.effects[(req.job_id, req.step)] = {"priority": a["priority"]}
                return ToolResult(ok=True, output=f"priority set to {a['priority']}")
            case "draft_reply":
                article = self._kb.get(a["kb_article"])
                if article is None:
                    return ToolResult(ok=False, output=f"no article {a['kb_article']}")
                self.effects[(req.job_id, req.step)] = {"reply": a["kb_article"],
                                                        "tone": a["tone"]}
                return ToolResult(ok=True, output=f"reply drafted citing "
                                  f"{a['kb_article']} ({article['title']}), tone {a['tone']}")
        raise ApplicationError(f"ticket-triage has no tool {req.name!r}", non_retryable=True)


class ToolActivities:
    def __init__(self, toolsets: list[Toolset]) -> None:
        self._toolsets = {t.profile: t for t in toolsets}

    @activity.defn(name="run_tool")
    async def run_tool(self, req: ToolRequest) -> ToolResult:
        toolset = self._toolsets.get(req.profile)
        if toolset is None:
            raise ApplicationError(f"no toolset for profile {req.profile!r}", non_retryable=True)
        with structlog.contextvars.bound_contextvars(job_id=req.job_id, step=req.step):
            result = toolset.run(req)
            log.info("tool_ran", tool=req.name, ok=result.ok)
        return result
