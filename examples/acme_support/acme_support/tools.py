"""Acme's Python tools: plain functions, their argument schemas from the type hints.

The agent worker runs them (it loads this plugin). Strings are bounded (a pattern or a
``Literal``): a weak model fills an unbounded string until it runs out of tokens.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

import warmloop
from acme_support.data import ORDERS

OrderId = Annotated[str, Field(pattern=r"^O[0-9]{4}$")]
NOTES: dict[str, str] = {}
"""Notes added, by idempotency key: a retried call adds nothing twice."""


@warmloop.tool(pause_median_s=0.05, pause_p90_s=0.2)
def order_status(order_id: OrderId) -> dict[str, object] | str:
    """Look an order up: its status, item count and total."""
    order = ORDERS.get(order_id)
    return {"order_id": order_id, **order} if order else f"not found: no order {order_id}"


@warmloop.tool(side_effect=True, pause_median_s=0.05, pause_p90_s=0.2)
def add_note(order_id: OrderId, note: Literal["customer_called", "sent_apology", "escalated"],
             ctx: warmloop.ToolContext) -> str:
    """Add a note to an order's history."""
    NOTES.setdefault(ctx.idempotency_key, f"{order_id}: {note}")
    return f"noted on {order_id}: {note}"
