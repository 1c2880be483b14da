"""Grade a finished job against its case's ground truth (``world``): per field and the
whole task. Used by ``make eval-model`` (held-out cases) and ``make demo`` (the bundled
tickets and invoices), so both judge by the same rules.

Tickets: ``category`` (search_kb called with the right topic, and only it; no search
for a vague ticket), ``priority`` (set_priority and finish both carry the right one),
``resolution`` (finish's), ``reply`` (one draft citing the right article in the right
tone; none for an escalated or vague ticket), ``finish`` (the job called finish).
Invoices: ``flags`` (every discrepancy kind flagged, no other), ``payment`` (the exact
total approved when nothing is wrong; nothing paid otherwise), ``outcome`` (finish's),
``finish``. ``whole_task``: every field right.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from warmloop.infra.demo_model import world as W

TICKET_FIELDS = ("category", "priority", "resolution", "reply", "finish")
INVOICE_FIELDS = ("flags", "payment", "outcome", "finish")

Call = tuple[str, dict[str, Any], str]
"""(tool, arguments, what the tool answered)."""


@dataclass(frozen=True)
class Grade:
    profile: str
    fields: dict[str, bool]

    @property
    def whole_task(self) -> bool:
        return all(self.fields.values())


def grade_ticket(truth: W.TicketTruth, state: str, final: dict[str, Any] | None,
                 calls: list[Call]) -> Grade:
    final = final or {}
    topics = [a.get("topic") for n, a, _ in calls if n == "search_kb"]
    priorities = [a.get("priority") for n, a, _ in calls if n == "set_priority"]
    replies = [(a.get("kb_article"), a.get("tone")) for n, a, _ in calls if n == "draft_reply"]
    return Grade("ticket-triage", {
        "category": topics == ([truth.topic] if truth.topic else []),
        "priority": priorities == [truth.priority] and final.get("priority") == truth.priority,
        "resolution": final.get("resolution") == truth.resolution,
        "reply": replies == ([(truth.kb, truth.tone)] if truth.kb else []),
        "finish": state == "FINISHED",
    })


def grade_invoice(truth: W.InvoiceTruth, state: str, final: dict[str, Any] | None,
                  calls: list[Call]) -> Grade:
    final = final or {}
    flagged = {a.get("reason") for n, a, out in calls
               if n == "flag_discrepancy" and "flagged:" in out}
    paid = [a.get("amount") for n, a, out in calls
            if n == "approve_payment" and out.startswith("payment of")]
    if truth.amount is None:
        payment_ok = not paid
    else:
        payment_ok = len(paid) == 1 and abs(float(paid[0] or 0) - truth.amount) < 0.005
    return Grade("invoice-reconciliation", {
        "flags": flagged == set(truth.flags),
        "payment": payment_ok,
        "outcome": final.get("outcome") == truth.outcome,
        "finish": state == "FINISHED",
    })


def calls_from_transcript(transcript: list[Any]) -> list[Call]:
    """(tool, arguments, answer) of each call in a job's transcript (``ChatMessage``s)."""
    answers = {m.tool_call_id: m.content for m in transcript
               if m.role == "tool" and m.tool_call_id}
    out: list[Call] = []
    for m in transcript:
        for c in (m.tool_calls or []) if m.role == "assistant" else []:
            try:
                args = json.loads(c.function.arguments or "{}")
            except ValueError:
                continue
            if isinstance(args, dict) and c.id in answers:
                out.append((c.function.name, args, answers[c.id]))
    return out


_BUNDLED: dict[str, Any] | None = None


def bundled_truth(profile: str, task: dict[str, Any]) -> W.TicketTruth | W.InvoiceTruth | None:
    """Ground truth of a bundled ticket or invoice task (what ``make demo`` runs)."""
    global _BUNDLED
    if _BUNDLED is None:
        _BUNDLED = {"world": W.bundled_world()}
    world: W.World = _BUNDLED["world"]
    if profile == "ticket-triage":
        facts = W.BUNDLED_TICKET_FACTS.get(str(task.get("ticket_id")))
        customer = world.customers.get(str(task.get("customer_id")))
        if facts is None or customer is None:
            return None
        return W.ticket_truth(facts, customer)
    if profile == "invoice-reconciliation" and "invoice_id" in task:
        return W.invoice_truth(task, world.invoices, world.purchase_orders, world.vendors)
    return None


def grade_job(profile: str, truth: W.TicketTruth | W.InvoiceTruth, state: str,
              final: dict[str, Any] | None, calls: list[Call]) -> Grade:
    if isinstance(truth, W.TicketTruth):
        return grade_ticket(truth, state, final, calls)
    return grade_invoice(truth, state, final, calls)


def grade_result(result: Any, task: dict[str, Any]) -> Grade | None:
    """A finished ``JobResult`` of a bundled task, graded; None when the task is not
    bundled or its transcript is not in the result (stored in S3 only)."""
    truth = bundled_truth(result.profile, task)
    if truth is None or (not result.transcript and result.transcript_messages):
        return None
    return grade_job(result.profile, truth, result.state.value,
                     result.final, calls_from_transcript(result.transcript))
