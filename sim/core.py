"""The discrete-event core: a heap of timed callbacks (plainer and faster than SimPy)."""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Callable
from typing import Any

_Event = tuple[float, int, Callable[..., Any], tuple[Any, ...]]


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
        if t < self.now:
            t = self.now
        if t > self._until:
            self._later.append((t, next(self._seq), fn, args))
        else:
            heapq.heappush(self._heap, (t, next(self._seq), fn, args))

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
            due = [e for e in self._later if e[0] <= bound]
            self._later = [e for e in self._later if e[0] > bound]
            for e in due:
                heapq.heappush(heap, e)
        self._until = bound
        pop = heapq.heappop
        try:
            while heap:
                if heap[0][0] > bound:
                    self.now = bound
                    return
                t, _, fn, args = pop(heap)
                self.now = t
                self.events += 1
                fn(*args)
        finally:
            self._until = math.inf
        if until is not None:
            self.now = max(self.now, until)
