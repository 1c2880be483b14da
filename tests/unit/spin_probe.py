"""Run as ``python -m tests.unit.spin_probe``: a main module that imports the spin patch
(as ``warmloop.infra.vllm_cpu_server`` is the engines' main module) spawns a child and
prints how long the child's shared-memory reader would spin, and how long it would sleep
without a ping."""

from __future__ import annotations

import multiprocessing as mp
import os
import tempfile
from typing import Any

import warmloop.infra.vllm_cpu_server  # noqa: F401 - the patch, applied on import


def child(q: Any) -> None:
    import zmq
    from vllm.distributed.device_communicators import shm_broadcast

    ctx = zmq.Context()
    # An ipc address nobody binds, not an inproc one: libzmq keeps a connect to an
    # unbound inproc endpoint as a pending connection, and tearing the context down
    # with one pending once failed its own assertion (ctx.cpp:789) in CI, 2026-12-05.
    reader = shm_broadcast.SpinCondition(
        is_reader=True, context=ctx,
        notify_address=f"ipc://{tempfile.gettempdir()}/warmloop-spin-probe-{os.getpid()}")
    q.put(f"{reader.busy_loop_s} {shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS}")
    ctx.destroy(linger=0)


if __name__ == "__main__":
    spawn = mp.get_context("spawn")
    q = spawn.Queue()
    p = spawn.Process(target=child, args=(q,))
    p.start()
    print(q.get(timeout=120))
    p.join()
