"""A worker's Redis loops stop when cancelled even after redis-py swallowed the
cancellation inside a command (``registry.stop_if_cancelled``): otherwise the worker's
task group waits on them for good at shutdown and skips its clean-up."""

from __future__ import annotations

import asyncio
from typing import Any

from warmloop.activities.registry import stop_if_cancelled
from warmloop.workers import agent_worker


async def test_a_loop_whose_cancellation_was_eaten_stops_at_its_next_turn() -> None:
    turns = 0
    eaten, started = asyncio.Event(), asyncio.Event()

    async def loop() -> None:
        nonlocal turns
        while True:
            stop_if_cancelled()
            turns += 1
            started.set()
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:  # as redis-py sometimes does inside a command
                eaten.set()

    task = asyncio.ensure_future(loop())
    await asyncio.wait_for(started.wait(), 2)
    task.cancel()
    await asyncio.wait_for(eaten.wait(), 2)
    done, _ = await asyncio.wait({task}, timeout=2)
    assert task in done and task.cancelled() and turns == 1


async def test_stop_if_cancelled_leaves_a_task_nobody_cancelled_alone() -> None:
    async def once() -> str:
        stop_if_cancelled()
        return "ran"

    assert await once() == "ran"


class _SwallowingRedis:
    """A Redis whose ``set`` eats the task's cancellation, as redis-py 8.1 sometimes
    does when it lands inside a command."""

    def __init__(self) -> None:
        self.calls = 0
        self.called = asyncio.Event()
        self.swallowed = 0

    async def set(self, *_a: Any, **_k: Any) -> None:
        self.calls += 1
        self.called.set()
        try:
            await asyncio.sleep(10)
        except asyncio.CancelledError:
            self.swallowed += 1


async def test_the_agent_workers_heartbeat_stops_though_redis_ate_the_cancel() -> None:
    redis: Any = _SwallowingRedis()
    task = asyncio.ensure_future(agent_worker.beat(redis, "k", ttl_s=5, interval_s=0.01))
    await asyncio.wait_for(redis.called.wait(), 2)
    task.cancel()
    done, _ = await asyncio.wait({task}, timeout=2)
    assert task in done and task.cancelled()
    assert redis.swallowed == 1 and redis.calls == 1  # no beat after the cancel
