"""Stopping the gateway's background loops.

Hazard: redis-py (8.1 here) sometimes swallows a task's cancellation when it lands
inside a command (a few in a hundred, measured): the loop then carries on, and
``task.cancel(); await task`` waits for good. So a loop is cancelled again until it
has stopped, a bounded number of times.
"""

from __future__ import annotations

import asyncio
from typing import Any

import structlog

log = structlog.get_logger(__name__)


async def stop_task(task: asyncio.Task[Any], *, tries: int = 20, wait_s: float = 0.25) -> None:
    """Cancel ``task`` until it is done (at most ``tries`` times, ``wait_s`` apart)."""
    for _ in range(tries):
        if task.done():
            break
        task.cancel()
        await asyncio.wait({task}, timeout=wait_s)
    if not task.done():
        log.warning("background_task_would_not_stop", task=task.get_name())
        return
    if not task.cancelled() and task.exception() is not None:
        log.warning("background_task_failed", task=task.get_name(),
                    error=repr(task.exception()))
