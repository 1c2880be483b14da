"""How many steps an inference worker takes from its queue at once: from its engine's
capacity, not a constant.

A constant starves a big engine (an H100 runs 256 sequences at once; 64 slots keep it a
quarter full) and floods a small one (steps pile up in the engine's own FIFO, where
priority and failover no longer reach them). The worker's activity slots follow what
the engine can run at once (its calibrated ``max_batch``, and how many typical prompts
fit its KV pool), plus a queue share so the engine's scheduler never idles between one
step and the next, plus the batch steps admission holds back (they wait in the worker,
which orders them).
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass

from temporalio.worker import (
    CustomSlotSupplier,
    SlotMarkUsedContext,
    SlotPermit,
    SlotReleaseContext,
    SlotReserveContext,
)

from warmloop.activities.registry import EngineHeartbeat


@dataclass(frozen=True)
class StepSlotConfig:
    """Bounds of an inference worker's step slots (``WARMLOOP_INFERENCE_*``)."""

    floor: int = 16
    """Slots at least, whatever the engine says (and before its first heartbeat). Keep it
    high enough that a busy engine's steps are picked up within the job's
    ``step_pickup_timeout_s``, or they fail over as if the engine were dead."""
    ceiling: int = 1024
    """Slots at most: what one worker process may have in flight."""
    queue_share: float = 1.0
    """Slots beyond what the engine runs at once, as a share of that: the engine's
    scheduler takes the next step the moment one finishes instead of waiting a
    round-trip to Temporal. Higher keeps the engine busier; lower keeps more steps in
    Temporal's queue, where priority orders them and a dead engine's steps fail over."""

    def __post_init__(self) -> None:
        if self.floor < 1:
            raise ValueError(f"step slots floor {self.floor} must be at least 1")
        if self.ceiling < self.floor:
            raise ValueError(f"step slots ceiling {self.ceiling} is below the floor "
                             f"{self.floor}; raise WARMLOOP_INFERENCE_MAX_STEPS")
        if not 0 <= self.queue_share <= 16:
            raise ValueError(f"step slots queue_share {self.queue_share} must be in [0, 16]")


@dataclass(frozen=True)
class StepSlots:
    """How many steps the worker takes at once, and what set it (logged and tested:
    a slot count nobody can explain is as bad as a constant)."""

    slots: int
    engine_seqs: int | None
    """Sequences the engine runs at once: min(calibrated max_batch, KV fit)."""
    kv_fit: int | None
    """Typical prompts (the calibration's reference length) the KV pool holds."""
    batch_allowance: int
    reason: str


def step_slots(hb: EngineHeartbeat | None, config: StepSlotConfig) -> StepSlots:
    """The slot count for an engine as its last heartbeat describes it. Pure."""
    if hb is None or not hb.healthy:
        return StepSlots(config.floor, None, None, 0, "no heartbeat: the floor")
    cal = hb.calibration
    max_batch = cal.max_batch if cal is not None else None
    ref = cal.reference_prompt_tokens if cal is not None else None
    kv_fit = (max(1, hb.kv_capacity_tokens // ref)
              if ref and hb.kv_capacity_tokens > 0 else None)
    seqs = min((v for v in (max_batch, kv_fit) if v is not None), default=None)
    if seqs is None:
        return StepSlots(config.floor, None, None, 0,
                         "the engine reports neither calibration nor KV size: the floor")
    # batch steps that admission holds back wait in the worker, which orders them
    batch = (hb.batch_limit or 0) + hb.batch_waiting
    want = math.ceil(seqs * (1 + config.queue_share)) + batch
    slots = max(config.floor, min(config.ceiling, want))
    why = (f"engine runs {seqs} at once (max_batch {max_batch}, KV fit {kv_fit}), "
           f"x{1 + config.queue_share:g} for its queue, +{batch} batch")
    if slots != want:
        why += f"; clamped to [{config.floor}, {config.ceiling}]"
    return StepSlots(slots, seqs, kv_fit, batch, why)


class EngineStepSlots(CustomSlotSupplier):
    """Temporal activity slots whose count follows ``step_slots`` of the engine's latest
    heartbeat. A lower count never takes a running step's slot away: new steps wait
    until enough have finished.

    Hazard: Temporal's core calls ``try_reserve_slot``, ``mark_slot_used`` and
    ``release_slot`` from its own threads, ``reserve_slot`` on the worker's event loop:
    the count is guarded by a lock, and a release wakes the loop thread-safely. A waiting
    reserve wakes when a slot is released or the limit rises (``refresh``)."""

    def __init__(self, view: Callable[[], EngineHeartbeat | None],
                 config: StepSlotConfig | None = None) -> None:
        self.config = config or StepSlotConfig()
        self._view = view
        self.current = step_slots(None, self.config)
        self._in_use = 0
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._changed: asyncio.Event | None = None

    @property
    def limit(self) -> int:
        return self.current.slots

    @property
    def in_use(self) -> int:
        return self._in_use

    def refresh(self) -> StepSlots:
        """Re-read the engine's view (the heartbeat loop calls this every beat)."""
        before = self.current.slots
        self.current = step_slots(self._view(), self.config)
        if self.current.slots > before:
            self._wake()
        return self.current

    def _wake(self) -> None:
        loop, changed = self._loop, self._changed
        if loop is None or changed is None or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed since the check
            loop.call_soon_threadsafe(changed.set)

    def _take(self) -> bool:
        with self._lock:
            if self._in_use >= self.limit:
                return False
            self._in_use += 1
            return True

    async def reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit:
        if self._changed is None:
            self._loop, self._changed = asyncio.get_running_loop(), asyncio.Event()
        while True:
            self._changed.clear()
            if self._take():
                return SlotPermit()
            await self._changed.wait()

    def try_reserve_slot(self, ctx: SlotReserveContext) -> SlotPermit | None:
        return SlotPermit() if self._take() else None

    def mark_slot_used(self, ctx: SlotMarkUsedContext) -> None:
        return None

    def release_slot(self, ctx: SlotReleaseContext) -> None:
        with self._lock:
            self._in_use = max(0, self._in_use - 1)
        self._wake()
