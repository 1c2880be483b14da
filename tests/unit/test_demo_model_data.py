"""The demo model's training data: prompts rendered as the worker assembles them, a
held-out split that shares no case or phrasing with training, ground truth consistent
with the tools' data, and a tokenizer that keeps ids the same tokens everywhere."""

from __future__ import annotations

import asyncio
import json
import random
from typing import Any

import pytest

from warmloop.infra.demo_model import data as D
from warmloop.infra.demo_model import world as W
from warmloop.infra.demo_model.runtime import RequestBuilder, chat_inputs, load_profiles


@pytest.fixture(scope="module")
def base() -> W.World:
    load_profiles()
    return W.bundled_world()


@pytest.fixture(scope="module")
def rendered(base: W.World) -> list[tuple[D.Case, D.Transcript, str]]:
    """Transcripts of a bundled ticket, a bundled invoice and two generated cases."""
    tok = D.renderer()
    builder = RequestBuilder()
    picked = [D.bundled_ticket_cases()[0], D.bundled_invoice_cases()[17],
              *D.cases("train", 1, 1, seed=3)]

    async def go() -> list[tuple[D.Case, D.Transcript, str]]:
        rng = random.Random(0)
        return [(c, *(await D.transcript(c, base, builder, tok, rng))) for c in picked]

    return asyncio.run(go())


def test_prompts_are_the_workers_assembly_rendered_by_the_chat_template(
        rendered: list[tuple[D.Case, D.Transcript, str]], base: W.World) -> None:
    """Rebuild every step's messages with the workflow's own ``assemble_prompt`` and the
    profile's tool schemas, render them with the model's chat template: the stored
    prompt pieces are those bytes."""
    from warmloop.workflows.contracts import ChatMessage, FunctionCall, ToolCall
    from warmloop.workflows.profiles import get_profile
    from warmloop.workflows.prompt import assemble_prompt

    tok = D.renderer()
    for case, t, prefix in rendered:
        profile = get_profile(case.profile)
        task = profile.validate_task(case.task)
        transcript: list[ChatMessage] = []
        results = _tool_answers(t.trunk)
        for i, step in enumerate(t.steps):
            tail = step["tail"].removeprefix("<|user|>\n").split("<|end|>")[0]
            messages = assemble_prompt(profile, task, transcript, tail=tail)
            body: dict[str, Any] = {"model": "tiny",
                                    "messages": [m.to_openai() for m in messages],
                                    "tools": profile.tool_schemas()}
            msgs, tools = chat_inputs(body)
            expected = tok.apply_chat_template(msgs, tools=tools, add_generation_prompt=True,
                                               tokenize=False)
            assert prefix + t.trunk[:step["at"]] + step["tail"] == expected, case.case_id
            call = json.loads(step["target"].removeprefix("<tool_call>")
                              .removesuffix("</tool_call><|end|>"))
            tc = ToolCall(id=f"c{i}", function=FunctionCall(
                name=call["name"], arguments=json.dumps(call["arguments"])))
            transcript += [ChatMessage(role="assistant", tool_calls=[tc]),
                           ChatMessage(role="tool", tool_call_id=f"c{i}",
                                       content=results[i] if i < len(results) else "done")]


def _tool_answers(trunk: str) -> list[str]:
    return [part.split("<|end|>")[0] for part in trunk.split("<|tool|>\n")[1:]]


def test_targets_are_the_correct_calls(rendered: list[tuple[D.Case, D.Transcript, str]],
                                       base: W.World) -> None:
    for case, t, _ in rendered:
        calls = [json.loads(s["target"].removeprefix("<tool_call>")
                            .removesuffix("</tool_call><|end|>")) for s in t.steps]
        assert [(c["name"], c["arguments"]) for c in calls] == case.truth_calls(base)


def test_heldout_split_shares_no_case_or_phrasing_with_training() -> None:
    train = D.cases("train", 400, 150, seed=0)
    held = D.cases("heldout", 120, 60, seed=0)
    tickets = [c for c in train if c.profile == D.TICKET]
    held_tickets = [c for c in held if c.profile == D.TICKET]
    train_ids = {c.task["customer_id"] for c in tickets}
    assert not train_ids & {c.task["customer_id"] for c in held_tickets}
    assert {c.task["customer_id"] for c in held_tickets} <= D.HELDOUT_CUSTOMER_IDS
    for sc in W.SCENARIOS.values():
        assert not set(sc.subjects.train) & set(sc.subjects.heldout)
        assert not set(sc.bodies.train) & set(sc.bodies.heldout)
    train_subjects = {c.task["subject"] for c in tickets}
    held_subjects = {c.task["subject"] for c in held_tickets}
    assert not train_subjects & held_subjects
    train_bodies = {c.task["body"] for c in tickets}
    assert not train_bodies & {c.task["body"] for c in held_tickets}
    invoices = [c for c in train if c.profile == D.INVOICE]
    held_invoices = [c for c in held if c.profile == D.INVOICE]
    held_vendors = {v for c in held_invoices for v in c.world["vendors"]}
    assert held_vendors and not held_vendors & {v for c in invoices for v in c.world["vendors"]}
    assert held_vendors <= D.HELDOUT_VENDOR_IDS
    held_notes = {c.task["note"] for c in held_invoices} - {""}
    assert held_notes and not held_notes & set(W.NOTES.train)


def test_bundled_ground_truth_reads_the_tools_data(base: W.World) -> None:
    cases = D.bundled_ticket_cases()
    assert {c.task["ticket_id"] for c in cases} == set(W.BUNDLED_TICKET_FACTS)
    for case in cases:
        truth = D.truth_of(case, base)
        assert isinstance(truth, W.TicketTruth)
        assert case.task["customer_id"] in base.customers
        if truth.kb is not None:
            assert base.kb[truth.kb]["topic"] == truth.topic
        if truth.resolution == "escalated":
            assert truth.priority in ("high", "urgent") and truth.kb is None
    by_id: dict[str, Any] = {c.task["ticket_id"]: D.truth_of(c, base) for c in cases}
    # the system prompt's own examples: an enterprise crash is urgent; a pro VIP charged
    # twice is escalated urgent; T1001 (pro, 4 open tickets): a crash, high, moved up
    assert by_id["T1002"] == W.TicketTruth("billing", "urgent", "escalated", None, None)
    assert by_id["T1001"] == W.TicketTruth("crash", "urgent", "resolved", "KB107", "friendly")
    assert by_id["T1004"].priority == "low" and by_id["T1004"].kb == "KB104"
    for sc in W.SCENARIOS.values():
        if sc.kb is not None:
            assert base.kb[sc.kb]["topic"] == sc.topic, sc.name


def test_generated_invoices_carry_the_discrepancies_they_were_seeded_with(
        base: W.World) -> None:
    from warmloop.activities.tools.invoice_reconciliation import InvoiceReconciliationTools

    for case in [c for c in D.cases("train", 0, 300, seed=5) if c.profile == D.INVOICE]:
        truth = D.truth_of(case, base)
        assert isinstance(truth, W.InvoiceTruth)
        assert case.facts is not None
        plan, seeded = case.facts["plan"], set(case.facts["seeded"])
        if plan in ("no_invoice", "no_po"):
            assert truth.outcome == "needs_review"
        elif plan in ("match", "rounding"):
            assert truth.outcome == "paid" and truth.flags == ()
        else:
            assert truth.outcome == "flagged", case.case_id
            # a combination that drops a line may drop the very line it mispriced or
            # miscounted: then that kind is gone and the missing line is what is seen
            lost = seeded - set(truth.flags)
            assert not lost or (lost <= {"price_mismatch", "quantity_mismatch"}
                                and "missing_line" in truth.flags), case.case_id
        if truth.amount is not None:
            wd = case.full_world(base)
            assert truth.amount == wd.invoices[case.task["invoice_id"]]["total"]
        assert list(truth.flags) == [k for k in (
            InvoiceReconciliationTools.compare.__globals__["SEVERITY"]) if k in truth.flags]


def test_tokenizer_keeps_ids_and_amounts_the_same_tokens_everywhere() -> None:
    from warmloop.infra.demo_model.tokenizer import build_tokenizer

    corpus = ["lookup the customer C115 now", '{"customer_id":"C115"}',
              "payment of 1120.50 approved for invoice INV4414", "price_mismatch"] * 50
    tok = build_tokenizer(corpus, vocab_size=400)

    def pieces(text: str) -> list[str]:
        return list(tok.convert_ids_to_tokens(tok(text, add_special_tokens=False)["input_ids"]))

    c115 = ["C", "1", "1", "5"]
    for text in ('{"customer_id":"C115"}', '{"customer_id": "C115"}', "customer C115.",
                 "(C115)", "C115"):
        got = pieces(text)
        assert any(got[i:i + 4] == c115 for i in range(len(got))), (text, got)
    amount = ["1", "1", "0", "9", ".", "0"]
    for text in ('"total":1109.0,', '"amount": 1109.0}', "paid 1109.0 EUR"):
        got = pieces(text)
        assert any(got[i:i + 6] == amount for i in range(len(got))), (text, got)
    enum = ["price", "_", "mismatch"]
    for text in ('"price_mismatch"', '["price_mismatch","other"]', '"reason": "price_mismatch"}'):
        got = pieces(text)
        assert any(got[i:i + 3] == enum for i in range(len(got))), (text, got)
    for text in ('{"invoice_id": "INV1001", "amount": 2282.4}', "KB107 C999 PO4001 T1020"):
        assert tok.decode(tok(text, add_special_tokens=False)["input_ids"]) == text
