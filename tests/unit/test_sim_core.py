"""The simulator's event core: events run in (time, scheduling order), whatever mix of
runs with and without an end, events scheduled between runs and events scheduled for
the current time while it runs."""

from __future__ import annotations

import heapq
import itertools
import math
import os
import random
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from warmloop.sim.core import Clock


class HeapClock:
    """The reference: one heap of (time, scheduling number, callback, args)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay_s, fn, *args)

    def run(self, until: float | None = None) -> None:
        bound = math.inf if until is None else until
        while self._heap and self._heap[0][0] <= bound:
            t, _, fn, args = heapq.heappop(self._heap)
            self.now = t
            fn(*args)
        if until is not None:
            self.now = max(self.now, until)


def _drive(clock: Clock | HeapClock, seed: int) -> list[tuple[float, int]]:
    """Schedule and run a seeded mix of events; the (time, id) of each as it ran."""
    rng = random.Random(seed)
    ran: list[tuple[float, int]] = []
    ids = itertools.count()

    def event(n: int, depth: int) -> None:
        ran.append((clock.now, n))
        if depth < 3:
            for _ in range(rng.randint(0, 2)):
                # now (ties with events already due), a whole time unit later (ties
                # between runs), or between
                delay = rng.choice([0.0, 0.0, 1.0, 2.0, rng.random() * 3])
                clock.after(delay, event, next(ids), depth + 1)

    for _ in range(6):
        for _ in range(rng.randint(1, 5)):
            clock.at(clock.now + rng.choice([0.0, 1.0, 2.5, rng.random() * 4]), event,
                     next(ids), 0)
        clock.run(clock.now + rng.choice([0.0, 0.5, 1.0, 2.0]))
    clock.run()
    return ran


@pytest.mark.parametrize("seed", range(20))
def test_events_run_in_time_then_scheduling_order(seed: int) -> None:
    ran = _drive(Clock(), seed)
    assert ran == _drive(HeapClock(), seed)
    assert len(ran) > 5 and len({t for t, _ in ran}) < len(ran)  # ties were exercised


def test_a_run_with_an_end_leaves_later_events_waiting() -> None:
    clock = Clock()
    seen: list[str] = []
    clock.at(5.0, seen.append, "late")
    clock.at(1.0, seen.append, "early")
    clock.run(2.0)
    assert seen == ["early"] and clock.now == 2.0 and clock.pending == 1
    clock.at(5.0, seen.append, "late too")  # same time, scheduled after: runs after
    clock.run()
    assert seen == ["early", "late", "late too"] and clock.now == 5.0 and clock.pending == 0
    assert clock.events == 3


def test_an_event_that_raises_has_run_and_the_rest_wait() -> None:
    clock = Clock()
    seen: list[str] = []

    def boom() -> None:
        seen.append("boom")
        raise RuntimeError("event failed")

    clock.at(1.0, seen.append, "first")
    clock.at(1.0, boom)
    clock.at(1.0, seen.append, "after")
    clock.at(2.0, seen.append, "later")
    with pytest.raises(RuntimeError, match="event failed"):
        clock.run()
    assert seen == ["first", "boom"] and clock.pending == 2
    clock.at(1.0, seen.append, "scheduled since")  # now is 1.0: after the one waiting
    clock.run()
    assert seen == ["first", "boom", "after", "scheduled since", "later"]


def test_reserved_numbers_order_events_as_if_scheduled_when_reserved() -> None:
    """``Clock.reserve`` / ``at_number`` (the fleet's job arrivals, scheduled one at a
    time): an event given a reserved number runs before events of its time scheduled
    after the reservation and after those scheduled before it, wherever it is scheduled
    from; beyond a run's end it waits and keeps its place."""
    clock = Clock()
    ran: list[str] = []
    clock.at(1.0, ran.append, "before")
    first = clock.reserve(2)
    clock.at(1.0, ran.append, "after")
    clock.at(2.0, ran.append, "after-2")

    def then() -> None:  # scheduled late, from an event, yet in its reserved place
        ran.append("reserved-1")
        clock.at_number(2.0, first + 1, ran.append, "reserved-2")

    clock.at_number(1.0, first, then)
    clock.run(until=1.5)
    assert ran == ["before", "reserved-1", "after"]
    clock.run()
    assert ran == ["before", "reserved-1", "after", "reserved-2", "after-2"]


def test_pending_counts_the_events_not_run_yet() -> None:
    """A probe that reschedules itself while anything else is pending (``Fleet``'s churn
    probe) must not count itself: it would never stop."""
    clock = Clock()
    counts: list[int] = []

    def probe() -> None:
        counts.append(clock.pending)
        if clock.pending:
            clock.after(1.0, probe)

    clock.at(0.0, probe)
    clock.at(0.0, counts.append, -1)  # same time, after the probe
    clock.at(2.5, counts.append, -2)
    clock.run()
    assert counts == [2, -1, 1, 1, -2, 0] and clock.pending == 0


_EXIT_SCRIPT = """
import gc, sys
from warmloop.sim.core import skip_exit_collection

class Node:
    def __del__(self):
        sys.stdout.write("collected\\n")
        sys.stdout.flush()

if sys.argv[1] == "skip":
    skip_exit_collection()
gc.disable()  # nothing collects the cycle before exit but the interpreter's last pass
a, b = Node(), Node()
a.other, b.other = b, a
del a, b
print("done", flush=True)
"""


@pytest.mark.parametrize("mode", ["skip", "plain"])
def test_skip_exit_collection_leaves_a_runs_cyclic_garbage_to_the_os(mode: str) -> None:
    """The interpreter's last full collection is what reaches a fleet left behind as
    cycles; ``skip_exit_collection`` skips it (the plain process shows it runs)."""
    out = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT, mode], capture_output=True,
                         text=True, check=True, timeout=60,
                         env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    lines = out.stdout.split()
    assert lines[0] == "done"
    assert lines[1:] == ([] if mode == "skip" else ["collected", "collected"]), out


def test_the_compiled_builds_own_heap_keeps_heapqs_order_and_layout() -> None:
    """``_push`` / ``_pop`` (the compiled build's heap) against ``heapq`` on the same
    random pushes and pops, ties in time included: the same events popped, in the same
    order, and the same layout after every operation."""
    import heapq
    import random

    from warmloop.sim import core

    rng = random.Random(7)
    ours: list[core._Event] = []
    theirs: list[core._Event] = []
    seq = 0
    for _ in range(5_000):
        if ours and rng.random() < 0.45:
            a, b = core._pop(ours), heapq.heappop(theirs)
            assert a is b
        else:
            seq += 1
            e = core._Event(float(rng.randint(0, 50)), seq, print, ())
            core._push(ours, e)
            heapq.heappush(theirs, e)
        assert ours == theirs  # identity per slot: the same layout
    while ours:
        assert core._pop(ours) is heapq.heappop(theirs)
