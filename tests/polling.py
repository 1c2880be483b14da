"""Waiting for a workflow to reach a state, by asking it (queries), not by sleeping
a guessed time."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")


async def eventually(probe: Callable[[], Awaitable[T | None]], *, attempts: int = 200,
                     interval_s: float = 0.05) -> T:
    """Ask ``probe`` until it returns something truthy; fail after ``attempts``."""
    for _ in range(attempts):
        value = await probe()
        if value:
            return value
        await asyncio.sleep(interval_s)
    raise AssertionError(f"condition not reached after {attempts} probes")
