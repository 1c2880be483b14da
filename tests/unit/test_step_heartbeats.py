"""A step's heartbeats: none for a step shorter than the interval (each one the SDK
sends is a write to the workflow's history shard), then one an interval."""

from __future__ import annotations

import asyncio

import pytest

from warmloop.activities import inference


async def test_a_step_shorter_than_the_interval_sends_no_heartbeat(
        monkeypatch: pytest.MonkeyPatch) -> None:
    beats: list[float] = []
    monkeypatch.setattr(inference.activity, "heartbeat", lambda *d: beats.append(1.0))
    async with inference._heartbeating(interval_s=60.0):
        await asyncio.sleep(0)  # the beating task runs up to its first wait
    assert beats == []


async def test_a_longer_step_heartbeats_each_interval(monkeypatch: pytest.MonkeyPatch) -> None:
    beats: list[float] = []
    loop = asyncio.get_running_loop()
    monkeypatch.setattr(inference.activity, "heartbeat", lambda *d: beats.append(loop.time()))
    start = loop.time()
    async with inference._heartbeating(interval_s=0.02):
        for _ in range(500):  # until three beats, at most 5 s
            if len(beats) >= 3:
                break
            await asyncio.sleep(0.01)
    assert len(beats) >= 3
    assert beats[0] - start >= 0.02  # the first only after one interval
    n = len(beats)
    await asyncio.sleep(0.05)
    assert len(beats) == n  # none after the step
