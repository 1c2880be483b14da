"""`python -m bench.make_trace`: a deterministic trace for `warmloop replay`.

It mixes both kinds of line. Ticket-triage jobs over the bundled tickets: each calls
the profile's tools with results built from the bundled customers and knowledge base
(what the real tools answer), an urgent priority waits for a human (a long pause).
And jobs of two inline prompts that no profile registers: a statement reconciler that
gives its tool schemas, and a release-notes writer that gives none (replay offers each
tool it calls with open parameters). The same seed writes the same bytes.
"""

from __future__ import annotations

import argparse
import json
import random
from importlib import resources
from pathlib import Path
from typing import Any

DEFAULT_OUT = Path(__file__).parent / "traces" / "tickets-40.jsonl"
TOPICS = {"crash": "crash", "charged": "billing", "invoice": "billing", "log in": "login",
          "login": "login", "password": "login", "refund": "refund", "slow": "performance",
          "deliver": "shipping", "package": "shipping", "account": "account"}

RECONCILER = "\n".join([
    "You reconcile supplier statements against the company ledger, one statement per job.",
    "Work in small steps: call exactly one tool per reply and read its result before the",
    "next. Never answer in free text.",
    "",
    "## Procedure",
    "1. fetch_statement with the statement id from the task: its lines, each with a line",
    "   number, an invoice number, a date and an amount.",
    "2. list_ledger for the supplier and month: the ledger entries the company booked.",
    "3. match_lines: pair statement lines with ledger entries by invoice number first,",
    "   then by amount and date within three days. Send the pairs you are sure of.",
    "4. For each statement line without a ledger entry, or with an amount that differs by",
    "   more than one cent, flag_discrepancy with the line number and a reason code.",
    "5. done with status matched when every line is paired, otherwise needs_review.",
    "",
    "## Rules",
    "- Amounts are in the statement's currency; never convert.",
    "- A credit note is a negative line; it pairs with a negative ledger entry only.",
    "- Do not pair one ledger entry with two statement lines.",
    "- Reason codes: missing_in_ledger, amount_mismatch, duplicate, date_out_of_period.",
    "- Keep within the step budget shown at the end of the conversation.",
])
RECONCILER_TOOLS = [
    {"type": "function", "function": {
        "name": "fetch_statement", "description": "The lines of a supplier statement.",
        "parameters": {"type": "object", "properties": {
            "statement_id": {"type": "string", "pattern": "^S-[0-9]{3}$"}},
            "required": ["statement_id"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "list_ledger", "description": "Ledger entries of a supplier in a month.",
        "parameters": {"type": "object", "properties": {
            "supplier": {"type": "string", "pattern": "^[A-Z][a-z]+$"},
            "month": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]$"}},
            "required": ["supplier", "month"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "match_lines", "description": "Record statement line / ledger entry pairs.",
        "parameters": {"type": "object", "properties": {
            "pairs": {"type": "array", "items": {"type": "string",
                                                 "pattern": "^[0-9]{1,2}:L[0-9]{3}$"}}},
            "required": ["pairs"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "flag_discrepancy", "description": "Flag a statement line for review.",
        "parameters": {"type": "object", "properties": {
            "line": {"type": "integer"},
            "reason": {"type": "string", "enum": ["missing_in_ledger", "amount_mismatch",
                                                  "duplicate", "date_out_of_period"]}},
            "required": ["line", "reason"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "done", "description": "End the job.",
        "parameters": {"type": "object", "properties": {
            "status": {"type": "string", "enum": ["matched", "needs_review"]}},
            "required": ["status"], "additionalProperties": False}}},
]
SUPPLIERS = ["Acme", "Borealis", "Castor", "Dunmore", "Elstree"]

WRITER = "\n".join([
    "You write the release notes of one product release from its merged pull requests.",
    "Read each pull request with read_pr, then write one section per area with",
    "write_section, then call done. One tool call per reply.",
    "Sections: Features, Fixes, Performance, Breaking changes (only when there are any).",
    "Each entry is one sentence in the past tense that a customer understands, ending with",
    "the pull request number in brackets. Never mention internal ticket ids or people.",
])
AREAS = ["billing", "search", "exports", "notifications", "login", "reports"]
VERBS = ["Fixed", "Added", "Sped up", "Reworked", "Removed", "Documented"]


def _bundled(name: str) -> Any:
    text = resources.files("warmloop.activities.data.ticket_triage").joinpath(name).read_text()
    return [json.loads(x) for x in text.splitlines() if x.strip()] if name.endswith(
        ".jsonl") else json.loads(text)


def _step(name: str, args: dict[str, Any], result: str, pause_s: float,
          out: int) -> dict[str, Any]:
    return {"call": {"name": name, "arguments": args}, "result": result,
            "pause_s": round(pause_s, 2), "output_tokens": out}


def ticket_job(rng: random.Random, ticket: dict[str, Any], customers: dict[str, Any],
               kb: dict[str, Any]) -> dict[str, Any]:
    text = f"{ticket['subject']} {ticket['body']}".lower()
    topic = next((t for k, t in TOPICS.items() if k in text),
                 rng.choice(sorted(set(TOPICS.values()))))
    customer = customers.get(ticket["customer_id"])
    hits = [{"id": k, "title": v["title"]} for k, v in sorted(kb.items())
            if v["topic"] == topic]
    vip = bool(customer and (customer["vip"] or customer["plan"] == "enterprise"))
    priority = rng.choice(["urgent", "high"] if vip else ["low", "normal", "normal", "high"])
    steps = [
        _step("lookup_customer", {"customer_id": ticket["customer_id"]},
              json.dumps(customer, sort_keys=True) if customer
              else f"no customer {ticket['customer_id']}", rng.uniform(0.2, 0.8),
              rng.randint(16, 22)),
        _step("search_kb", {"topic": topic}, json.dumps(hits), rng.uniform(0.3, 1.2),
              rng.randint(12, 16)),
        # urgent waits for a team lead's approval: the long pause a hold is for
        _step("set_priority", {"priority": priority}, f"priority set to {priority}",
              rng.uniform(3.0, 6.0) if priority == "urgent" else rng.uniform(0.2, 0.5),
              rng.randint(11, 14)),
    ]
    resolution = "escalated" if priority == "urgent" else "resolved"
    if hits and resolution == "resolved":
        tone = "formal" if vip else "friendly"
        steps.append(_step("draft_reply", {"kb_article": hits[0]["id"], "tone": tone},
                           f"reply drafted citing {hits[0]['id']} ({hits[0]['title']}), "
                           f"tone {tone}", rng.uniform(0.5, 1.5), rng.randint(20, 26)))
    steps.append(_step("finish", {"resolution": resolution, "priority": priority}, "",
                       0.0, rng.randint(18, 24)))
    return {"profile": "ticket-triage", "task": ticket, "steps": steps}


def reconciler_job(rng: random.Random, i: int) -> dict[str, Any]:
    supplier, month = rng.choice(SUPPLIERS), f"2025-{rng.randint(1, 12):02d}"
    lines = [{"line": n + 1, "invoice": f"INV-{rng.randint(1000, 9999)}",
              "date": f"{month}-{rng.randint(1, 28):02d}",
              "amount": round(rng.uniform(-200, 4000), 2)} for n in range(rng.randint(5, 9))]
    ledger = [{"entry": f"L{100 + n}", "invoice": x["invoice"], "amount": x["amount"]}
              for n, x in enumerate(lines) if rng.random() < 0.8]
    sid = f"S-{100 + i:03d}"
    steps = [
        _step("fetch_statement", {"statement_id": sid}, json.dumps(lines),
              rng.uniform(0.3, 1.0), rng.randint(14, 18)),
        _step("list_ledger", {"supplier": supplier, "month": month}, json.dumps(ledger),
              rng.uniform(0.5, 1.5), rng.randint(18, 24)),
    ]
    paired = {e["invoice"]: e["entry"] for e in ledger}
    pairs = [f"{x['line']}:{paired[x['invoice']]}" for x in lines if x["invoice"] in paired]
    for chunk in range(0, len(pairs), 4):
        part = pairs[chunk:chunk + 4]
        steps.append(_step("match_lines", {"pairs": part}, f"{len(part)} pairs recorded",
                           rng.uniform(0.2, 0.6), 12 + 8 * len(part)))
    missing = [x["line"] for x in lines if x["invoice"] not in paired]
    for line in missing[:2]:
        steps.append(_step("flag_discrepancy", {"line": line, "reason": "missing_in_ledger"},
                           f"line {line} flagged", rng.uniform(0.2, 0.5), rng.randint(20, 26)))
    steps.append(_step("done", {"status": "needs_review" if missing else "matched"}, "", 0.0,
                       rng.randint(9, 12)))
    return {"system_prompt": RECONCILER, "tools": RECONCILER_TOOLS,
            "task": {"statement_id": sid, "supplier": supplier, "month": month},
            "steps": steps}


def writer_job(rng: random.Random, i: int) -> dict[str, Any]:
    prs = sorted(rng.sample(range(4100, 4400), rng.randint(2, 4)))
    steps = []
    for pr in prs:
        area = rng.choice(AREAS)
        body = (f"#{pr} {rng.choice(VERBS)} {area}: " + " ".join(
            rng.choice(["the", "export", "retry", "queue", "timeout", "cache", "page", "user",
                        "invoice", "filter", "limit", "error"]) for _ in range(30)))
        steps.append(_step("read_pr", {"number": pr}, body, rng.uniform(0.3, 0.9),
                           rng.randint(10, 13)))
    steps.append(_step("write_section", {"title": "Fixes", "entries": len(prs)}, "saved",
                       rng.uniform(0.3, 0.8), rng.randint(60, 120)))
    steps.append(_step("done", {}, "", 0.0, rng.randint(6, 9)))
    return {"system_prompt": WRITER,
            "task": f"Release notes for v2.{i // 3}.{i % 3}: PRs {', '.join(map(str, prs))}",
            "steps": steps}


def make_trace(jobs: int = 40, seed: int = 12) -> list[dict[str, Any]]:
    """About 60% ticket-triage, 25% reconciler, 15% release notes, interleaved."""
    rng = random.Random(seed)
    tickets, customers, kb = (_bundled("tickets.jsonl"), _bundled("customers.json"),
                              _bundled("kb.json"))
    out = []
    for i in range(jobs):
        r = rng.random()
        if r < 0.6:
            out.append(ticket_job(rng, tickets[i % len(tickets)], customers, kb))
        elif r < 0.85:
            out.append(reconciler_job(rng, i))
        else:
            out.append(writer_job(rng, i))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=40)
    p.add_argument("--seed", type=int, default=12)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = p.parse_args(argv)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    lines = make_trace(args.jobs, args.seed)
    args.out.write_text("".join(json.dumps(x) + "\n" for x in lines))
    kinds = [("profile" if "profile" in x else "inline") for x in lines]
    print(f"{args.out}: {len(lines)} jobs ({kinds.count('profile')} ticket-triage, "
          f"{kinds.count('inline')} inline prompts), "
          f"{sum(len(x['steps']) for x in lines)} steps")


if __name__ == "__main__":
    main()
