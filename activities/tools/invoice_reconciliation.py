"""Tools of ``invoice-reconciliation`` over the bundled vendors, invoices and purchase orders."""

from __future__ import annotations

import json
from typing import Any

from temporalio.exceptions import ApplicationError

from warmloop.activities.tools.base import ToolOutcome, Toolset, load_json
from warmloop.workflows.contracts import ToolRequest, ToolResult

PRICE_TOLERANCE = 0.005
"""A unit price within half a percent of the ordered price is rounding, not a mismatch."""
SEVERITY = ("duplicate_invoice", "price_mismatch", "quantity_mismatch", "extra_line",
            "missing_line", "other")
"""Discrepancy kinds, most serious first (as the system prompt tells the model)."""


def _dumps(obj: Any) -> str:
    return json.dumps(obj, sort_keys=True, separators=(",", ":"))


def _fail(text: str) -> ToolOutcome:
    return ToolOutcome(ToolResult(ok=False, output=text))


def _price_matches(invoiced: float, ordered: float) -> bool:
    return abs(invoiced - ordered) <= PRICE_TOLERANCE * ordered + 1e-9


class InvoiceReconciliationTools(Toolset):
    profile = "invoice-reconciliation"

    def __init__(self, vendors: dict[str, Any], invoices: dict[str, Any],
                 purchase_orders: dict[str, Any]) -> None:
        self._vendors = vendors
        self._invoices = invoices
        self._pos = purchase_orders

    @classmethod
    def bundled(cls) -> InvoiceReconciliationTools:
        pkg = "warmloop.activities.data.invoice_reconciliation"
        return cls(load_json(pkg, "vendors.json"), load_json(pkg, "invoices.json"),
                   load_json(pkg, "purchase_orders.json"))

    def run(self, req: ToolRequest) -> ToolOutcome:
        a = req.arguments
        match req.name:
            case "fetch_invoice":
                inv = self._invoices.get(a["invoice_id"])
                if inv is None:
                    return _fail(f"no invoice {a['invoice_id']}")
                vendor = self._vendors.get(inv["vendor_id"], {})
                out = {**inv, "vendor_name": vendor.get("name"),
                       "payment_terms": vendor.get("payment_terms")}
                return ToolOutcome(ToolResult(ok=True, output=_dumps(out)))
            case "fetch_purchase_order":
                po = self._pos.get(a["po_number"])
                if po is None:
                    return _fail(f"no purchase order {a['po_number']}")
                return ToolOutcome(ToolResult(ok=True, output=_dumps(po)))
            case "compare_lines":
                inv = self._invoices.get(a["invoice_id"])
                if inv is None:
                    return _fail(f"no invoice {a['invoice_id']}")
                po = self._pos.get(a["po_number"])
                if po is None:
                    return _fail(f"no purchase order {a['po_number']}")
                return ToolOutcome(ToolResult(ok=True, output=_dumps(self.compare(inv, po))))
            case "flag_discrepancy":
                if a["invoice_id"] not in self._invoices:
                    return _fail(f"no invoice {a['invoice_id']}")
                return ToolOutcome(
                    ToolResult(ok=True, output=f"invoice {a['invoice_id']} flagged: "
                               f"{a['reason']}; payment on hold"),
                    effect={"invoice": req.task_id, "flag": a["reason"]},
                )
            case "approve_payment":
                inv = self._invoices.get(a["invoice_id"])
                if inv is None:
                    return _fail(f"no invoice {a['invoice_id']}")
                amount = round(float(a["amount"]), 2)
                if abs(amount - inv["total"]) > 0.005:
                    return _fail(f"amount {amount:.2f} is not the total {inv['total']:.2f} of "
                                 f"invoice {a['invoice_id']}; pay the exact total or flag it")
                return ToolOutcome(
                    ToolResult(ok=True, output=f"payment of {amount:.2f} {inv['currency']} "
                               f"approved for invoice {a['invoice_id']}"),
                    effect={"invoice": req.task_id, "paid": amount},
                )
        raise ApplicationError(f"invoice-reconciliation has no tool {req.name!r}",
                               type="UnknownTool", non_retryable=True)

    def compare(self, inv: dict[str, Any], po: dict[str, Any]) -> dict[str, Any]:
        """Line-by-line diff of an invoice against a purchase order, matched by sku."""
        ordered = {ln["sku"]: ln for ln in po["lines"]}
        billed = {ln["sku"]: ln for ln in inv["lines"]}
        lines: list[dict[str, Any]] = []
        for sku, o in ordered.items():
            b = billed.get(sku)
            if b is None:
                lines.append({"sku": sku, "issues": ["missing_line"], "po_qty": o["qty"],
                              "po_unit_price": o["unit_price"]})
                continue
            issues = []
            if b["qty"] != o["qty"]:
                issues.append("quantity_mismatch")
            if not _price_matches(b["unit_price"], o["unit_price"]):
                issues.append("price_mismatch")
            diff_pct = round((b["unit_price"] - o["unit_price"]) / o["unit_price"] * 100, 2)
            lines.append({"sku": sku, "issues": issues, "invoice_qty": b["qty"],
                          "po_qty": o["qty"], "qty_diff": b["qty"] - o["qty"],
                          "invoice_unit_price": b["unit_price"], "po_unit_price": o["unit_price"],
                          "price_diff_pct": diff_pct})
        for sku, b in billed.items():
            if sku not in ordered:
                lines.append({"sku": sku, "issues": ["extra_line"], "invoice_qty": b["qty"],
                              "invoice_unit_price": b["unit_price"], "amount": b["amount"]})
        kinds = {i for ln in lines for i in ln["issues"]}
        duplicate_of = sorted(
            k for k, other in self._invoices.items()
            if k < inv["invoice_id"] and other["vendor_id"] == inv["vendor_id"]
            and other["po_number"] == inv["po_number"]
            and abs(other["total"] - inv["total"]) < 0.005
        )
        if duplicate_of:
            kinds.add("duplicate_invoice")
        notes = []
        if inv["po_number"] != po["po_number"]:
            notes.append(f"invoice cites {inv['po_number']}, not {po['po_number']}")
        if inv["vendor_id"] != po["vendor_id"]:
            notes.append(f"invoice vendor {inv['vendor_id']} is not order vendor "
                         f"{po['vendor_id']}")
        if po.get("status", "open") != "open":
            notes.append(f"purchase order is {po['status']}")
        if notes:
            kinds.add("other")
        return {
            "invoice": inv["invoice_id"], "po": po["po_number"],
            "match": not kinds,
            "discrepancies": [k for k in SEVERITY if k in kinds],
            "lines": lines, "duplicate_of": duplicate_of, "notes": notes,
            "invoice_total": inv["total"], "po_total": po["total"],
            "total_diff": round(inv["total"] - po["total"], 2),
        }
