"""The discrete-event core: a heap of timed callbacks (plainer and faster than SimPy)."""

from __future__ import annotations

import atexit
import gc
import heapq
import itertools
import math
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any


class _Event:
    """A callback due at ``t``, the ``seq``-th scheduled: ordered by (t, seq). Compared
    by its own ``__lt__`` (in the compiled build a C comparison of two fields), where a
    tuple's order compares each field twice through the generic object protocol (for
    equality, then order): the heap's compares were a tenth of a 128-GPU run."""

    __slots__ = ("t", "seq", "fn", "args")

    def __init__(self, t: float, seq: int, fn: Callable[..., Any],
                 args: tuple[Any, ...]) -> None:
        self.t = t
        self.seq = seq
        self.fn = fn
        self.args = args

    def __lt__(self, other: _Event) -> bool:
        t = self.t
        o = other.t
        return t < o or (t == o and self.seq < other.seq)


def _before(a: _Event, b: _Event) -> bool:
    """``a < b`` (``_Event.__lt__``) as a direct call."""
    t = a.t
    o = b.t
    return t < o or (t == o and a.seq < b.seq)


def _sift_up(heap: list[_Event], e: _Event, pos: int) -> None:
    """Put ``e`` at ``pos`` or above it, moving the later events it passes down."""
    while pos:
        parent = (pos - 1) >> 1
        p = heap[parent]
        if not _before(e, p):
            break
        heap[pos] = p
        pos = parent
    heap[pos] = e


def _push(heap: list[_Event], e: _Event) -> None:
    """``heapq.heappush`` for events, comparing them by ``_before``."""
    heap.append(e)
    _sift_up(heap, e, len(heap) - 1)


def _pop(heap: list[_Event]) -> _Event:
    """``heapq.heappop`` for events (its order: the smaller child up to a leaf, then the
    last event sifted up from there), comparing them by ``_before``."""
    last = heap.pop()
    n = len(heap)
    if not n:
        return last
    top = heap[0]
    pos = 0
    child = 1
    while child < n:
        right = child + 1
        if right < n and not _before(heap[child], heap[right]):
            child = right
        heap[pos] = heap[child]
        pos = child
        child = 2 * pos + 1
    _sift_up(heap, last, pos)
    return top


def _compiled() -> bool:
    """Whether this module runs compiled (``warmloop.sim.compiled``): its functions are
    then built-in ones, not Python functions."""
    return not isinstance(_compiled, types.FunctionType)


NATIVE_HEAP = _compiled()
"""The events' heap is kept by ``_push`` and ``_pop`` when compiled: there they read the
events' times as C fields, where ``heapq`` compares two events through the generic
rich comparison (a call of ``_Event.__lt__`` each: the heap's pops and pushes were 6-9 %
of a 128-GPU run). Interpreted, ``heapq`` (C) is the faster. Events are ordered by
(time, number), all distinct, so any heap pops them in the same order."""

COLLECT_EVERY_ALLOCATIONS = 2_000_000
"""The cyclic garbage collector's first threshold while events run (Python's default is
700). A fleet keeps millions of objects alive (block keys, chains, queued events) and
allocates a few short-lived objects an event; at the default the collector ran 14 full
and ~180 middle collections over a 10 s, 128-GPU run, a quarter of its time, walking
that live heap each time. Nothing the fleet keeps needs the collector (no cycles pile
up: peak memory is the same with it off), so it runs ~3,000x less often while a run
goes on, and as before after it. At 200,000 (before 2026-12-05, night) a 60 s warmloop
run still made 245 young and 23 middle collections, 5.4 s of its 60: objects that live
a few steps (a step's chain and request) were walked before they died; now one young
collection, 1 s, and the same peak memory (1.6 GB). Paired, whole runs (bench-fleet's,
128 GPUs, 60 s): warmloop 57.2 against 59.2 s, cache-aware 41.5 against 42.2."""


@contextmanager
def collecting_less() -> Iterator[None]:
    """Raise the collector's first threshold to ``COLLECT_EVERY_ALLOCATIONS`` for the
    block, then put the caller's back (a threshold of 0, collection off, stays off).
    Process-wide (the collector has one setting): another thread allocating meanwhile is
    collected less often too, and two threads' blocks that overlap can leave the raised
    threshold set."""
    first, *rest = gc.get_threshold()
    gc.set_threshold(max(first, COLLECT_EVERY_ALLOCATIONS) if first else 0, *rest)
    try:
        yield
    finally:
        gc.set_threshold(first, *rest)


def skip_exit_collection() -> None:
    """Freeze the collector's generations when the process exits, so it ends without
    the interpreter's last full collection.

    A large run leaves its fleet behind as cyclic garbage (a 128-GPU, 60 s run: ~1.6 GB
    of blocks, requests and engines that refer to one another), and the collection at
    exit walked all of it: 3.6 s after a round-robin run, 8.3 s at the end of
    ``bench-fleet``'s processes, after the figures were in. Registered with ``atexit``,
    which runs before that collection; the operating system takes the memory back.

    Hazard: objects in cycles are then not finalized at exit, so a ``__del__`` that
    flushes or closes something (a buffered file in a cycle) does not run. Call it in
    processes whose cyclic objects hold nothing to flush: the simulator's and its
    benchmarks'."""
    atexit.register(gc.freeze)


class Clock:
    """Simulated time and the events due at it, run in time order (FIFO among equals).

    While ``run(until)`` runs, events due after ``until`` wait in a plain list instead
    of the heap: a fleet schedules tens of thousands of approvals' resumes, prewarms and
    hold expiries minutes ahead, and each would make every push and pop of the events
    that do run deeper. A later ``run`` takes in those due by its end; the order is the
    same (time, then scheduling order)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[_Event] = []
        self._later: list[_Event] = []
        self._until = math.inf
        """The end of the run under way (``inf`` between runs): later events wait."""
        self._seq = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at time ``t`` (never before now)."""
        self.at_number(t, next(self._seq), fn, *args)

    def reserve(self, n: int) -> int:
        """Set aside the next ``n`` scheduling numbers (their order among events of the
        same time) for events scheduled later by ``at_number``; returns the first. Events
        given them run as if scheduled now, at the times they are given."""
        first = next(self._seq)
        self._seq = itertools.count(first + n)
        return first

    def at_number(self, t: float, number: int, fn: Callable[..., Any], *args: Any) -> None:
        """``at`` with a number from ``reserve`` (each given once)."""
        if t < self.now:
            t = self.now
        if t > self._until:
            self._later.append(_Event(t, number, fn, args))
        elif NATIVE_HEAP:
            _push(self._heap, _Event(t, number, fn, args))
        else:
            heapq.heappush(self._heap, _Event(t, number, fn, args))

    def after(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay_s, fn, *args)

    @property
    def pending(self) -> int:
        """Events scheduled and not run yet."""
        return len(self._heap) + len(self._later)

    def run(self, until: float | None = None) -> None:
        """Run events in order until none are left or the next is past ``until``."""
        heap = self._heap
        bound = math.inf if until is None else until
        if self._later:
            due = [e for e in self._later if e.t <= bound]
            self._later = [e for e in self._later if e.t > bound]
            for e in due:
                heapq.heappush(heap, e)
        self._until = bound
        pop = heapq.heappop
        try:
            with collecting_less():
                # two loops, not one through a local ``pop``: compiled, ``_pop`` called by
                # name is a native call, through a variable a generic Python one
                if NATIVE_HEAP:
                    while heap:
                        if heap[0].t > bound:
                            self.now = bound
                            return
                        e = _pop(heap)
                        self.now = e.t
                        self.events += 1
                        e.fn(*e.args)
                while heap:
                    if heap[0].t > bound:
                        self.now = bound
                        return
                    e = pop(heap)
                    self.now = e.t
                    self.events += 1
                    e.fn(*e.args)
        finally:
            self._until = math.inf
        if until is not None:
            self.now = max(self.now, until)
