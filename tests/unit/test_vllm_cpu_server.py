"""infra/vllm_cpu_server.py: vLLM's worker stops busy-waiting soon after a message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from vllm.distributed.device_communicators import shm_broadcast

from warmloop.infra.vllm_cpu_server import IDLE_RECHECK_MS, IDLE_SPIN_S, patch_idle_spin

_CONDITIONS = """
import os, uuid, zmq
from vllm.distributed.device_communicators import shm_broadcast
from warmloop.infra.vllm_cpu_server import patch_idle_spin
assert patch_idle_spin() and patch_idle_spin()  # idempotent
ctx = zmq.Context()
reader = shm_broadcast.SpinCondition(is_reader=True, context=ctx,
                                     notify_address=f"inproc://r-{uuid.uuid4().hex}")
writer = shm_broadcast.SpinCondition(is_reader=False, context=ctx,
                                     notify_address=f"inproc://w-{uuid.uuid4().hex}")
print(reader.busy_loop_s, writer.busy_loop_s, flush=True)
os._exit(0)  # no context teardown: libzmq can abort the process there
"""


def test_the_patch_caps_the_readers_spin_once_and_leaves_writers_alone() -> None:
    """In a child process: tearing down a zmq context that holds vLLM's reader sockets
    once aborted the whole test run (libzmq's assertion in ``Context.term``)."""
    out = subprocess.run([sys.executable, "-c", _CONDITIONS], capture_output=True,
                         text=True, timeout=180, cwd=Path(__file__).resolve().parents[2])
    assert out.returncode == 0, out.stderr[-2000:]
    reader_s, writer_s = out.stdout.strip().splitlines()[-1].split()
    assert float(reader_s) == IDLE_SPIN_S  # vLLM's default is a whole second
    assert float(writer_s) == 0
    assert patch_idle_spin() and patch_idle_spin()  # idempotent here too


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
