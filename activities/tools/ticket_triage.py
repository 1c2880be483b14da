"""Tools of ``ticket-triage`` over the bundled customers and knowledge base."""

from __future__ import annotations

import json
from typing import Any

from temporalio.exceptions import ApplicationError

from warmloop.activities.tools.base import ToolOutcome, Toolset, load_json
from warmloop.workflows.contracts import ToolRequest, ToolResult


class TicketTriageTools(Toolset):
    profile = "ticket-triage"

    def __init__(self, customers: dict[str, Any], kb: dict[str, Any]) -> None:
        self._customers = customers
        self._kb = kb

    @classmethod
    def bundled(cls) -> TicketTriageTools:
        pkg = "warmloop.activities.data.ticket_triage"
        return cls(load_json(pkg, "customers.json"), load_json(pkg, "kb.json"))

    def run(self, req: ToolRequest) -> ToolOutcome:
        a = req.arguments
        match req.name:
            case "lookup_customer":
                c = self._customers.get(a["customer_id"])
                if c is None:
                    missing = f"no customer {a['customer_id']}"
                    return ToolOutcome(ToolResult(ok=False, output=missing))
                return ToolOutcome(ToolResult(ok=True, output=json.dumps(c, sort_keys=True)))
            case "search_kb":
                hits = [{"id": k, "title": v["title"]} for k, v in sorted(self._kb.items())
                        if v["topic"] == a["topic"]]
                return ToolOutcome(ToolResult(ok=True, output=json.dumps(hits)))
            case "set_priority":
                return ToolOutcome(
                    ToolResult(ok=True, output=f"priority set to {a['priority']}"),
                    effect={"ticket": req.task_id, "priority": a["priority"]},
                )
            case "draft_reply":
                article = self._kb.get(a["kb_article"])
                if article is None:
                    return ToolOutcome(ToolResult(ok=False, output=f"no article {a['kb_article']}"))
                return ToolOutcome(
                    ToolResult(ok=True, output=f"reply drafted citing {a['kb_article']} "
                               f"({article['title']}), tone {a['tone']}"),
                    effect={"ticket": req.task_id, "reply": a["kb_article"], "tone": a["tone"]},
                )
        raise ApplicationError(f"ticket-triage has no tool {req.name!r}", type="UnknownTool",
                               non_retryable=True)
