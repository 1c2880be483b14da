"""A bench's stack comes down when the run ends or is stopped, and stays up when the
run fails (to inspect) or ``--keep-stack`` asks."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from rich.console import Console

import bench.common as common
from bench.common import bench_settings, bench_stack


class FakeStack:
    calls: list[str] = []

    def __init__(self, settings: Any, log: Any) -> None:
        pass

    def up(self) -> None:
        FakeStack.calls.append("up")

    def down(self) -> None:
        FakeStack.calls.append("down")


class FakeRedis:
    async def aclose(self) -> None:
        FakeStack.calls.append("redis closed")


@pytest.fixture
def fakes(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    FakeStack.calls = []
    monkeypatch.setattr(common, "Stack", FakeStack)
    monkeypatch.setattr(common, "fresh_state", lambda s: None)
    monkeypatch.setattr(common.aioredis.Redis, "from_url", lambda *a, **k: FakeRedis())

    async def connect(settings: Any) -> object:
        return object()

    monkeypatch.setattr(common, "connect", connect)
    return FakeStack.calls


async def run(body: Any, *, keep: bool = False) -> None:
    settings = bench_settings("routing", engines=2, kv_cache_bytes=1 << 26)
    async with bench_stack(settings, Console(quiet=True), keep=keep):
        await body()


async def test_a_run_that_ends_takes_its_stack_down(fakes: list[str]) -> None:
    async def body() -> None:
        return None

    await run(body)
    assert fakes == ["up", "redis closed", "down"]
    fakes.clear()
    await run(body, keep=True)
    assert fakes == ["up", "redis closed"]


async def test_a_stopped_run_takes_its_stack_down(fakes: list[str]) -> None:
    entered = asyncio.Event()

    async def body() -> None:
        entered.set()
        await asyncio.Event().wait()  # until cancelled, as asyncio.run does on Ctrl-C

    task = asyncio.create_task(run(body))
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fakes == ["up", "redis closed", "down"]


async def test_a_second_stop_during_the_teardown_still_takes_the_stack_down(
        fakes: list[str], monkeypatch: pytest.MonkeyPatch) -> None:
    """A SIGTERM sent to both `make` and the bench (``pkill -f``) cancels the run, then
    its Redis close: the engines, Temporal, Redis and S3 must come down anyway."""
    closing, entered = asyncio.Event(), asyncio.Event()

    class SlowRedis:
        async def aclose(self) -> None:
            closing.set()
            await asyncio.Event().wait()  # until the second cancel

    monkeypatch.setattr(common.aioredis.Redis, "from_url", lambda *a, **k: SlowRedis())

    async def body() -> None:
        entered.set()
        await asyncio.Event().wait()

    task = asyncio.create_task(run(body))
    await entered.wait()
    task.cancel()
    await closing.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert fakes == ["up", "down"]


async def test_a_failed_run_leaves_its_stack_up_to_inspect(fakes: list[str]) -> None:
    async def body() -> None:
        raise RuntimeError("the bench broke")

    with pytest.raises(RuntimeError):
        await run(body)
    assert fakes == ["up", "redis closed"]


SCRIPT = """
import argparse, asyncio, sys
from bench.common import run_main

async def main_async(args, console):
    try:
        print("ready", flush=True)
        await asyncio.Event().wait()
    finally:
        open(sys.argv[1], "w").write("cleaned up")

run_main(argparse.ArgumentParser(), main_async, [])
"""


@pytest.mark.parametrize("sigint", ["default", "ignored"])
async def test_sigterm_stops_a_bench_like_ctrl_c(tmp_path: Any, sigint: str) -> None:
    """``run_main`` turns SIGTERM into the cancellation Ctrl-C gives, so the bench's
    ``finally`` (its stack's teardown) runs; also in a bench started in the background
    by a shell without job control (``nohup make bench-x &``), which inherits SIGINT
    ignored."""
    import signal
    import sys

    marker = tmp_path / "marker"
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", SCRIPT, str(marker), stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.DEVNULL,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        if sigint == "ignored" else None)
    assert proc.stdout is not None
    assert (await asyncio.wait_for(proc.stdout.readline(), 60)).strip() == b"ready"
    proc.send_signal(signal.SIGTERM)
    await asyncio.wait_for(proc.wait(), 60)
    assert marker.read_text() == "cleaned up"
