"""The discrete-event core: a heap of timed callbacks (plainer and faster than SimPy)."""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from typing import Any


class Clock:
    """Simulated time and the events due at it, run in time order (FIFO among equals)."""

    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., Any], tuple[Any, ...]]] = []
        self._seq = itertools.count()
        self.events = 0

    def at(self, t: float, fn: Callable[..., Any], *args: Any) -> None:
        """Run ``fn(*args)`` at time ``t`` (never before now)."""
        heapq.heappush(self._heap, (max(t, self.now), next(self._seq), fn, args))

    def after(self, delay_s: float, fn: Callable[..., Any], *args: Any) -> None:
        self.at(self.now + delay_s, fn, *args)

    def run(self, until: float | None = None) -> None:
        """Run events in order until none are left or the next is past ``until``."""
        heap = self._heap
        while heap:
            if until is not None and heap[0][0] > until:
                self.now = until
                return
            t, _, fn, args = heapq.heappop(heap)
            self.now = t
            self.events += 1
            fn(*args)
        if until is not None:
            self.now = max(self.now, until)
