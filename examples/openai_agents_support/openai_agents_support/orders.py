"""The shop's order system, and the activity the agent's one tool runs."""

from __future__ import annotations

import json
from typing import Annotated

from pydantic import Field
from temporalio import activity

ORDER_ID = r"^O[0-9]{4}$"
"""Order ids. A pattern, not a bare string: under guided decoding a weak model fills an
unbounded string until ``max_tokens`` (and a strong one is told what an id looks like)."""

ORDERS: dict[str, dict[str, str]] = {
    "O1001": {"status": "shipped", "carrier": "DHL", "eta": "2 days"},
    "O1002": {"status": "processing", "carrier": "-", "eta": "5 days"},
    "O1003": {"status": "delivered", "carrier": "UPS", "eta": "-"},
}


@activity.defn
async def lookup_order(order_id: Annotated[str, Field(pattern=ORDER_ID)]) -> str:
    """Look up an order by its id (O followed by four digits): status, carrier, ETA."""
    order = ORDERS.get(order_id)
    if order is None:
        return json.dumps({"order_id": order_id, "found": False})
    return json.dumps({"order_id": order_id, "found": True, **order}, sort_keys=True)
