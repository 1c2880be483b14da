"""Batch admission on one engine: at most K batch-lane steps run at once.

vLLM's priority scheduling lets an interactive request jump the queue, but it does not
preempt running batch requests, and every running sequence slows each decode
iteration. So the worker beside the engine caps the batch steps it lets through, and
adapts the cap (``workflows.lanes.next_batch_limit``) to the interactive TTFT it sees.
"""

from __future__ import annotations

import asyncio
import time
from collections import deque
from collections.abc import Callable

from workflows.lanes import AdmissionConfig, next_batch_limit


class BatchAdmission:
    def __init__(self, config: AdmissionConfig | None = None, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.config = config or AdmissionConfig()
        self.limit = min(self.config.k_max, max(self.config.k_min, self.config.k_start))
        self.active = 0
        self.waiting = 0
        self._ttfts: deque[float] = deque(maxlen=self.config.window)
        self._last_interactive: float | None = None
        self._last_adjust = clock()
        self._clock = clock
        self._changed = asyncio.Condition()

    def interactive_p95_ms(self) -> float | None:
        if not self._ttfts:
            return None
        s = sorted(self._ttfts)
        return s[min(len(s) - 1, round(0.95 * (len(s) - 1)))]

    async def acquire(self, on_wait: Callable[[], None] | None = None) -> None:
        """Wait for a batch slot; ``on_wait`` runs every second while waiting (heartbeat)."""
        self.waiting += 1
        try:
            async with self._changed:
                while self.active >= self.limit:
                    try:
                        await asyncio.wait_for(self._changed.wait(), timeout=1.0)
                    except TimeoutError:
                        self._grow_if_idle()
                        if on_wait is not None:
                            on_wait()
                self.active += 1
        finally:
            self.waiting -= 1

    async def release(self) -> None:
        async with self._changed:
            self.active -= 1
            self._grow_if_idle()
            self._changed.notify_all()

    async def observe_interactive(self, ttft_ms: float) -> None:
        """An interactive step's TTFT: K halves at once when p95 is over target, and
        grows by one at most once per window of observations."""
        self._ttfts.append(ttft_ms)
        self._last_interactive = self._clock()
        p95 = self.interactive_p95_ms()
        new = next_batch_limit(self.limit, p95, self.config)
        if new < self.limit or (new > self.limit and len(self._ttfts) >= self.config.window
                                and self._clock() - self._last_adjust > 1.0):
            await self._set(new)

    def _grow_if_idle(self) -> None:
        now = self._clock()
        idle = self._last_interactive is None or \
            now - self._last_interactive > self.config.idle_grow_s
        if idle and now - self._last_adjust > self.config.idle_grow_s \
                and self.limit < self.config.k_max:
            self.limit = next_batch_limit(self.limit, None, self.config)
            self._last_adjust = now
            self._ttfts.clear()

    async def _set(self, k: int) -> None:
        async with self._changed:
            if k < self.limit:
                # judge the smaller K on fresh samples, not on the ones that cut it
                self._ttfts.clear()
            self.limit = k
            self._last_adjust = self._clock()
            self._changed.notify_all()
