"""Lanes: interactive steps go before batch steps. Pure policy, shared by the workflow
(Temporal task priority, the batch window), the inference worker (batch admission)
and the benchmarks."""

from __future__ import annotations

import math
from collections.abc import Callable

from pydantic import BaseModel, Field

from warmloop.workflows.contracts import Lane

# vLLM's request priority (--scheduling-policy priority; lower runs first).
VLLM_PRIORITY = {Lane.INTERACTIVE: 0, Lane.BATCH: 10}
# Temporal task priority (priority_key: 1 is highest, 5 lowest; unset is 3).
TASK_PRIORITY = {Lane.INTERACTIVE: 1, Lane.BATCH: 5}
BATCH_CONTINUING_TASK_PRIORITY = 4
"""A batch job's later steps go before new batch jobs' first steps: a burst then runs
jobs to completion while their prefixes are still cached (see warmloop.activities.admission)."""


def task_priority(lane: Lane, step: int) -> int:
    """Temporal task priority of a job's ``step`` (1-based) in ``lane``."""
    if lane == Lane.BATCH and step > 1:
        return BATCH_CONTINUING_TASK_PRIORITY
    return TASK_PRIORITY[lane]


class AdmissionConfig(BaseModel):
    """How many batch steps an engine runs at once (K), and how K adapts."""

    interactive_ttft_target_ms: float = Field(default=1500.0, gt=0)
    """Interactive TTFT p95 that batch admission defends. Tune it to the engine: a GPU
    engine's target is tens of ms, the tiny model on two CPU cores about a second."""
    k_min: int = Field(default=1, ge=0)
    """0 lets the lane yield an engine entirely while its interactive TTFT is over
    target (batch steps wait; K comes back to 1 once fresh interactive samples are well
    under target, or ``idle_grow_s`` after the cut, to try again). It protects interactive latency
    at the burst's expense where even one batch step at a time is too many."""
    k_max: int = Field(default=16, ge=1)
    k_start: int = Field(default=4, ge=1)
    k_start_from_calibration: bool = False
    """Start K from the engine's calibration (``calibrated_k_start``) instead of
    ``k_start``. Off by default: on the shared-core dev host the calibration's
    worst case (figures of an engine alone) overstates what K the host holds."""
    window: int = Field(default=20, ge=4)
    """Interactive TTFTs in the sliding window the p95 is taken over."""
    idle_grow_s: float = Field(default=5.0, gt=0)
    """With no interactive step for this long, K grows by one (the lane is idle)."""
    fleet_signal: bool = False
    """K also answers to the worst interactive TTFT p95 the other engines report. Set it
    when engines share a host (CPU engines, GPUs on one node's memory bandwidth) and
    batch work on one engine visibly slows interactive steps on its neighbour. Off by
    default: where interactive TTFT does not follow K (on the 2-core dev machine it is
    set by CPU contention from the whole stack), it would hold every engine's K at
    k_min for nothing."""
    kv_share: float = Field(default=0.8, gt=0, le=1)
    """Share of the engine's KV pool the batch jobs under way may fill; K is held to the
    jobs that fit in it, so that a job's prefix is still cached at its next step. Set 1
    to let K fill the pool; lower it when interactive jobs need their prefixes kept."""
    shared_slots: bool = True
    """K is the engine's, shared through Redis by every process that admits batch calls
    to it (its inference worker and each gateway replica), so N of them run at most K
    at once, not N x K. Off: each process admits up to K on its own."""
    slot_lease_s: float = Field(default=30.0, ge=3.0, le=3600.0)
    """How long a shared slot outlives its holder: a crashed or stalled process's batch
    slots come back to the engine after this. Holders renew every third of it."""


def calibrated_k_start(worst_ttft_s: Callable[[int], float], config: AdmissionConfig) -> int:
    """K to start from on an engine with a calibration: the largest K whose worst-case
    interactive TTFT (``worst_ttft_s(K)``: the step's prefill queued behind K batch
    prefills arriving at once, then a decode step among K + 1) meets the target. A
    start, not a limit: AIMD (``next_batch_limit``) moves K from there on what
    interactive steps measure."""
    target_s = config.interactive_ttft_target_ms / 1000
    k = max(1, config.k_min)
    while k < config.k_max and worst_ttft_s(k + 1) <= target_s:
        k += 1
    return k


def next_batch_limit(k: int, interactive_ttft_p95_ms: float | None,
                     config: AdmissionConfig) -> int:
    """AIMD on K: halve it when interactive TTFT p95 is over target, add one when it is
    comfortably under (or there is no interactive traffic), else keep it."""
    if interactive_ttft_p95_ms is None:
        return min(config.k_max, k + 1)
    target = config.interactive_ttft_target_ms
    if interactive_ttft_p95_ms > target:
        return max(config.k_min, k // 2)
    if interactive_ttft_p95_ms < 0.6 * target:
        return min(config.k_max, k + 1)
    return max(config.k_min, min(config.k_max, k))


def kv_fit_limit(kv_capacity_tokens: int, samples: list[tuple[int, int]],
                 config: AdmissionConfig, *, block_tokens: int) -> int:
    """How many batch jobs fit in the KV pool at once: 0 when unknown.

    ``samples`` are recent batch steps' (prompt tokens, tokens shared by every job of
    the profile). A job under way keeps its own part cached between steps; the shared
    prefix is cached once per engine. Counted in whole blocks of ``block_tokens``, as the
    pool holds them: the shared prefix's full blocks once, and a job's own part the rest
    of its prompt's blocks, a partly filled last block as a whole one (in tokens, a job
    with 60 own tokens on an engine of 128-token blocks counted for half the block it
    takes). ``block_tokens=1`` counts tokens."""
    if block_tokens < 1:
        raise ValueError(f"kv_fit_limit: block_tokens must be >= 1, got {block_tokens}")
    if kv_capacity_tokens <= 0 or not samples:
        return 0
    b = block_tokens
    shared = max(s for _, s in samples) // b
    own = sum(max(1, -(-p // b) - s // b) for p, s in samples) / len(samples)
    room = config.kv_share * (kv_capacity_tokens // b) - shared
    return max(1, int(room // own))


DEFAULT_BATCH_WINDOW = 4
"""The window of a batch that asks the fleet (``BatchInput.window`` unset) when no engine
serving its model says how many batch jobs it holds (no batch admission there), or the
registry cannot be read."""


class BatchWindowRequest(BaseModel):
    """Ask the fleet how many of a batch's jobs to keep in progress (``batch_window``)."""

    batch_id: str
    """The batch's workflow id: its own children (``{batch_id}-L{line}``) are not counted
    as other batches' jobs under way, and its answer is claimed under it."""
    model: str | None = None
    """The profile's model: only engines that serve it count; None: every engine."""
    max_window: int = Field(ge=1)
    records: int | None = Field(default=None, ge=0)
    """Records the page will run: the batch claims no more than that of the fit."""


class EngineBatchRoom(BaseModel):
    """What one engine says about batch work, as its heartbeat has it."""

    engine_id: str
    kv_fit: int | None = None
    """Batch jobs whose own tokens fit in the share of its pool batch work may fill, at
    the batch steps it served lately; None before it served one."""
    batch_limit: int | None = None
    """Batch steps it admits at once (K after the KV fit); None: no batch admission."""


class BatchWindow(BaseModel):
    """The window a batch that asks the fleet runs a page with, and why: the progress
    query and the worker log show it, so a window that looks small can be explained."""

    window: int = Field(ge=1)
    fit: int | None
    """Batch jobs the engines hold in all (before other batches' jobs and the bounds);
    None: no engine said (``window`` is then ``DEFAULT_BATCH_WINDOW``)."""
    others: dict[str, int] = Field(default_factory=dict)
    """Other batches on these engines and the jobs each counts: its jobs under way or
    the window it claimed lately, whichever is more."""
    engines: dict[str, int] = Field(default_factory=dict)
    """The jobs each engine that said anything counted."""
    by_k: list[str] = Field(default_factory=list)
    """Of ``engines``, those that counted their admission limit K (no batch step served
    there yet, so no job size to divide the pool by)."""
    why: str


def default_batch_window(max_window: int, reason: str,
                         others: dict[str, int] | None = None) -> BatchWindow:
    """The answer when the fleet cannot size the window (``reason`` says why):
    ``DEFAULT_BATCH_WINDOW`` within ``max_window``."""
    window = min(max_window, DEFAULT_BATCH_WINDOW)
    return BatchWindow(window=window, fit=None, others=others or {},
                       why=f"{reason}: the default {window}")


def batch_of(job_id: str) -> str:
    """The batch a batch-lane job belongs to: ``BatchRun`` names its children
    ``{batch_id}-L{line}``; a batch-lane job submitted alone is a batch of its own."""
    head, sep, line = job_id.rpartition("-L")
    return head if sep and line.isdigit() else job_id


def fleet_batch_window(engines: list[EngineBatchRoom], *, max_window: int,
                       others: dict[str, int] | None = None) -> BatchWindow:
    """How many of a batch's jobs to keep in progress: the jobs the engines' KV pools
    hold for batch work, less what ``others`` (other batches: their jobs under way, or
    the windows they claimed moments ago, before their jobs had steps) take of it, but
    never less than an equal share of the fit.

    A job under way keeps its own tokens cached between steps, so more jobs than fit
    evict one another's prefixes and each step recomputes its transcript; fewer leave
    the lane's room idle while jobs wait on tools. An engine that has not served a batch
    step yet (no observed job size) counts its admission limit K instead, the batch steps
    it runs at once: a first estimate until the first page's steps are measured. Engines
    without batch admission say nothing; if none says anything, ``DEFAULT_BATCH_WINDOW``.
    The equal share (the fit over the batches, this one included) keeps a batch that
    starts beside a running one from a window of 1; the two converge on sharing the fit
    as each later page asks again. Bounded to ``[1, max_window]``."""
    others = {b: n for b, n in (others or {}).items() if n > 0}
    said = [(e, e.kv_fit if e.kv_fit is not None else e.batch_limit) for e in engines]
    counted = [(e, n) for e, n in said if n is not None]
    if not counted:
        return default_batch_window(max_window, f"no engine of {len(engines)} reports its "
                                    "batch room (no batch admission)", others)
    fit = sum(n for _, n in counted)
    taken = sum(others.values())
    share = fit // (len(others) + 1)
    wanted = max(fit - taken, share)
    window = max(1, min(max_window, wanted))
    parts = ", ".join(f"{e.engine_id} {n}{'' if e.kv_fit is not None else ' (K)'}"
                      for e, n in counted)
    why = f"KV fit {fit} ({parts})"
    if others:
        why += f" less {taken} for {len(others)} other batch{'es' if len(others) > 1 else ''}"
        if share > fit - taken:
            why += f"; an equal share, {share}"
    if wanted > max_window:
        why += f", capped at max_window {max_window}"
    return BatchWindow(window=window, fit=fit, others=others, why=why,
                       engines={e.engine_id: n for e, n in counted},
                       by_k=[e.engine_id for e, _ in counted if e.kv_fit is None])


def adapt_window(window: int, *, base: int, max_window: int, remaining: int,
                 seconds_per_record: float | None, seconds_left: float | None) -> int:
    """The batch's sliding window for its deadline.

    Widen it (up to ``max_window``, the fleet's batch capacity) when the records left
    at the current pace would miss the deadline; narrow it back toward ``base`` when
    the batch is well ahead, leaving the engines to interactive work."""
    if seconds_left is None or seconds_per_record is None or remaining <= 0:
        return window
    if seconds_left <= 0:
        return max_window
    needed = remaining * seconds_per_record * window  # seconds of one window-slot's work
    wanted = math.ceil(needed / seconds_left)
    if wanted > window:
        return min(max_window, max(wanted, window + 1))
    if wanted < window // 2:
        return max(base, window - 1)
    return window


def estimate_finish_s(*, done: int, remaining: int, elapsed_s: float) -> float | None:
    """Seconds until the batch ends at its pace so far (None before the first record)."""
    if done <= 0 or elapsed_s <= 0:
        return None
    return remaining * elapsed_s / done
