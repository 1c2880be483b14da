"""The embedded stack's process helpers (real child processes, no engines)."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from warmloop.infra.stack import engine_compute_pids, lower_cpu_priority

pytestmark = pytest.mark.skipif(not Path("/proc").is_dir(), reason="needs Linux /proc")

# A parent (the "API server") whose child renames itself the way vLLM titles its engine
# core, and a sibling that keeps a plain name.
TREE = """
import subprocess, sys, time
named = ("open('/proc/self/comm', 'w').write('VLLM::Worker'); "
         "import time, threading; threading.Thread(target=time.sleep, args=(60,)).start(); "
         "print('up', flush=True); time.sleep(60)")
a = subprocess.Popen([sys.executable, '-c', named], stdout=subprocess.PIPE, text=True)
b = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)'])
a.stdout.readline()
print(a.pid, b.pid, flush=True)
time.sleep(60)
"""


@pytest.fixture
def tree() -> Iterator[tuple[int, int, int]]:
    parent = subprocess.Popen([sys.executable, "-c", TREE], stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    named, plain = (int(x) for x in parent.stdout.readline().split())
    try:
        yield parent.pid, named, plain
    finally:
        for pid in (named, plain):
            os.kill(pid, 9)
        parent.kill()
        parent.wait()


def _nice_and_policy(tid: int) -> tuple[int, int]:
    fields = Path(f"/proc/{tid}/stat").read_text().rsplit(")", 1)[1].split()
    return int(fields[16]), int(fields[38])  # nice, policy (stat fields 19 and 41)


def test_only_the_engine_compute_processes_are_found(tree: tuple[int, int, int]) -> None:
    parent, named, plain = tree
    assert engine_compute_pids(parent) == [named]


def test_every_thread_of_a_compute_process_is_lowered(tree: tuple[int, int, int]) -> None:
    parent, named, plain = tree
    tids = [int(t) for t in os.listdir(f"/proc/{named}/task")]
    assert len(tids) >= 2  # the main thread and the sleeper
    base = os.getpriority(os.PRIO_PROCESS, 0)  # children start at ours
    target = min(19, base + 5)
    assert lower_cpu_priority([named], target) == len(tids)
    assert {_nice_and_policy(t) for t in tids} == {(target, os.SCHED_BATCH)}
    assert _nice_and_policy(plain) == (base, os.SCHED_OTHER)


class _Keys:
    def __init__(self, values: dict[str, str]) -> None:
        self.values = values

    def get(self, key: str) -> str | None:
        return self.values.get(key)


def _stack_with(tmp_path: Path, heartbeat_worker: str, our_pid: int | None) -> bool:
    import json

    from warmloop.infra.stack import Stack
    from warmloop.workers.settings import Settings

    stack = Stack(Settings(state_dir=tmp_path), log=lambda _: None)
    keys = _Keys({"warmloop:engine:e0": json.dumps({"worker": heartbeat_worker})})
    stack._redis = lambda: keys  # type: ignore[method-assign]
    stack._pid = lambda name: our_pid  # type: ignore[method-assign]
    return stack._inference_worker_ready("inference-worker-e0", "e0")


def test_a_killed_inference_workers_heartbeat_does_not_pass_for_a_live_one(
    tmp_path: Path,
) -> None:
    import socket

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    here = socket.gethostname()
    # killed moments ago, its key not yet expired, no pid file: not ready, so `up`
    # starts a new worker instead of taking the key for someone else's live one
    assert not _stack_with(tmp_path, f"{here}-{dead.pid}", None)
    assert _stack_with(tmp_path, f"{here}-{os.getpid()}", None)  # a live one not ours
    assert _stack_with(tmp_path, f"{here}-{os.getpid()}", os.getpid())  # ours
    assert not _stack_with(tmp_path, f"{here}-{os.getpid()}", dead.pid)  # not ours yet


def test_the_embedded_redis_keeps_the_effect_ledger_across_a_kill(tmp_path: Path) -> None:
    import signal
    import socket
    import time

    import redis

    from warmloop.infra.stack import Stack
    from warmloop.workers.settings import Settings

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    settings = Settings(state_dir=tmp_path, redis_url=f"redis://127.0.0.1:{port}/0")
    [part] = [p for p in Stack(settings, log=lambda _: None).infra_parts() if p.name == "redis"]

    def start() -> subprocess.Popen[bytes]:
        proc = subprocess.Popen(part.argv, stdout=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while not part.ready():
            assert proc.poll() is None and time.monotonic() < deadline, "redis did not start"
            time.sleep(0.05)
        return proc

    proc = start()
    try:
        r = redis.Redis(port=port)
        assert r.set("warmloop:effect:job-1:id:abc", "applied", nx=True)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        proc = start()
        # a retried side effect finds its record: it is not applied again
        assert r.get("warmloop:effect:job-1:id:abc") == b"applied"
        assert not r.set("warmloop:effect:job-1:id:abc", "again", nx=True)
    finally:
        proc.kill()
        proc.wait()
