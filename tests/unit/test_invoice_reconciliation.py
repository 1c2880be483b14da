import json
from importlib import resources
from typing import Any

import pytest

from warmloop.activities.tools.invoice_reconciliation import InvoiceReconciliationTools
from warmloop.workflows.contracts import ToolRequest
from warmloop.workflows.profiles.base import ToolCallError
from warmloop.workflows.profiles.invoice_reconciliation import (
    INVOICE_RECONCILIATION,
    SYSTEM_PROMPT,
    InvoiceTask,
)

PKG = "warmloop.activities.data.invoice_reconciliation"
TOOLS = InvoiceReconciliationTools.bundled()
TASKS = [json.loads(line) for line in
         resources.files(PKG).joinpath("invoices.jsonl").read_text().splitlines() if line]


def _req(name: str, task_id: str = "INV1001", **arguments: Any) -> ToolRequest:
    fields: dict[str, Any] = {"job_id": "job-1", "step": 1, "profile": INVOICE_RECONCILIATION.name,
                              "name": name, "arguments": arguments}
    if "task_id" in ToolRequest.model_fields:
        fields["task_id"] = task_id
    return ToolRequest(**fields)


def _compare(invoice_id: str, po_number: str | None = None) -> dict[str, Any]:
    po = po_number or next(t["po_number"] for t in TASKS if t["invoice_id"] == invoice_id)
    out = TOOLS.run(_req("compare_lines", invoice_id, invoice_id=invoice_id, po_number=po))
    assert out.result.ok and out.effect is None
    result: dict[str, Any] = json.loads(out.result.output)
    return result


def test_every_task_record_validates_and_points_at_bundled_data() -> None:
    assert len(TASKS) >= 20
    assert len({t["invoice_id"] for t in TASKS}) == len(TASKS)
    invoices = json.loads(resources.files(PKG).joinpath("invoices.json").read_text())
    pos = json.loads(resources.files(PKG).joinpath("purchase_orders.json").read_text())
    vendors = json.loads(resources.files(PKG).joinpath("vendors.json").read_text())
    for t in TASKS:
        task = INVOICE_RECONCILIATION.validate_task(t)
        assert isinstance(task, InvoiceTask)
        inv = invoices[task.invoice_id]
        assert (inv["vendor_id"], inv["po_number"]) == (task.vendor_id, task.po_number)
        assert task.po_number in pos and task.vendor_id in vendors
        assert inv["total"] == pytest.approx(sum(ln["amount"] for ln in inv["lines"]))
    sample = json.loads(resources.files(PKG).joinpath("invoice.json").read_text())
    assert INVOICE_RECONCILIATION.validate_task(sample).model_dump() == sample


@pytest.mark.parametrize("bad", [
    {"invoice_id": "INV12", "vendor_id": "V201", "po_number": "PO4001"},
    {"invoice_id": "INV1001", "vendor_id": "V1", "po_number": "PO4001"},
    {"invoice_id": "INV1001", "vendor_id": "V201", "po_number": "4001"},
    {"invoice_id": "INV1001", "vendor_id": "V201", "po_number": "PO4001", "note": "x" * 501},
    {"invoice_id": "INV1001", "vendor_id": "V201", "po_number": "PO4001", "amount": 1},
])
def test_bad_tasks_are_refused(bad: dict[str, Any]) -> None:
    with pytest.raises(ValueError):
        INVOICE_RECONCILIATION.validate_task(bad)


def test_tool_schemas_are_strict_bounded_and_canonical() -> None:
    schemas = INVOICE_RECONCILIATION.tool_schemas()
    names = [s["function"]["name"] for s in schemas]
    assert names == ["approve_payment", "compare_lines", "fetch_invoice",
                     "fetch_purchase_order", "finish", "flag_discrepancy"]
    for s in schemas:
        fn = s["function"]
        assert fn["strict"] is True
        params = fn["parameters"]
        assert params["additionalProperties"] is False
        assert set(params["required"]) == set(params["properties"])
        for prop in params["properties"].values():
            if prop["type"] == "string":
                assert "enum" in prop or "pattern" in prop, (fn["name"], prop)
            elif prop["type"] in ("number", "integer"):
                assert "minimum" in prop and "maximum" in prop, (fn["name"], prop)
            else:
                pytest.fail(f"unexpected property type in {fn['name']}: {prop}")
    assert json.dumps(schemas) == json.dumps(INVOICE_RECONCILIATION.tool_schemas())
    assert [t.name for t in INVOICE_RECONCILIATION.tools if t.finishes_job] == ["finish"]
    assert {t.name for t in INVOICE_RECONCILIATION.tools if t.side_effect} == {
        "approve_payment", "flag_discrepancy"}
    for name in ("fetch_invoice", "fetch_purchase_order", "compare_lines"):
        assert INVOICE_RECONCILIATION.tool(name).max_calls == 3


@pytest.mark.parametrize(("name", "raw", "message"), [
    ("approve_payment", '{"invoice_id": "INV1001", "amount": -1}', "amount"),
    ("approve_payment", '{"invoice_id": "INV1001", "amount": 1000001}', "amount"),
    ("flag_discrepancy", '{"invoice_id": "INV1001", "reason": "looks odd"}', "reason"),
    ("fetch_invoice", '{"invoice_id": "1001"}', "invoice_id"),
    ("finish", '{"outcome": "paid", "note": "x"}', "note"),
])
def test_bad_calls_are_refused(name: str, raw: str, message: str) -> None:
    with pytest.raises(ToolCallError, match=message):
        INVOICE_RECONCILIATION.validate_call(name, raw)


def test_system_prompt_is_long_and_has_no_record_ids() -> None:
    assert 5000 <= len(SYSTEM_PROMPT) <= 6500
    for t in TASKS:
        for v in (t["invoice_id"], t["vendor_id"], t["po_number"]):
            assert v not in SYSTEM_PROMPT


CLEAN = ["INV1001", "INV1002", "INV1003", "INV1004", "INV1005", "INV1006", "INV1007",
         "INV1008", "INV1009", "INV1010", "INV1020"]


@pytest.mark.parametrize("invoice_id", CLEAN)
def test_clean_invoices_match(invoice_id: str) -> None:
    r = _compare(invoice_id)
    assert r["match"] is True and r["discrepancies"] == [] and r["duplicate_of"] == []
    assert all(ln["issues"] == [] for ln in r["lines"])


def test_price_within_half_a_percent_is_rounding() -> None:
    r = _compare("INV1006")
    toner = next(ln for ln in r["lines"] if ln["sku"] == "SKU-1002")
    assert toner["invoice_unit_price"] != toner["po_unit_price"]
    assert 0 < toner["price_diff_pct"] <= 0.5 and toner["issues"] == []
    assert r["total_diff"] == pytest.approx(2.5)


@pytest.mark.parametrize(("invoice_id", "kinds", "sku"), [
    ("INV1011", ["price_mismatch"], "SKU-1001"),
    ("INV1016", ["price_mismatch"], "SKU-4001"),
    ("INV1019", ["price_mismatch"], "SKU-1002"),  # 0.65 %: just outside the tolerance
    ("INV1012", ["quantity_mismatch"], "SKU-6001"),
    ("INV1017", ["quantity_mismatch"], "SKU-5002"),
    ("INV1013", ["missing_line"], "SKU-2003"),
    ("INV1014", ["extra_line"], "SKU-9001"),
])
def test_seeded_line_discrepancies_are_found(invoice_id: str, kinds: list[str], sku: str) -> None:
    r = _compare(invoice_id)
    assert r["match"] is False and r["discrepancies"] == kinds
    flagged = [ln for ln in r["lines"] if ln["issues"]]
    assert [ln["sku"] for ln in flagged] == [sku]
    assert flagged[0]["issues"] == kinds


def test_quantity_and_price_mismatch_on_different_lines() -> None:
    r = _compare("INV1018")
    assert r["discrepancies"] == ["price_mismatch", "quantity_mismatch"]
    by_sku = {ln["sku"]: ln for ln in r["lines"]}
    assert by_sku["SKU-6001"]["issues"] == ["quantity_mismatch"]
    assert by_sku["SKU-6001"]["qty_diff"] == 6
    assert by_sku["SKU-6002"]["issues"] == ["price_mismatch"]


def test_duplicate_invoice_is_found_and_the_original_is_not() -> None:
    dup = _compare("INV1015")
    assert dup["discrepancies"] == ["duplicate_invoice"] and dup["duplicate_of"] == ["INV1002"]
    assert all(ln["issues"] == [] for ln in dup["lines"])
    assert _compare("INV1002")["duplicate_of"] == []


def test_comparing_against_another_order_is_reported() -> None:
    r = _compare("INV1001", "PO4011")
    assert r["match"] is False and "other" in r["discrepancies"]
    assert any("PO4001" in n for n in r["notes"])


@pytest.mark.parametrize(("name", "args", "text"), [
    ("fetch_invoice", {"invoice_id": "INV9999"}, "no invoice INV9999"),
    ("fetch_purchase_order", {"po_number": "PO9999"}, "no purchase order PO9999"),
    ("compare_lines", {"invoice_id": "INV9999", "po_number": "PO4001"}, "no invoice INV9999"),
    ("compare_lines", {"invoice_id": "INV1001", "po_number": "PO9999"},
     "no purchase order PO9999"),
    ("flag_discrepancy", {"invoice_id": "INV9999", "reason": "other"}, "no invoice INV9999"),
    ("approve_payment", {"invoice_id": "INV9999", "amount": 10.0}, "no invoice INV9999"),
    ("approve_payment", {"invoice_id": "INV1001", "amount": 1000.0}, "not the total"),
])
def test_not_found_and_wrong_amount_are_results_not_errors(name: str, args: dict[str, Any],
                                                           text: str) -> None:
    out = TOOLS.run(_req(name, **args))
    assert out.result.ok is False and text in out.result.output
    assert out.effect is None


def test_fetch_tools_return_the_records() -> None:
    inv = TOOLS.run(_req("fetch_invoice", invoice_id="INV1002"))
    assert inv.effect is None
    body = json.loads(inv.result.output)
    assert body["po_number"] == "PO4002" and body["total"] == 8574.0
    assert body["vendor_name"] and len(body["lines"]) == 2
    po = TOOLS.run(_req("fetch_purchase_order", po_number="PO4013"))
    assert po.effect is None and len(json.loads(po.result.output)["lines"]) == 3


def test_side_effect_tools_return_an_effect() -> None:
    paid = TOOLS.run(_req("approve_payment", "INV1002", invoice_id="INV1002", amount=8574))
    assert paid.result.ok
    flag = TOOLS.run(_req("flag_discrepancy", "INV1011", invoice_id="INV1011",
                          reason="price_mismatch"))
    assert flag.result.ok
    if "task_id" in ToolRequest.model_fields:
        assert paid.effect == {"invoice": "INV1002", "paid": 8574.0}
        assert flag.effect == {"invoice": "INV1011", "flag": "price_mismatch"}
    else:  # pragma: no cover - before ToolRequest carries task_id
        assert paid.effect is not None and paid.effect["paid"] == 8574.0
        assert flag.effect is not None and flag.effect["flag"] == "price_mismatch"


def test_unknown_tool_raises() -> None:
    from temporalio.exceptions import ApplicationError

    with pytest.raises(ApplicationError, match="no tool"):
        TOOLS.run(_req("delete_everything"))


@pytest.mark.parametrize(("amount", "needs"), [
    (15940.0, True), (5000.01, True), (5000.0, False), (4992.0, False), (0.0, False),
])
def test_large_payments_wait_for_approval(amount: float, needs: bool) -> None:
    _, args = INVOICE_RECONCILIATION.validate_call(
        "approve_payment", json.dumps({"invoice_id": "INV1016", "amount": amount}))
    rule = INVOICE_RECONCILIATION.approval_for("approve_payment", args)
    if needs:
        assert rule is not None and rule.kind == "large_payment"
        assert rule.approvers == ("finance-lead", "cfo")
        assert rule.on_timeout == "escalate" and rule.escalate_to == ("cfo-office",)
    else:
        assert rule is None
    assert INVOICE_RECONCILIATION.approval_for(
        "flag_discrepancy", {"invoice_id": "INV1016", "reason": "other", "amount": 9e5}) is None


def test_data_has_totals_on_both_sides_of_the_approval_threshold() -> None:
    invoices = json.loads(resources.files(PKG).joinpath("invoices.json").read_text())
    totals = [inv["total"] for inv in invoices.values()]
    assert sum(t > 5000 for t in totals) >= 3 and sum(t <= 5000 for t in totals) >= 10
    clean_large = [i for i in CLEAN if invoices[i]["total"] > 5000]
    assert clean_large, "a clean invoice must exercise the approval path"
