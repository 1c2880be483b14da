"""The simulated engine: block prefix cache, LRU eviction, batching step time."""

from __future__ import annotations

import gc

import pytest

from warmloop.sim.core import COLLECT_EVERY_ALLOCATIONS, Clock
from warmloop.sim.engine import Engine, Host, HostSharing, PrefixCache, Request
from warmloop.workflows.calibration import DecodePoint, EngineCalibration, PrefillPoint


def cal(blocks: int = 8, overhead: float = 0.0) -> EngineCalibration:
    return EngineCalibration(
        model="m", hardware="h", source="test",
        prefill=(PrefillPoint(prompt_tokens=1, tokens_per_s=1_000),),
        decode=(DecodePoint(batch_size=1, step_s=0.01), DecodePoint(batch_size=3, step_s=0.03)),
        step_overhead_s=overhead, kv_pool_blocks=blocks, block_size=10, kv_bytes_per_token=1,
        gpu_hour_usd=1.0, max_batched_tokens=10_000)


def chain(name: str, n: int) -> list[tuple[str, int]]:
    return [(name, i) for i in range(n)]


def run_one(engine: Engine, clock: Clock, req: Request) -> Request:
    engine.submit(req)
    clock.run()
    return req


def test_the_collector_runs_less_while_events_run_and_as_before_after() -> None:
    """A run raises the garbage collector's first threshold (a quarter of a large fleet's
    time went to collections at Python's 700) and puts the caller's back, also when an
    event raises."""
    before = gc.get_threshold()
    seen: list[tuple[int, ...]] = []
    clock = Clock()
    clock.at(1.0, lambda: seen.append(gc.get_threshold()))
    clock.run()
    assert seen[0][0] == max(before[0], COLLECT_EVERY_ALLOCATIONS)
    assert seen[0][1:] == before[1:] and gc.get_threshold() == before

    def boom() -> None:
        raise RuntimeError("event failed")

    clock.at(2.0, boom)
    with pytest.raises(RuntimeError, match="event failed"):
        clock.run()
    assert gc.get_threshold() == before

    gc.set_threshold(0, *before[1:])  # the caller turned automatic collection off
    try:
        clock.at(3.0, lambda: seen.append(gc.get_threshold()))
        clock.run()
        assert seen[-1][0] == 0 and gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)


def test_lru_evicts_least_recent_and_tail_blocks_first() -> None:
    cache = PrefixCache(4)
    cache.acquire(chain("a", 2))
    cache.release(chain("a", 2))
    cache.acquire(chain("b", 2))
    cache.release(chain("b", 2))
    cache.acquire(chain("c", 1))  # evicts a's last block first
    assert cache.hit_blocks(chain("a", 2)) == 1
    assert cache.hit_blocks(chain("b", 2)) == 2
    cache.release(chain("c", 1))


def test_a_hold_let_go_is_as_old_as_its_last_touch() -> None:
    """A hold's own blocks released as last used at ``used_at`` (its last touch) are
    evicted before blocks released after that time and after those released before it;
    the shared prefix before ``aged_from`` is released as used now. Without the age, a
    simulated hold let go for room outlived the measured one by up to a touch interval
    (bench-pauses: 256 tokens recomputed after lookups against the measured 640)."""
    clock = Clock()
    cache = PrefixCache(10, clock=clock)
    old, held, new = chain("old", 2), ["s0", "s1", "h0", "h1"], chain("new", 2)
    cache.acquire(old)
    cache.acquire(held)
    cache.acquire(new)
    clock.now = 1.0
    cache.release(old)  # released at 1.0
    clock.now = 3.0
    cache.release(new)  # released at 3.0
    clock.now = 4.0
    cache.release(held, used_at=2.0, aged_from=2)  # own blocks h1, h0 as of 2.0
    assert cache.aged_keys() == ["h1", "h0"] and cache.lru_keys()[-2:] == ["s1", "s0"]
    assert cache.used_blocks == 0 and cache.evictable("h0") and cache.evictable("s0")
    cache.acquire(chain("x", 2))  # 2 empty blocks: nothing evicted
    cache.acquire(chain("y", 6))  # evicts old (1.0), then h1, h0 (2.0), then new (3.0)
    assert cache.hit_blocks(old) == 0 and cache.hit_blocks(held) == 2
    assert cache.hit_blocks(new) == 0 and not cache.aged_keys()
    assert cache.hit_blocks_walk(held) == 2  # the shared prefix outlives the own tail


def test_an_aged_block_used_again_is_not_evicted_as_aged() -> None:
    clock = Clock()
    cache = PrefixCache(4, clock=clock)
    cache.acquire(["a0", "a1"])
    clock.now = 5.0
    cache.release(["a0", "a1"], used_at=1.0)
    cache.acquire(["a0", "a1"])  # used again: out of the aged set, its entries stale
    assert not cache.aged_keys() and cache.used_blocks == 2
    cache.acquire(["b0", "b1"])
    clock.now = 6.0
    cache.release(["b0", "b1"])
    cache.acquire(["c0"])  # evicts b1 (the LRU's tail first), not a stale aged entry
    assert cache.hit_blocks(["a0", "a1"]) == 2 and cache.hit_blocks(["b0", "b1"]) == 1
    cache.release(["a0", "a1"], used_at=9.0)  # not before now: as used now
    assert not cache.aged_keys() and cache.lru_keys()[-2:] == ["a1", "a0"]


def test_a_request_short_of_room_takes_held_blocks_instead_of_waiting() -> None:
    """vLLM keeps a hold's blocks only by touching them, in its free queue: a request that
    needs the room evicts them (the hold is lost) and runs. The simulator pins held
    blocks, so it asks the fleet to let a hold go (``Engine.reclaim``); before, the
    request waited behind the holds for as long as they lasted."""
    clock = Clock()
    e = Engine(clock, "e0", cal(blocks=8))
    run_one(e, clock, Request(chain=chain("p", 6), prompt_tokens=65, output_tokens=1))
    keys = e.pin(chain("p", 6))
    waiting = Request(chain=chain("q", 6), prompt_tokens=65, output_tokens=1)
    run_one(e, clock, waiting)
    queued = lambda r: any(w[2] is r for w in e.waiting)  # noqa: E731
    assert queued(waiting)  # no reclaim: it waits behind the pinned blocks

    let_go: list[int] = []

    def reclaim(engine: Engine) -> bool:
        if let_go:
            return False  # nothing more held
        let_go.append(engine.cache.used_blocks)
        engine.unpin(keys, kick=False)  # from within admission: no kick
        return True

    e.reclaim = reclaim
    r = run_one(e, clock, Request(chain=chain("r", 6), prompt_tokens=65, output_tokens=1))
    assert let_go == [6]  # asked once, the six held blocks in use then
    assert not e.waiting and waiting.done_at > waiting.submitted_at > 0
    assert r.done_at > r.submitted_at  # both ran, one after the other
    assert waiting.cached_tokens == 0 and e.cache.hit_blocks(chain("p", 6)) == 0
    e.reclaim = lambda engine: False  # asked with nothing to give: it waits as before
    keys = e.pin(chain("r", 6))  # the last request's blocks, cached
    late = run_one(e, clock, Request(chain=chain("s", 6), prompt_tokens=65, output_tokens=1))
    assert queued(late) and len(keys) == 6


def test_a_pinned_chain_cut_short_keeps_its_head_and_frees_its_tail() -> None:
    """A hold cut for room (``Fleet._trim``): its tail becomes evictable, its head stays
    in use until the hold ends, and then every block is free. Releasing the tail alone
    (as a first version did) left the head's users uncounted, and the agentic fleet's
    engines stalled with their pools pinned (439.5 -> 107 jobs per GPU-hour)."""
    clock = Clock()
    e = Engine(clock, "e0", cal(blocks=8))
    run_one(e, clock, Request(chain=chain("p", 6), prompt_tokens=65, output_tokens=1))
    keys = e.pin(chain("p", 6))
    assert len(keys) == 6
    e.unpin_tail(keys, 2)
    cache = e.cache
    assert [k in cache.lru_keys() for k in keys] == [False, False] + [True] * 4
    e.unpin(keys[:2])
    assert all(k in cache.lru_keys() for k in keys)  # nothing left in use
    # the whole pool is usable again: a request of all its 7 usable blocks runs
    r = run_one(e, clock, Request(chain=chain("q", 6), prompt_tokens=65, output_tokens=1))
    assert r.cached_tokens == 0 and r.first_token_at > r.submitted_at


def test_a_pool_caches_one_block_fewer_than_it_has() -> None:
    """vLLM's ``BlockPool`` keeps its first block as the null block, so an engine of 8
    blocks runs a request of 7 and refuses one of 8 (it could never fit)."""
    clock = Clock()
    e = Engine(clock, "e0", cal(blocks=8))
    assert e.cache.capacity == 7
    fits = run_one(e, clock, Request(chain=chain("a", 6), prompt_tokens=65, output_tokens=1))
    assert fits.first_token_at > fits.submitted_at and fits.computed_tokens == 65
    refused = run_one(e, clock, Request(chain=chain("b", 7), prompt_tokens=75,
                                        output_tokens=1))
    assert refused.first_token_at == 0.0 and refused.done_at == clock.now


def test_second_request_hits_the_prefix_and_full_hit_recomputes_a_block() -> None:
    clock = Clock()
    e = Engine(clock, "e0", cal())
    first = run_one(e, clock, Request(chain=chain("p", 3), prompt_tokens=35, output_tokens=1))
    assert first.cached_tokens == 0
    second = run_one(e, clock, Request(chain=chain("p", 3), prompt_tokens=35, output_tokens=1))
    assert second.cached_tokens == 30
    same = run_one(e, clock, Request(chain=chain("p", 3), prompt_tokens=30, output_tokens=1))
    assert same.cached_tokens == 20  # the last token is always computed


def test_ttft_follows_the_calibration() -> None:
    clock = Clock()
    e = Engine(clock, "e0", cal(overhead=0.05))
    r = run_one(e, clock, Request(chain=chain("p", 5), prompt_tokens=50, output_tokens=1))
    # overhead + one step: decode_step(1) + 50 tokens / 1000 tokens/s
    assert r.ttft_s == pytest.approx(0.05 + 0.01 + 0.05)


def test_decode_time_follows_the_batch_size() -> None:
    clock = Clock()
    e = Engine(clock, "e0", cal(blocks=100))
    alone = run_one(e, clock, Request(chain=chain("x", 1), prompt_tokens=10, output_tokens=11))
    assert alone.done_at - alone.first_token_at == pytest.approx(10 * 0.01)
    reqs = [Request(chain=chain(f"j{i}", 1), prompt_tokens=10, output_tokens=11) for i in range(3)]
    for r in reqs:
        e.submit(r)
    clock.run()
    # r0 prefills alone, r1 and r2 together (r0 decodes one token in that step), then
    # all three decode at batch 3 (0.03 s a step) until r0 leaves (batch 2: 0.02 s)
    assert reqs[0].done_at - reqs[0].first_token_at == pytest.approx(0.05 + 9 * 0.03)
    assert reqs[2].done_at - reqs[2].first_token_at == pytest.approx(9 * 0.03 + 0.02)


def test_pool_too_small_queues_requests() -> None:
    clock = Clock()
    e = Engine(clock, "e0", cal(blocks=3))
    a = Request(chain=chain("a", 2), prompt_tokens=20, output_tokens=5)
    b = Request(chain=chain("b", 2), prompt_tokens=20, output_tokens=5)
    e.submit(a)
    e.submit(b)
    clock.run()
    assert b.first_token_at >= a.done_at


class CountingCache:
    """The prefix cache as it was: a user count on every block (the reference for the
    fast cache's users-end-here bookkeeping)."""

    def __init__(self, blocks: int) -> None:
        self.empty = blocks
        self.ref: dict[object, int] = {}
        self.lru: dict[object, None] = {}  # insertion-ordered: the LRU

    def hit_blocks(self, chain: list[object]) -> int:
        n = 0
        while n < len(chain) and chain[n] in self.ref:
            n += 1
        return n

    def acquire(self, keys: list[object]) -> None:
        for k in keys:
            c = self.ref.get(k)
            if c is None:
                if self.empty:
                    self.empty -= 1
                else:
                    old = next(iter(self.lru))
                    del self.lru[old], self.ref[old]
                self.ref[k] = 1
            elif c == 0:
                del self.lru[k]
                self.ref[k] = 1
            else:
                self.ref[k] = c + 1

    def release(self, keys: list[object]) -> None:
        for k in reversed(keys):
            if self.ref[k] <= 1:
                self.ref[k] = 0
                self.lru[k] = None
            else:
                self.ref[k] -= 1


@pytest.mark.parametrize("walk", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_cache_bookkeeping_matches_per_block_counts(seed: int, walk: bool) -> None:
    """Random uses and releases of trie-shaped chains (shared family prefixes, each
    job's own blocks after them), with evictions: the same cached blocks, LRU order,
    free blocks and hits as counting every block's users."""
    import random

    rng = random.Random(seed)
    # odd seeds drop stale LRU places at once (the default lets a pool's worth wait)
    fast = PrefixCache(rng.choice([40, 80, 200]), index={}, stale_slack=0 if seed % 2 else None)
    ref = CountingCache(0)
    ref.empty = fast.capacity
    acquire = fast.acquire_walk if walk else fast.acquire
    release = fast.release_walk if walk else fast.release
    hit = fast.hit_blocks_walk if walk else fast.hit_blocks
    chains: list[list[object]] = []
    for j in range(12):
        f = j % 3
        chain: list[object] = [("f", f, i) for i in range(6 + f)]
        chains.append(chain + [("j", j, i) for i in range(rng.randint(0, 20))])
    users: list[list[object]] = []
    for _ in range(600):
        if users and rng.random() < 0.45:
            keys = users.pop(rng.randrange(len(users)))
            release(keys)
            ref.release(keys)
        else:
            chain = rng.choice(chains)
            # a hold (the cached leading blocks only) or a request
            keys = (chain[:hit(chain)] if rng.random() < 0.3
                    else chain[:rng.randint(1, len(chain))])
            used = sum(1 for k in ref.ref if ref.ref[k] > 0)
            if len(keys) - ref.hit_blocks(keys) > fast.empty + fast.evictable_blocks or \
                    used + len(keys) > fast.capacity:
                continue  # would not fit: the engine would not admit it
            acquire(keys)
            ref.acquire(keys)
            users.append(keys)
        assert fast.lru_keys() == list(ref.lru)
        assert fast.ref.keys() == ref.ref.keys()
        assert fast.empty == ref.empty
        assert fast.usage == fast.used_blocks / fast.capacity
        assert fast.index is not None and fast.index.keys() == ref.ref.keys()
        for chain in chains:
            assert hit(chain) == ref.hit_blocks(chain)
            assert fast._first_unused(chain, hit(chain)) == sum(
                1 for k in chain[:hit(chain)] if ref.ref[k] > 0)


def test_a_holds_last_touch_never_moves_back() -> None:
    """The touch interval follows the churn: estimated later with a longer interval, a
    hold's last touch would fall before the one its cut tail was let go at, and its head
    would be evicted before that tail (a chain with a hole: the agentic fleet with
    ``cut_for_room`` crashed on it)."""
    from warmloop.sim.fleet import POLICIES, Fleet, _Hold
    from warmloop.sim.scenarios import CPU_TINY_LOADED

    clock = Clock()
    fleet = Fleet(clock, [CPU_TINY_LOADED], POLICIES["warmloop"])
    hold = _Hold(fleet.engines[0], [], None, created=0.0, used_at=0.0)  # type: ignore[arg-type]
    intervals = iter([5.0, 30.0, 4.0])
    fleet._touch_interval = lambda engine: next(intervals)  # type: ignore[method-assign,assignment]
    clock.now = 12.0
    assert fleet._last_touch(hold) == 10.0  # touched at 5 and 10
    clock.now = 13.0
    assert fleet._last_touch(hold) == 10.0  # not 0.0: no touch yet at a 30 s interval
    clock.now = 17.0
    assert fleet._last_touch(hold) == 16.0


@pytest.mark.parametrize("seed", range(8))
def test_aged_releases_keep_every_chain_a_prefix(seed: int) -> None:
    """Random uses and releases of trie-shaped chains, half the releases aged as the
    fleet ages a hold (its own blocks, at a time that never goes back before the job's
    last release of them): the fast cache equals the walks, its counts a recount, and
    no chain ever has a hole (a block evicted before its successors)."""
    import random

    rng = random.Random(seed)
    clock = Clock()
    capacity = rng.choice([30, 60, 120])
    slack = 0 if seed % 2 else None  # odd seeds drop stale places at once
    fast = PrefixCache(capacity, index={}, clock=clock, stale_slack=slack)
    walk = PrefixCache(capacity, index={}, clock=clock, stale_slack=slack)
    chains: list[list[object]] = []
    shared: list[int] = []
    for j in range(10):
        n = 4 + j % 3
        family: list[object] = [("f", j % 3, i) for i in range(n)]
        chains.append(family + [("j", j, i) for i in range(rng.randint(0, 15))])
        shared.append(n)
    floor: dict[int, float] = {}
    users: list[tuple[int, list[object]]] = []
    for _ in range(400):
        clock.now += rng.random()
        if users and rng.random() < 0.45:
            j, keys = users.pop(rng.randrange(len(users)))
            if rng.random() < 0.5:
                used_at = floor[j] = rng.uniform(floor.get(j, 0.0), clock.now)
                fast.release(keys, used_at=used_at, aged_from=shared[j])
                walk.release_walk(keys, used_at=used_at, aged_from=shared[j])
            else:
                floor[j] = clock.now
                fast.release(keys)
                walk.release_walk(keys)
        else:
            j = rng.randrange(len(chains))
            chain = chains[j]
            keys = (chain[:fast.hit_blocks(chain)] if rng.random() < 0.3
                    else chain[:rng.randint(1, len(chain))])
            hit = fast.hit_blocks(keys)
            if not keys or not fast.can_allocate(hit, keys, len(keys) - hit) \
                    or fast.used_blocks + len(keys) > capacity:
                continue
            fast.acquire(keys)
            walk.acquire_walk(keys)
            users.append((j, keys))
        assert fast.ref == walk.ref and fast.lru_keys() == walk.lru_keys()
        assert fast.aged_keys() == walk.aged_keys()
        assert fast.used_blocks == walk.used_blocks == sum(1 for k in fast.ref if fast.ref[k] > 0)
        for c in chains:
            assert fast.hit_blocks(c) == fast.hit_blocks_walk(c)


@pytest.mark.parametrize("seed", range(8))
def test_runs_simulate_like_a_block_each(seed: int) -> None:
    """A job's own blocks kept as one record (``own_from``: ``PrefixCache._Run``) against
    the same chains kept a ``ref`` key a block (no ``own_from``; the test above holds
    that path to the walks): random uses, releases (half
    of them aged, as holds are), cut tails and evictions of fleet-shaped chains (a
    family's shared keys, then the job's own dense ints), with the eviction regret
    following both. After every operation: the same blocks in the same LRU and aged
    order, the same use, the same hits and warm engines, the same regret (so the same
    evictions in the same order), and the runs' records consistent (``check_runs``)."""
    import random

    from warmloop.workflows.holding import EvictionRegret

    rng = random.Random(seed)
    clock = Clock()
    capacity = rng.choice([30, 60, 120])
    slack = 0 if seed % 2 else None
    fast = PrefixCache(capacity, index={}, clock=clock, stale_slack=slack, run_index={},
                       regret=EvictionRegret(), block_tokens=16)
    walk = PrefixCache(capacity, index={}, clock=clock, stale_slack=slack,
                       regret=EvictionRegret(), block_tokens=16)  # a block each
    chains: list[list[object]] = []
    shared: list[int] = []
    for j in range(10):
        n = rng.choice([0, 3, 4, 5]) if j else 0  # job 0: no shared part at all
        family: list[object] = [-(j % 3 + 1) * 1000 + i for i in range(n)]
        own = rng.randint(1, 15)
        chains.append(family + list(range(10_000 * (j + 1), 10_000 * (j + 1) + own)))
        shared.append(n)
    floor: dict[int, float] = {}
    users: list[tuple[int, list[object]]] = []
    for _ in range(500):
        clock.now += rng.random()
        r = rng.random()
        if users and r < 0.4:
            j, keys = users.pop(rng.randrange(len(users)))
            if rng.random() < 0.5:
                used_at = floor[j] = rng.uniform(floor.get(j, 0.0), clock.now)
                # the chain itself and a count, as an engine's request holds it
                fast.release(chains[j], used_at=used_at, aged_from=shared[j],
                             own_from=shared[j], count=len(keys))
                walk.release(keys, used_at=used_at, aged_from=shared[j])
            else:
                floor[j] = clock.now
                fast.release(keys, own_from=shared[j])
                walk.release(keys)
        elif users and r < 0.5:  # a hold cut short: its tail let go, aged
            i = rng.randrange(len(users))
            j, keys = users[i]
            if len(keys) < 2:
                continue
            kept = rng.randint(1, len(keys) - 1)
            used_at = floor[j] = rng.uniform(floor.get(j, 0.0), clock.now)
            fast.acquire(keys[:kept], -1, shared[j])
            fast.release(keys, used_at=used_at, aged_from=max(kept, shared[j]),
                         own_from=shared[j])
            walk.acquire(keys[:kept])
            walk.release(keys, used_at=used_at, aged_from=max(kept, shared[j]))
            users[i] = (j, keys[:kept])
        else:
            j = rng.randrange(len(chains))
            chain = chains[j]
            keys = (chain[:fast.hit_blocks(chain, shared[j])] if rng.random() < 0.3
                    else chain[:rng.randint(1, len(chain))])
            hit = fast.hit_blocks(keys, shared[j])
            if not keys or not fast.can_allocate(hit, keys, len(keys) - hit, shared[j]) \
                    or fast.used_blocks + len(keys) > capacity:
                continue
            assert walk.can_allocate(hit, keys, len(keys) - hit)
            if rng.random() < 0.5:
                fast.acquire(keys, -1 if rng.random() < 0.5 else hit, shared[j])
            else:
                fast.acquire(chain, hit, shared[j], len(keys))
            walk.acquire(keys)
            users.append((j, keys))
        assert fast.lru_keys() == walk.lru_keys()
        assert fast.aged_keys() == walk.aged_keys()
        assert fast.used_blocks == walk.used_blocks
        assert fast.evictable_blocks == walk.evictable_blocks and fast.empty == walk.empty
        assert fast.regret is not None and walk.regret is not None
        assert list(fast.regret._ghosts.items()) == list(walk.regret._ghosts.items())
        assert fast.regret.regretted == walk.regret.regretted
        assert fast.stored_blocks == walk.stored_blocks
        fast.check_runs()
        assert fast.index is not None and fast.run_index is not None
        assert walk.index is not None
        assert fast.index.keys() | {r.first + i for r in fast.runs.values()
                                    for i in range(r.cached)} == walk.index.keys()
        for j, c in enumerate(chains):
            assert fast.hit_blocks(c, shared[j]) == walk.hit_blocks(c) == walk.hit_blocks_walk(c)


def _pair(slowdown: float | None) -> tuple[Clock, Engine, Engine]:
    """Two engines, on one host sharing its cores (``slowdown``) or each on its own."""
    clock = Clock()
    hosts = [Host(slowdown)] * 2 if slowdown is not None else [None, None]
    e0 = Engine(clock, "e0", cal(blocks=100), host=hosts[0])
    e1 = Engine(clock, "e1", cal(blocks=100), host=hosts[1])
    return clock, e0, e1


def test_an_engine_alone_on_its_host_steps_at_its_calibrated_pace() -> None:
    clock, e0, _ = _pair(1.5)
    r = run_one(e0, clock, Request(chain=chain("a", 5), prompt_tokens=50, output_tokens=21))
    assert r.done_at == pytest.approx(0.06 + 20 * 0.01)  # prefill step, then 20 decodes


def test_engines_sharing_a_host_slow_each_other_while_both_step() -> None:
    """While the other engine steps throughout, every step runs ``slowdown`` times its
    calibrated length; engines on hosts of their own do not slow each other."""
    clock, e0, e1 = _pair(1.5)
    long = Request(chain=chain("b", 5), prompt_tokens=50, output_tokens=200)
    e1.submit(long)
    r = run_one(e0, clock, Request(chain=chain("a", 5), prompt_tokens=50, output_tokens=21))
    assert r.done_at == pytest.approx(1.5 * (0.06 + 20 * 0.01))
    assert long.done_at > r.done_at
    clock, e0, e1 = _pair(None)
    e1.submit(Request(chain=chain("b", 5), prompt_tokens=50, output_tokens=200))
    r = run_one(e0, clock, Request(chain=chain("a", 5), prompt_tokens=50, output_tokens=21))
    assert r.done_at == pytest.approx(0.06 + 20 * 0.01)


def test_an_engine_speeds_up_at_its_next_step_once_the_other_goes_idle() -> None:
    """The other engine's short request ends mid-way through this one's decode: this
    engine's planned segment is cut at its next step, and the rest runs at full pace."""
    for first in ("short", "long"):
        clock, e0, e1 = _pair(2.0)
        short = Request(chain=chain("b", 4), prompt_tokens=45, output_tokens=5)
        long = Request(chain=chain("a", 5), prompt_tokens=50, output_tokens=41)
        for engine, req in ((e1, short), (e0, long))[::1 if first == "short" else -1]:
            engine.submit(req)
        clock.run()
        # both prefill side by side at half pace (whichever was planned first is
        # re-paced when the other starts), then e1's 4 decode steps at 0.02 s
        assert short.done_at == pytest.approx(2 * 0.055 + 4 * 0.02), first
        # e0: its prefill (0.12 s), decode steps at 0.02 s until e1 went idle at 0.19
        # (the fourth, under way then, ends at 0.20), then 36 steps at full pace
        assert long.done_at == pytest.approx(0.12 + 4 * 0.02 + 36 * 0.01), first
        assert e0.busy_s == pytest.approx(long.done_at)
        assert e1.busy_s == pytest.approx(short.done_at)


def test_a_prefill_under_way_takes_the_new_pace_for_its_rest() -> None:
    """An engine's prefill step planned alone is re-paced when the other engine starts
    stepping part-way through it: the part left runs ``slowdown`` times as long."""
    clock, e0, e1 = _pair(2.0)
    long = Request(chain=chain("a", 5), prompt_tokens=50, output_tokens=1)
    e0.submit(long)  # its prefill step: 0.06 s alone
    clock.at(0.02, e1.submit, Request(chain=chain("b", 5), prompt_tokens=50,
                                     output_tokens=200))
    clock.run()
    assert long.done_at == pytest.approx(0.02 + 2 * 0.04)


def test_a_slowdown_of_one_is_no_sharing_at_all() -> None:
    """``HostSharing(slowdown=1)`` leaves every engine on a host of its own: the same
    events and times as no sharing, so baselines replay alike."""
    from warmloop.sim.fleet import Fleet, FleetConfig, Policy

    fleet = Fleet(Clock(), [cal()] * 4, Policy("rr", "round_robin", "never", False, False),
                  FleetConfig(host_sharing=HostSharing(engines_per_host=2, slowdown=1.0)))
    assert all(e.host is None for e in fleet.engines)
    fleet = Fleet(Clock(), [cal()] * 3, Policy("rr", "round_robin", "never", False, False),
                  FleetConfig(host_sharing=HostSharing(engines_per_host=2, slowdown=1.5)))
    hosts = [e.host for e in fleet.engines]
    assert hosts[0] is hosts[1] is not hosts[2] and hosts[2] is not None
    assert len(hosts[2].engines) == 1  # type: ignore[union-attr]


@pytest.mark.parametrize("kw, message", [
    (dict(engines_per_host=0, slowdown=1.5), "engines_per_host must be at least 1"),
    (dict(engines_per_host=2, slowdown=0.5), r"slowdown must be in \[1, 100\]"),
])
def test_host_sharing_refuses_settings_that_make_no_sense(kw: dict[str, float],
                                                         message: str) -> None:
    with pytest.raises(ValueError, match=message):
        HostSharing(**kw)  # type: ignore[arg-type]


def test_engines_of_one_calibration_share_its_memoised_curves() -> None:
    """A fleet's engines of one calibration fill one memo of its curves (each filled
    its own); engines of another calibration keep theirs, and sharing across two is
    refused, since their curves differ."""
    from warmloop.sim.fleet import POLICIES, Fleet, FleetConfig

    fast, slow = cal(), cal(overhead=0.05)
    fleet = Fleet(Clock(), [fast, fast, slow], POLICIES["warmloop"], FleetConfig())
    a, b, c = fleet.engines
    assert a.prefill_tokens_per_s(300) == fast.prefill_tokens_per_s(300)
    assert 300 in b._prefill_rate and 300 not in c._prefill_rate
    assert b.decode_step_seconds(7) == fast.decode_step_seconds(7)
    assert 7 in a._decode_s and 7 not in c._decode_s
    with pytest.raises(ValueError, match="calibration"):
        c.share_curves(a)
