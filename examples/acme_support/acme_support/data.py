"""Acme's (made-up) orders and returns."""

ORDERS: dict[str, dict[str, object]] = {
    f"O{1000 + i}": {"status": ("shipped", "delayed", "delivered", "cancelled")[i % 4],
                     "items": 1 + i % 3, "total": round(19.5 * (1 + i % 7), 2)}
    for i in range(40)
}
RETURNS: dict[str, dict[str, object]] = {
    f"R{2000 + i}": {"order_id": f"O{1000 + i}", "state": ("received", "in_transit")[i % 2],
                     "refundable": round(19.5 * (1 + i % 7), 2)}
    for i in range(20)
}
