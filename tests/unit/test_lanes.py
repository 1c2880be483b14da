"""Lane policy: batch admission K, the deadline-driven window, the finish estimate."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest
from hypothesis import given
from hypothesis import strategies as st

from warmloop.activities.admission import BatchAdmission
from warmloop.workflows.lanes import (
    AdmissionConfig,
    adapt_window,
    estimate_finish_s,
    kv_fit_limit,
    next_batch_limit,
)

CFG = AdmissionConfig(interactive_ttft_target_ms=1000, k_min=1, k_max=16, k_start=4, window=4)


def test_k_halves_over_target_grows_when_comfortable_or_idle() -> None:
    assert next_batch_limit(8, 1500, CFG) == 4
    assert next_batch_limit(1, 5000, CFG) == 1
    assert next_batch_limit(4, 300, CFG) == 5
    assert next_batch_limit(4, 800, CFG) == 4  # between 0.6x and 1x target: hold
    assert next_batch_limit(16, None, CFG) == 16
    assert next_batch_limit(3, None, CFG) == 4


@given(k=st.integers(1, 16), a=st.floats(0, 5000), b=st.floats(0, 5000))
def test_k_never_grows_with_worse_latency(k: int, a: float, b: float) -> None:
    lo, hi = sorted((a, b))
    assert next_batch_limit(k, hi, CFG) <= next_batch_limit(k, lo, CFG)


def test_window_widens_to_meet_the_deadline_and_narrows_when_ahead() -> None:
    # 100 records left at 2 s each with window 4: 200 s of work, 50 s left -> 16 wide
    assert adapt_window(4, base=4, max_window=32, remaining=100, seconds_per_record=2.0,
                        seconds_left=50) == 16
    assert adapt_window(4, base=4, max_window=8, remaining=100, seconds_per_record=2.0,
                        seconds_left=50) == 8  # capped by the fleet's batch capacity
    assert adapt_window(16, base=4, max_window=32, remaining=10, seconds_per_record=1.0,
                        seconds_left=1000) == 15
    assert adapt_window(4, base=4, max_window=32, remaining=10, seconds_per_record=1.0,
                        seconds_left=1000) == 4
    assert adapt_window(4, base=4, max_window=32, remaining=10, seconds_per_record=None,
                        seconds_left=10) == 4
    assert adapt_window(4, base=4, max_window=32, remaining=10, seconds_per_record=1.0,
                        seconds_left=-5) == 32  # late: everything the fleet allows


def test_finish_estimate_follows_the_pace_so_far() -> None:
    assert estimate_finish_s(done=10, remaining=30, elapsed_s=20) == 60
    assert estimate_finish_s(done=0, remaining=30, elapsed_s=20) is None


class Clock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


async def test_admission_caps_batch_steps_and_adapts_to_interactive_ttft() -> None:
    clock = Clock()
    adm = BatchAdmission(CFG, clock=clock)
    assert adm.limit == 4
    for _ in range(4):
        await adm.acquire()
    blocked = asyncio.ensure_future(adm.acquire())
    await asyncio.sleep(0.01)
    assert not blocked.done() and adm.waiting == 1
    await adm.release()
    await asyncio.wait_for(blocked, 1)
    assert adm.active == 4
    # slow interactive steps halve K at once
    await adm.observe_interactive(2500)
    assert adm.limit == 2
    # fast ones grow it back, one step per full window, not faster than once a second
    for _ in range(4):
        await adm.observe_interactive(100)
    assert adm.limit == 2
    clock.t += 2
    await adm.observe_interactive(100)
    assert adm.limit == 3
    # with no interactive traffic, K creeps up by itself
    clock.t += 100
    for _ in range(4):
        await adm.release()
    assert adm.limit == 4


async def test_steps_of_jobs_under_way_go_before_new_jobs_oldest_first() -> None:
    clock = Clock()
    adm = BatchAdmission(CFG.model_copy(update={"k_start": 2}), clock=clock)
    await adm.acquire("first")
    clock.t += 1
    await adm.acquire("second")
    order: list[str] = []

    async def step(job: str) -> None:
        await adm.acquire(job)
        order.append(job)

    waiting = [asyncio.ensure_future(step(j)) for j in ("new-1", "new-2")]
    await asyncio.sleep(0)
    # their next steps arrive after the new jobs' first steps, in the other order
    waiting += [asyncio.ensure_future(step(j)) for j in ("second", "first")]
    await asyncio.sleep(0.01)
    assert adm.waiting == 4 and not order
    for _ in range(4):
        await adm.release()
        await asyncio.sleep(0.01)
    await asyncio.gather(*waiting)
    # continuing jobs first (oldest admission first), then new jobs in arrival order
    assert order == ["first", "second", "new-1", "new-2"]


async def test_a_cancelled_waiter_gives_up_its_place() -> None:
    adm = BatchAdmission(CFG.model_copy(update={"k_start": 1}), clock=Clock())
    await adm.acquire("a")
    gone = asyncio.ensure_future(adm.acquire("b"))
    then = asyncio.ensure_future(adm.acquire("c"))
    await asyncio.sleep(0.01)
    gone.cancel()
    await asyncio.sleep(0.01)
    await adm.release()
    await asyncio.wait_for(then, 1)
    assert adm.active == 1 and adm.waiting == 0


def test_k_is_held_to_the_jobs_that_fit_in_the_kv_pool() -> None:
    cfg = CFG.model_copy(update={"kv_share": 0.8})
    # counted in tokens: 10,000-token pool, 1,000 shared tokens, 1,000 of each job's own
    assert kv_fit_limit(10_000, [(2_000, 1_000)] * 3, cfg, block_tokens=1) == 7
    assert kv_fit_limit(0, [(2_000, 1_000)], cfg, block_tokens=16) == 0  # pool unknown
    assert kv_fit_limit(10_000, [], cfg, block_tokens=16) == 0
    assert kv_fit_limit(1_000, [(9_000, 0)], cfg, block_tokens=16) == 1  # never below one
    adm = BatchAdmission(CFG.model_copy(update={"k_start": 16}), clock=Clock(),
                         kv_pool=lambda: SimpleNamespace(kv_capacity_tokens=10_000,
                                                         block_size=1))
    assert adm.effective_limit == 16
    adm.observe_batch(2_000, 1_000)
    assert adm.effective_limit == 7
    with pytest.raises(ValueError, match="block_tokens"):
        kv_fit_limit(10_000, [(2_000, 1_000)], cfg, block_tokens=0)


def test_the_kv_fit_counts_whole_blocks() -> None:
    """A job's own part takes whole blocks: 60 own tokens beside a 1,000-token shared
    prefix on 128-token blocks take the block the prefix ends in (its last 104 tokens
    are not a full, shared block) and the next one. In tokens, 2x as many fit."""
    cfg = CFG.model_copy(update={"kv_share": 0.5})
    pool = 128 * 1_000  # 1,000 blocks
    # 7 full shared blocks (896 tokens); the prompt's 1,060 tokens end in block 9
    blocks = kv_fit_limit(pool, [(1_060, 1_000)], cfg, block_tokens=128)
    assert blocks == int((500 - 7) // 2) == 246
    tokens = kv_fit_limit(pool, [(1_060, 1_000)], cfg, block_tokens=1)
    assert tokens == int((64_000 - 1_000) // 60) == 1_050
    # aligned to blocks, the two counts agree
    assert kv_fit_limit(pool, [(1_024 + 256, 1_024)], cfg, block_tokens=128) == \
        kv_fit_limit(pool, [(1_024 + 256, 1_024)], cfg, block_tokens=1) == 246
    adm = BatchAdmission(cfg, clock=Clock(), kv_pool=lambda: SimpleNamespace(
        kv_capacity_tokens=pool, block_size=128))
    adm.observe_batch(1_060, 1_000)
    assert adm.kv_fit == blocks


@given(cap=st.integers(1_000, 1_000_000), own=st.integers(1, 5_000), more=st.integers(0, 5_000),
       block=st.sampled_from([1, 16, 128]))
def test_bigger_jobs_never_fit_more(cap: int, own: int, more: int, block: int) -> None:
    assert kv_fit_limit(cap, [(own + more + 500, 500)], CFG, block_tokens=block) <= \
        kv_fit_limit(cap, [(own + 500, 500)], CFG, block_tokens=block)


async def test_a_neighbour_over_target_holds_k_down_here() -> None:
    clock = Clock()
    adm = BatchAdmission(CFG.model_copy(update={"k_start": 8, "fleet_signal": True}),
                         clock=clock)
    clock.t += 10
    adm.observe_fleet([2500.0, 300.0])  # one engine on this host is slow
    assert adm.limit == 4
    adm.observe_fleet([2500.0])  # at most once per idle_grow_s
    assert adm.limit == 4
    clock.t += 100  # no interactive step here for long: but the neighbour is still slow
    await adm.acquire("a")
    await adm.release()
    assert adm.limit == 4
    adm.observe_fleet([])  # the neighbour went quiet: the lane is idle, K grows
    clock.t += 10
    await adm.acquire("a")
    await adm.release()
    assert adm.limit == 5
    # this engine's own interactive steps are fast, but growth waits for the neighbours
    adm.observe_fleet([700.0])
    for _ in range(4):
        clock.t += 2
        await adm.observe_interactive(100)
    assert adm.limit == 5
    alone = BatchAdmission(CFG.model_copy(update={"k_start": 8, "fleet_signal": False}),
                           clock=clock)
    clock.t += 10
    alone.observe_fleet([2500.0])
    assert alone.limit == 8


def test_an_engine_publishes_no_p95_once_its_interactive_traffic_stops() -> None:
    clock = Clock()
    adm = BatchAdmission(CFG, clock=clock)
    asyncio.run(adm.observe_interactive(400))
    assert adm.recent_interactive_p95_ms() == 400
    clock.t += CFG.idle_grow_s + 1
    assert adm.recent_interactive_p95_ms() is None


async def test_with_k_min_zero_the_lane_yields_the_engine_and_comes_back() -> None:
    clock = Clock()
    adm = BatchAdmission(CFG.model_copy(update={"k_min": 0, "k_start": 1}), clock=clock)
    await adm.observe_interactive(2500)  # over target at K = 1: the lane stops here
    assert adm.limit == 0
    blocked = asyncio.ensure_future(adm.acquire("job"))
    await asyncio.sleep(0.01)
    assert not blocked.done() and adm.waiting == 1
    # a full window of fast interactive steps with no batch running brings K back
    clock.t += 2
    for _ in range(CFG.window):
        await adm.observe_interactive(100)
    assert adm.limit == 1
    await asyncio.wait_for(blocked, 1)
    assert adm.active == 1


async def test_a_stopped_lane_tries_again_after_a_pause() -> None:
    clock = Clock()
    adm = BatchAdmission(CFG.model_copy(update={"k_min": 0, "k_start": 1}), clock=clock)
    await adm.observe_interactive(2500)
    assert adm.limit == 0
    blocked = asyncio.ensure_future(adm.acquire("job"))
    # interactive steps stay between 0.6x and 1x target: never "well under" it
    for _ in range(CFG.window):
        await adm.observe_interactive(800)
    assert adm.limit == 0
    clock.t += CFG.idle_grow_s + 1
    await asyncio.wait_for(blocked, 3)  # the waiter's next 1 s tick retries K = 1
    assert adm.limit == 1 and adm.active == 1
