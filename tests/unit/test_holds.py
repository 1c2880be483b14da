"""Pause statistics (pure parts) and the engine-side hold table, with the engine and
Redis stubbed (the real ones are in tests/integration/test_holds.py)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest

from warmloop.activities.holds import HoldManager, pause_kind, without_touches
from warmloop.activities.pauses import bucket_mid, bucket_of, points, prior_for
from warmloop.activities.registry import EngineHeartbeat
from warmloop.workflows.holding import HoldAction, HoldConfig, PauseDistribution, TtlCacheEndpoint
from warmloop.workflows.profiles import get_profile


def test_histogram_buckets_bracket_their_durations() -> None:
    for s in (0.2, 3.0, 45.0, 1800.0):
        mid = bucket_mid(bucket_of(s))
        assert 0.7 * s < mid < 1.45 * s
    assert bucket_of(0.0) == 0 and bucket_of(10**9) == 47
    pts = points({bucket_of(3.0): 300, bucket_of(40.0): 100})
    assert len(pts) == 200 and pts.count(bucket_mid(bucket_of(3.0))) == 150


def test_what_a_call_pauses_on() -> None:
    triage = get_profile("ticket-triage")
    assert pause_kind(triage, "search_kb", '{"topic": "crash"}') == "tool:search_kb"
    assert pause_kind(triage, "set_priority", '{"priority": "urgent"}') == \
        "approval:urgent_priority"
    assert pause_kind(triage, "finish", '{"resolution": "resolved", "priority": "low"}') is None
    assert pause_kind(triage, "search_kb", "not json") is None
    assert prior_for(triage, "approval:urgent_priority") == (1200.0, 3600.0)
    assert prior_for(triage, "tool:search_kb") == (1.0, 5.0)


class StubRedis:
    def __init__(self) -> None:
        self.hashes: dict[str, dict[str, Any]] = {}

    def pipeline(self, transaction: bool = False) -> StubRedis:
        return self

    async def execute(self) -> list[Any]:
        return []

    def _h(self, key: str) -> dict[str, Any]:
        return self.hashes.setdefault(key, {})

    def hincrby(self, key: str, field: str, n: int) -> Any:
        self._h(key)[field] = self._h(key).get(field, 0) + n
        return _done()

    def delete(self, key: str) -> Any:
        self.hashes.pop(key, None)
        return _done()

    def hset(self, key: str, mapping: dict[str, str]) -> Any:
        self._h(key).update(mapping)
        return _done()


class _done:
    """Awaitable no-op: lets the stub's commands be awaited or queued on a 'pipeline'."""

    def __await__(self) -> Any:
        if False:
            yield
        return None


class StubPauses:
    def __init__(self, median: float, p90: float) -> None:
        self.dist = PauseDistribution(prior_median_s=median, prior_p90_s=p90)

    async def distribution(self, profile: Any, kind: str) -> PauseDistribution:
        return self.dist


class Clock:
    t = 1000.0

    def __call__(self) -> float:
        return self.t


def manager(pauses: StubPauses, touches: list[dict[str, Any]], *, kv_usage: float = 0.3,
            capacity: int = 16384, config: HoldConfig | None = None
            ) -> tuple[HoldManager, StubRedis, Clock]:
    def engine(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        touches.append(body)
        n = len(body["prompt"])
        return httpx.Response(200, json={"usage": {"prompt_tokens": n, "prompt_tokens_details":
                                                   {"cached_tokens": n - n % 128}}})

    hb = EngineHeartbeat(engine_id="e0", task_queue="engine.e0", model="tiny", url="u",
                         healthy=True, at=0, kv_usage=kv_usage, kv_capacity_tokens=capacity,
                         block_size=128)
    redis, clock = StubRedis(), Clock()
    m = HoldManager(engine_id="e0", base_url="http://engine", model="tiny",
                    http=httpx.AsyncClient(transport=httpx.MockTransport(engine)),
                    redis=redis, pauses=pauses, engine_info=lambda: hb,  # type: ignore[arg-type]
                    config=config or HoldConfig(), clock=clock)
    return m, redis, clock


async def test_short_tool_pause_is_held_and_touched_until_resume() -> None:
    touches: list[dict[str, Any]] = []
    m, redis, clock = manager(StubPauses(2.0, 6.0), touches)
    m.observe_engine(0.0)
    clock.t += 1
    m.observe_engine(20_000.0)  # other traffic computes ~6k tokens a second: touch often
    triage = get_profile("ticket-triage")
    choice = await m.after_step(job_id="j1", profile=triage, kind="tool:search_kb",
                                prefix_tokens=list(range(2048)), policy="cost_model",
                                interactive=True)
    assert choice is not None and choice.action == HoldAction.HOLD and choice.ttl_s > 2
    assert m.held_tokens == 2048 and "j1" in redis.hashes["warmloop:holds:e0"]
    # held a little past the chosen TTL: a pause in its histogram bucket may run longer
    assert m.holds["j1"].until == clock.t + choice.ttl_s * HoldConfig().ttl_slack
    await m.tick()
    assert touches == []  # the step just used the prefix: nothing to refresh yet
    clock.t = m.holds["j1"].next_touch
    await m.tick()
    assert len(touches) == 1 and touches[0]["max_tokens"] == 1
    assert touches[0]["prompt"] == list(range(2048))
    assert redis.hashes["warmloop:holds:stats:e0"]["touch_computed_tokens"] == 1
    await m.tick()  # not due yet: no second touch
    assert len(touches) == 1
    m.resume("j1")
    assert m.held_tokens == 0  # at once; the bookkeeping follows on the next tick
    await m.tick()
    assert "warmloop:holds:e0" not in redis.hashes
    assert redis.hashes["warmloop:holds:stats:e0"]["released_on_resume"] == 1


async def test_a_touch_in_flight_is_counted_until_it_ends_however_it_ends() -> None:
    m, _, clock = manager(StubPauses(2.0, 6.0), [])
    during: list[int] = []

    def engine(request: httpx.Request) -> httpx.Response:
        during.append(m.touching)
        n = len(json.loads(request.content)["prompt"])
        return httpx.Response(200, json={"usage": {"prompt_tokens": n,
                                                   "prompt_tokens_details": {"cached_tokens": n}}})

    def gone(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("engine gone", request=request)

    m._http = httpx.AsyncClient(transport=httpx.MockTransport(engine))
    await m.after_step(job_id="j1", profile=get_profile("ticket-triage"), kind="tool:search_kb",
                       prefix_tokens=list(range(2048)), policy="always_hold", interactive=True)
    clock.t = m.holds["j1"].next_touch
    await m.tick()
    assert during == [1] and m.touching == 0
    m._http = httpx.AsyncClient(transport=httpx.MockTransport(gone))
    clock.t = m.holds["j1"].next_touch
    with pytest.raises(httpx.ConnectError):
        await m.tick()
    assert m.touching == 0
    # what the heartbeat publishes: the engine's requests less the holder's touches
    assert without_touches(2, 0, 1) == (1, 0)
    assert without_touches(0, 3, 1) == (0, 2)  # waiting behind a busy engine's steps
    assert without_touches(1, 1, 3) == (0, 0)  # never below nothing


async def test_an_approval_that_takes_an_hour_is_released() -> None:
    m, _, _ = manager(StubPauses(1200.0, 3600.0), [])
    choice = await m.after_step(job_id="j1", profile=get_profile("ticket-triage"),
                                kind="approval:urgent_priority", prefix_tokens=[1] * 2048,
                                policy="cost_model", interactive=True)
    assert choice is not None and choice.action == HoldAction.RELEASE
    assert m.held_tokens == 0


async def test_baselines_and_ttl_and_the_cap() -> None:
    m, redis, clock = manager(StubPauses(1200.0, 3600.0), [], capacity=10_000)
    triage = get_profile("ticket-triage")
    assert await m.after_step(job_id="j0", profile=triage, kind="tool:search_kb",
                              prefix_tokens=[1] * 100, policy="never", interactive=True) is None
    for i in range(3):  # always_hold ignores the cost; the 30% cap keeps the newest
        clock.t += 1
        await m.after_step(job_id=f"j{i}", profile=triage, kind="approval:urgent_priority",
                           prefix_tokens=[1] * 1400, policy="always_hold", interactive=True)
    assert sorted(m.holds) == ["j1", "j2"] and m.held_tokens == 2800
    assert redis.hashes["warmloop:holds:stats:e0"]["released_for_room"] == 1
    clock.t += HoldConfig().always_hold_ttl_s + 1
    await m.tick()
    assert not m.holds
    assert redis.hashes["warmloop:holds:stats:e0"]["released_on_ttl"] == 2


async def test_cut_for_room_cuts_the_oldest_short_before_letting_it_go() -> None:
    m, redis, clock = manager(StubPauses(1200.0, 3600.0), [], capacity=10_000,
                              config=HoldConfig(cut_for_room=True))
    triage = get_profile("ticket-triage")
    assert await m.after_step(job_id="j0", profile=triage, kind="tool:search_kb",
                              prefix_tokens=[1] * 100, policy="never", interactive=True) is None
    for i in range(3):  # always_hold ignores the cost; the 30% cap cuts the oldest short
        clock.t += 1
        await m.after_step(job_id=f"j{i}", profile=triage, kind="approval:urgent_priority",
                           prefix_tokens=[1] * 1400, policy="always_hold", interactive=True)
    # 4,200 held against a cap of 3,000: j0 keeps its first 12 blocks (16 tokens each)
    # and the token after them, giving up 1,207
    assert sorted(m.holds) == ["j0", "j1", "j2"] and len(m.holds["j0"].tokens) == 193
    assert m.held_tokens == 2993
    stats = redis.hashes["warmloop:holds:stats:e0"]
    assert stats["trimmed_for_room"] == 1 and "released_for_room" not in stats
    clock.t += 1  # a fourth: j0 cannot give 1,393 and goes; j1 gives the rest
    await m.after_step(job_id="j3", profile=triage, kind="approval:urgent_priority",
                       prefix_tokens=[1] * 1400, policy="always_hold", interactive=True)
    assert sorted(m.holds) == ["j1", "j2", "j3"] and m.held_tokens <= 3000
    assert stats["released_for_room"] == 1 and stats["trimmed_for_room"] == 2
    clock.t += HoldConfig().always_hold_ttl_s + 1
    await m.tick()
    assert not m.holds
    assert stats["released_on_ttl"] == 3


async def test_one_prompt_over_the_cap_is_held_cut_to_the_blocks_that_fit() -> None:
    """A session's 3,000-token prompt on an 8,192-token pool at 30 % (2,457): held
    whole it could never be; with ``cut_for_room`` its first 153 blocks are
    (bench-gateway released 340 of 356 such holds at once)."""
    plain, plain_redis, _ = manager(StubPauses(2.0, 6.0), [], capacity=8192)
    await plain.after_step(job_id="s1", profile=get_profile("ticket-triage"),
                           kind="tool:search_kb", prefix_tokens=list(range(3001)),
                           policy="always_hold", interactive=True,
                           block_hashes=[f"b{k}" for k in range(187)])
    assert not plain.holds  # by default: let go whole
    assert plain_redis.hashes["warmloop:holds:stats:e0"]["released_for_room"] == 1
    touches: list[dict[str, Any]] = []
    m, redis, clock = manager(StubPauses(2.0, 6.0), touches, capacity=8192,
                              config=HoldConfig(cut_for_room=True))
    await m.after_step(job_id="s1", profile=get_profile("ticket-triage"),
                       kind="tool:search_kb", prefix_tokens=list(range(3001)),
                       policy="always_hold", interactive=True,
                       block_hashes=[f"b{k}" for k in range(187)])
    h = m.holds["s1"]
    assert len(h.hashes or []) == 153 and h.tokens == list(range(153 * 16 + 1))
    assert m.held_tokens == 153 * 16 + 1 <= 0.3 * 8192
    assert redis.hashes["warmloop:holds:stats:e0"]["trimmed_for_room"] == 1
    clock.t = h.next_touch
    await m.tick()
    assert touches[-1]["prompt"] == list(range(153 * 16 + 1))  # touches what it kept


async def hold_sharing(m: HoldManager, job: str, shared: list[str]) -> None:
    """Hold ``job``'s 14-block (128-token) prompt: the profile's ``shared`` blocks, then
    four of its own."""
    await m.after_step(job_id=job, profile=get_profile("ticket-triage"),
                       kind="tool:search_kb", prefix_tokens=list(range(14 * 128 + 1)),
                       policy="always_hold", interactive=True, block_size=128,
                       block_hashes=shared + [f"{job}-{k}" for k in range(4)])


async def test_holds_sharing_a_profiles_prompt_count_it_once_under_the_cap() -> None:
    """The cap bounds the KV the holds keep: three jobs of one profile share its
    1,280-token system prompt and each keeps 512 tokens of its own, 2,816 + 3 tokens in
    all, not 3 x 1,793 (which a 3,000-token cap would have cut to one hold)."""
    m, redis, clock = manager(StubPauses(2.0, 6.0), [], capacity=10_000)
    shared = [f"s{i}" for i in range(10)]
    for i in range(3):
        clock.t += 1
        await hold_sharing(m, f"j{i}", shared)
    assert sorted(m.holds) == ["j0", "j1", "j2"]
    assert m.held_tokens == (10 + 3 * 4) * 128 + 3
    assert "released_for_room" not in redis.hashes["warmloop:holds:stats:e0"]
    clock.t += 1  # a fourth job's blocks of its own take the union past 30 %
    await hold_sharing(m, "j3", shared)
    assert sorted(m.holds) == ["j1", "j2", "j3"]  # the oldest went
    assert m.held_tokens == (10 + 3 * 4) * 128 + 3
    assert redis.hashes["warmloop:holds:stats:e0"]["released_for_room"] == 1


async def test_a_hold_cut_for_room_gives_up_its_own_blocks_not_the_shared_prompt() -> None:
    m, redis, clock = manager(StubPauses(2.0, 6.0), [], capacity=10_000,
                              config=HoldConfig(cut_for_room=True))
    shared = [f"s{i}" for i in range(10)]
    for i in range(4):
        clock.t += 1
        await hold_sharing(m, f"j{i}", shared)
    # 26 blocks and 4 tokens against 3,000: the oldest gives up three blocks of its own
    assert sorted(m.holds) == ["j0", "j1", "j2", "j3"]
    assert m.holds["j0"].hashes == shared + ["j0-0"]
    assert m.held_tokens == (10 + 1 + 3 * 4) * 128 + 4
    assert redis.hashes["warmloop:holds:stats:e0"]["trimmed_for_room"] == 1


async def test_a_hold_made_on_a_quiet_engine_is_touched_when_a_burst_starts() -> None:
    """Made with no churn seen, a hold's first touch is 30 s away; other traffic that
    then turns the pool over in seconds must bring it forward (bench-pauses lost the
    first job's held prompt this way, 12 s after its step, in two repeats of three)."""
    touches: list[dict[str, Any]] = []
    m, _, clock = manager(StubPauses(20.0, 30.0), touches, kv_usage=0.2)
    m.observe_engine(0.0)
    triage = get_profile("ticket-triage")
    await m.after_step(job_id="j1", profile=triage, kind="tool:search_kb",
                       prefix_tokens=list(range(2048)), policy="always_hold", interactive=True)
    assert m.holds["j1"].next_touch == clock.t + HoldConfig().max_touch_interval_s
    clock.t += 1
    m.observe_engine(8_000.0)  # a burst: 8k tokens a second on a 16k-token pool
    clock.t += 1
    m.observe_engine(16_000.0)
    await m.tick()
    assert len(touches) == 1  # due one current interval after the step, not 30 s
    assert m.holds["j1"].next_touch - clock.t <= m.touch_interval_s() < 2
    # the last probe's churn counts where the smoothed one still lags
    assert m.touch_interval_s() == pytest.approx(
        0.5 * (16384 * 0.8 - m.held_tokens) / 8_000)


def test_touch_interval_follows_the_engines_churn() -> None:
    m, _, clock = manager(StubPauses(2, 6), [], kv_usage=0.5, capacity=16384)
    assert m.touch_interval_s() == HoldConfig().max_touch_interval_s  # no churn seen yet
    m.observe_engine(0.0)
    clock.t += 1
    m.observe_engine(10_000.0)  # 10k computed tokens a second: ~3k/s after smoothing
    fast = m.touch_interval_s()
    assert HoldConfig().min_touch_interval_s <= fast < 5
    m.observe_engine(10_000.0, now=clock.t + 10)  # quiet for 10 s
    assert m.touch_interval_s() > fast


async def test_a_ttl_cache_endpoint_is_kept_by_pings_just_before_expiry() -> None:
    pings: list[dict[str, Any]] = []

    def api(request: httpx.Request) -> httpx.Response:
        pings.append({"url": str(request.url), **json.loads(request.content)})
        return httpx.Response(200, json={"usage": {"prompt_tokens": 2048,
                                                   "prompt_tokens_details":
                                                   {"cached_tokens": 2048}}})

    clock = Clock()
    m = HoldManager(engine_id="api", base_url="https://api.example", model="m",
                    http=httpx.AsyncClient(transport=httpx.MockTransport(api)),
                    redis=StubRedis(), pauses=StubPauses(400.0, 900.0),  # type: ignore[arg-type]
                    engine_info=lambda: None, clock=clock,
                    ttl_cache=TtlCacheEndpoint(cache_ttl_s=300, margin_s=5))
    body = {"model": "m", "messages": [{"role": "user", "content": "x"}], "stream": True,
            "stream_options": {"include_usage": True}, "max_tokens": 64}
    choice = await m.after_step(job_id="j", profile=get_profile("ticket-triage"),
                                kind="approval:urgent_priority", prefix_tokens=[1] * 2048,
                                policy="cost_model", interactive=True, body=body)
    # pinging at the cached price is far cheaper than paying the prefix uncached again
    assert choice is not None and choice.action == HoldAction.HOLD
    hold = m.holds["j"]
    assert hold.pings is not None and hold.pings[0] == clock.t + 295
    assert hold.pings == [clock.t + 295 * k for k in range(1, len(hold.pings) + 1)]
    await m.tick()
    assert pings == []  # the step itself just refreshed the cache
    clock.t += 296
    await m.tick()
    assert len(pings) == 1 and pings[0]["url"].endswith("/v1/chat/completions")
    assert pings[0]["max_tokens"] == 1 and pings[0]["stream"] is False
    assert "stream_options" not in pings[0] and pings[0]["messages"] == body["messages"]
    await m.tick()
    assert len(pings) == 1  # next one before the next expiry


class StubDirectory:
    """The prefix directory's view of the engine: how many leading held blocks remain,
    and where each job was last served."""

    def __init__(self, kept: int, jobs: dict[str, tuple[str, int | None]] | None = None
                 ) -> None:
        self.kept = kept
        self.jobs = jobs or {}

    async def matched_blocks(self, chain: list[str], engine_ids: list[str]) -> dict[str, int]:
        return {e: min(self.kept, len(chain)) for e in engine_ids}

    async def job_engines(self, job_ids: list[str]) -> dict[str, tuple[str, int | None]]:
        return {j: self.jobs[j] for j in job_ids if j in self.jobs}


async def test_a_hold_whose_job_went_on_elsewhere_is_dropped_at_its_touch() -> None:
    """Only the engine a job's next step (or prewarm) reaches resumes its hold: the
    engine it left learns from the prefix directory at the hold's next touch and drops
    it untouched. A record of an earlier step elsewhere, or of this engine, keeps it."""
    touches: list[dict[str, Any]] = []
    m, redis, clock = manager(StubPauses(2.0, 6.0), touches)
    directory = StubDirectory(kept=99, jobs={"moved": ("e1", 3), "stale": ("e1", 1),
                                             "here": ("e0", 2)})
    m._directory = directory  # type: ignore[assignment]
    triage = get_profile("ticket-triage")
    for job in ("moved", "stale", "here", "unknown"):
        await m.after_step(job_id=job, profile=triage, kind="tool:search_kb",
                           prefix_tokens=list(range(4 * 128 + 1)), policy="always_hold",
                           interactive=True, block_size=128, step=2,
                           block_hashes=[f"{job}-{k}" for k in range(4)])
    clock.t = max(h.next_touch for h in m.holds.values())
    await m.tick()
    assert sorted(m.holds) == ["here", "stale", "unknown"]
    assert len(touches) == 3  # the moved job's prompt was not touched
    assert redis.hashes["warmloop:holds:stats:e0"]["released_moved"] == 1
    directory.jobs["here"] = ("e1", 2)  # a step retried elsewhere (failover): gone too
    clock.t = max(h.next_touch for h in m.holds.values())
    await m.tick()
    assert sorted(m.holds) == ["stale", "unknown"]


async def test_a_touch_never_recomputes_blocks_the_engine_lost() -> None:
    touches: list[dict[str, Any]] = []
    m, redis, clock = manager(StubPauses(2.0, 6.0), touches)
    info = m._info()
    assert info is not None
    info.precise = True  # the engine publishes KV events: the directory is exact
    directory = StubDirectory(kept=16)
    m._directory = directory  # type: ignore[assignment]
    triage = get_profile("ticket-triage")
    await m.after_step(job_id="j1", profile=triage, kind="tool:search_kb",
                       prefix_tokens=list(range(16 * 128 + 1)), policy="always_hold",
                       interactive=True, block_hashes=[f"b{i}" for i in range(16)],
                       block_size=128)
    clock.t = m.holds["j1"].next_touch
    await m.tick()
    assert len(touches[-1]["prompt"]) == 16 * 128 + 1  # all cached: touch the whole hold
    directory.kept = 10  # other traffic evicted the last six blocks
    clock.t = m.holds["j1"].next_touch
    await m.tick()
    assert touches[-1]["prompt"] == list(range(10 * 128 + 1))
    assert m.held_tokens == 10 * 128 + 1
    assert redis.hashes["warmloop:holds:stats:e0"]["shrunk"] == 1
    directory.kept = 0  # all gone: the hold is lost, and no touch re-prefills it
    clock.t = m.holds["j1"].next_touch
    await m.tick()
    assert len(touches) == 2 and not m.holds
    assert redis.hashes["warmloop:holds:stats:e0"]["released_lost"] == 1


async def test_a_job_resumed_while_the_ttl_sweep_awaits_is_not_released_twice() -> None:
    m, redis, clock = manager(StubPauses(1200.0, 3600.0), [], capacity=100_000)
    triage = get_profile("ticket-triage")
    for job in ("j1", "j2"):
        await m.after_step(job_id=job, profile=triage, kind="approval:urgent_priority",
                           prefix_tokens=[1] * 256, policy="always_hold", interactive=True)
    clock.t += HoldConfig().always_hold_ttl_s + 1
    count = m._count

    async def count_then_resume_j2(**increments: int) -> None:
        await count(**increments)
        m.resume("j2")  # j2's next step arrives while j1's release is recorded

    m._count = count_then_resume_j2  # type: ignore[method-assign]
    await m.tick()  # raised KeyError('j2') and stopped the worker's hold loop before
    assert not m.holds
    stats = redis.hashes["warmloop:holds:stats:e0"]
    assert stats["released_on_ttl"] == 1 and stats["released_on_resume"] == 1


async def test_a_hold_whose_job_ended_is_dropped_when_it_next_asks() -> None:
    """A job that ends after a pausing step (a budget, a cancel, an expired approval)
    sends no step to resume its hold: each hold asks whether its job still runs every
    ``job_check_s`` (all due holds in one call), and one whose job ended is dropped.
    An answer that fails keeps every hold; ``job_check_s=0`` never asks."""
    m, redis, clock = manager(StubPauses(1200.0, 3600.0), [], capacity=100_000,
                              config=HoldConfig(job_check_s=5.0))
    ended: set[str] = set()
    asked: list[list[str]] = []
    failing = [False]

    async def over(job_ids: list[str]) -> set[str]:
        asked.append(job_ids)
        if failing[0]:
            raise RuntimeError("Temporal is away")
        return ended & set(job_ids)

    m._jobs_over = over

    async def tick() -> None:  # and the question it asked in the background
        await m.tick()
        if m._asking is not None:
            await m._asking

    triage = get_profile("ticket-triage")
    for job in ("b", "a"):
        await m.after_step(job_id=job, profile=triage, kind="approval:urgent_priority",
                           prefix_tokens=[1] * 256, policy="always_hold", interactive=True)
    await tick()
    assert asked == []  # just made: nothing to ask yet
    clock.t += 5
    ended.add("a")
    failing[0] = True
    await tick()
    assert asked == [["a", "b"]] and sorted(m.holds) == ["a", "b"]  # no answer: kept
    failing[0] = False
    clock.t += 1
    await tick()
    assert len(asked) == 1  # each hold asks at most every job_check_s
    clock.t += 4
    await tick()
    assert asked[-1] == ["a", "b"] and sorted(m.holds) == ["b"]
    stats = redis.hashes["warmloop:holds:stats:e0"]
    assert stats["released_job_over"] == 1 and "released_on_ttl" not in stats

    quiet, _, clock2 = manager(StubPauses(1200.0, 3600.0), [], capacity=100_000,
                               config=HoldConfig(job_check_s=0))
    quiet._jobs_over = over
    await quiet.after_step(job_id="a", profile=triage, kind="approval:urgent_priority",
                           prefix_tokens=[1] * 256, policy="always_hold", interactive=True)
    clock2.t += 60
    await quiet.tick()
    assert len(asked) == 2 and "a" in quiet.holds


async def test_a_slow_answer_on_ended_jobs_holds_back_no_touch() -> None:
    """The question runs beside the ticks: while Temporal takes its time, holds are
    still touched and no second question is asked."""
    touches: list[dict[str, Any]] = []
    m, _, clock = manager(StubPauses(2.0, 6.0), touches, config=HoldConfig(job_check_s=1.0))
    answer = asyncio.Event()
    asked: list[list[str]] = []

    async def slow(job_ids: list[str]) -> set[str]:
        asked.append(job_ids)
        await answer.wait()
        return set(job_ids)

    m._jobs_over = slow
    await m.after_step(job_id="j1", profile=get_profile("ticket-triage"),
                       kind="tool:search_kb", prefix_tokens=list(range(2048)),
                       policy="always_hold", interactive=True)
    clock.t = max(m.holds["j1"].next_touch, clock.t + 1.0)
    await m.tick()
    assert asked == [["j1"]] and len(touches) == 1  # touched while the question waits
    clock.t = m.holds["j1"].next_touch + 1.0
    await m.tick()
    assert asked == [["j1"]] and len(touches) == 2  # one question at a time
    answer.set()
    assert m._asking is not None
    await m._asking
    assert not m.holds


class FlakyRedis(StubRedis):
    """StubRedis that can be away: its pipelines fail as a dropped connection does."""

    down = False

    async def execute(self) -> list[Any]:
        if self.down:
            from redis.exceptions import ConnectionError as RedisConnectionError
            raise RedisConnectionError("Connection refused")
        return []

    def hincrby(self, key: str, field: str, n: int) -> Any:
        if self.down:  # queued on a pipeline that will fail: not applied
            return _done()
        return super().hincrby(key, field, n)


async def test_statistics_counted_while_redis_was_away_are_written_when_it_is_back() -> None:
    from warmloop.activities.registry import RedisOutage

    touches: list[dict[str, Any]] = []
    m, _, clock = manager(StubPauses(2.0, 6.0), touches)
    redis = FlakyRedis()
    m._redis = redis  # type: ignore[assignment]
    m._outage = RedisOutage(clock=clock)
    triage = get_profile("ticket-triage")
    redis.down = True
    await m.after_step(job_id="j1", profile=triage, kind="tool:search_kb",
                       prefix_tokens=list(range(2048)), policy="always_hold", interactive=True)
    clock.t = m.holds["j1"].next_touch
    await m.tick()  # touched while Redis is away: counted in memory
    assert len(touches) == 1 and "warmloop:holds:stats:e0" not in redis.hashes
    redis.down = False
    clock.t += 60  # the next probe is due (and the next touch)
    await m.tick()
    stats = redis.hashes["warmloop:holds:stats:e0"]
    assert stats["holds"] == 1 and stats["touches"] == len(touches) == 2


class _Described:
    def __init__(self, status: Any) -> None:
        self.status = status


class _FakeTemporal:
    """A client whose describes answer after ``delay_s`` with each job's status (or raise
    ``errors[job]``), counting how many are in flight at once."""

    def __init__(self, statuses: dict[str, Any], *, delay_s: float = 0.01,
                 slow: dict[str, float] | None = None,
                 errors: dict[str, BaseException] | None = None) -> None:
        self.statuses, self.delay_s, self.errors = statuses, delay_s, errors or {}
        self.slow = slow or {}
        self.in_flight = self.peak = 0

    def get_workflow_handle(self, job_id: str) -> Any:
        fake = self

        class _Handle:
            async def describe(self, **_: Any) -> _Described:
                fake.in_flight += 1
                fake.peak = max(fake.peak, fake.in_flight)
                try:
                    await asyncio.sleep(fake.slow.get(job_id, fake.delay_s))
                    if job_id in fake.errors:
                        raise fake.errors[job_id]
                    return _Described(fake.statuses[job_id])
                finally:
                    fake.in_flight -= 1

        return _Handle()


async def test_jobs_over_asks_temporal_in_waves_and_reads_every_answer() -> None:
    from temporalio.client import WorkflowExecutionStatus as S

    from warmloop.activities.holds import WorkflowsOver

    statuses = {f"j{i}": (S.RUNNING if i % 3 else S.COMPLETED) for i in range(30)}
    statuses["j1"] = S.FAILED
    fake = _FakeTemporal(statuses)
    over = await WorkflowsOver(fake, max_concurrent=4)(sorted(statuses))  # type: ignore[arg-type]
    assert fake.peak == 4  # 30 describes, never more than 4 at once
    assert over == {j for j, s in statuses.items() if s != S.RUNNING}


async def test_jobs_over_counts_a_job_it_cannot_describe_as_running() -> None:
    from temporalio.client import WorkflowExecutionStatus as S
    from temporalio.service import RPCError, RPCStatusCode

    from warmloop.activities.holds import WorkflowsOver

    fake = _FakeTemporal({"done": S.TERMINATED, "slow": S.COMPLETED, "lost": S.COMPLETED},
                         slow={"slow": 5.0},
                         errors={"lost": RPCError("not found", RPCStatusCode.NOT_FOUND, b"")})
    over = await WorkflowsOver(fake, timeout_s=0.05)(["done", "slow", "lost"])  # type: ignore[arg-type]
    assert over == {"done"}


def test_jobs_over_refuses_no_slots() -> None:
    from warmloop.activities.holds import WorkflowsOver

    with pytest.raises(ValueError, match="max_concurrent must be at least 1"):
        WorkflowsOver(object(), max_concurrent=0)  # type: ignore[arg-type]
