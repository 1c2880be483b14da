"""infra/vllm_cpu_server.py: vLLM's worker stops busy-waiting soon after a message."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import zmq
from vllm.distributed.device_communicators import shm_broadcast

from warmloop.infra.vllm_cpu_server import IDLE_RECHECK_MS, IDLE_SPIN_S, patch_idle_spin


def _reader(ctx: zmq.Context) -> shm_broadcast.SpinCondition:  # type: ignore[type-arg]
    return shm_broadcast.SpinCondition(is_reader=True, context=ctx,
                                       notify_address=f"inproc://spin-{uuid.uuid4().hex}")


def test_the_patch_caps_the_readers_spin_once_and_leaves_writers_alone() -> None:
    ctx = zmq.Context()
    try:
        assert patch_idle_spin() and patch_idle_spin()  # idempotent
        reader = _reader(ctx)
        assert reader.busy_loop_s == IDLE_SPIN_S  # vLLM's default is a whole second
        writer = shm_broadcast.SpinCondition(is_reader=False, context=ctx,
                                             notify_address=f"inproc://w-{uuid.uuid4().hex}")
        assert writer.busy_loop_s == 0
    finally:
        ctx.destroy(linger=0)


def test_a_sleeping_reader_looks_at_the_shared_memory_itself_soon_after() -> None:
    """A missed ping must not park a reader for vLLM's 5 s: that froze engines with
    steps in flight once the spin was short."""
    assert patch_idle_spin()
    idle = shm_broadcast.MessageQueue.ReadTimeoutWithWarnings(timeout=None, should_warn=False)
    assert idle.timeout_ms() == IDLE_RECHECK_MS
    # and a read with a deadline still waits no longer than the deadline
    short = shm_broadcast.MessageQueue.ReadTimeoutWithWarnings(timeout=0.002, should_warn=True)
    assert 0 < short.timeout_ms() <= 2


def test_spawned_children_apply_it_too() -> None:
    """multiprocessing's spawn re-imports the parent's main module in the child: the
    engine-core and worker processes vLLM starts get the patch the same way."""
    out = subprocess.run([sys.executable, "-m", "tests.unit.spin_probe"],
                         capture_output=True, text=True, timeout=180,
                         cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    spin, recheck = out.stdout.strip().splitlines()[-1].split()
    assert (float(spin), int(recheck)) == (IDLE_SPIN_S, IDLE_RECHECK_MS), out.stdout
