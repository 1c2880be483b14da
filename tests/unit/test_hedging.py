"""Hedged tool calls: the race (first answer wins, errors never hide an answer, the
loser is cancelled and reaped), when a call is hedged (read-only tools of jobs that
allow it, never side effects), the threshold (statistics, else the prior) and the
budget and counts."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Iterator
from typing import Any, Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict
from temporalio.testing import ActivityEnvironment

from tests.ledger_redis import LedgerRedis
from warmloop import Profile, ToolContext, ToolSpec, tool
from warmloop.activities.pauses import PauseStats, bucket_mid, bucket_of, tool_kind
from warmloop.activities.tools import EffectLedger, Hedging, ToolActivities, ToolOutcome, Toolset
from warmloop.activities.tools.hedging import HEDGES_KEY, Raced, hedge_counts, race
from warmloop.workflows.contracts import ToolRequest, ToolResult
from warmloop.workflows.holding import PauseDistribution
from warmloop.workflows.profiles import REGISTRY, HttpRunner
from warmloop.workflows.profiles.document import ProfileDocumentError, profile_from_document

# ---- the race ----------------------------------------------------------------------------


class Requests:
    """Two scripted requests: each waits for its own event, then answers or raises."""

    def __init__(self) -> None:
        self.go = {False: asyncio.Event(), True: asyncio.Event()}
        self.fail = {False: False, True: False}
        self.started: list[bool] = []
        self.cancelled: list[bool] = []
        self.then_release: dict[bool, bool] = {}
        """When a request fails, set the other's event first (ordering without sleeps)."""
        self.both = asyncio.Event()
        """Set when the second request has started."""

    async def start(self, second: bool) -> str:
        self.started.append(second)
        if second:
            self.both.set()
        try:
            await self.go[second].wait()
        except asyncio.CancelledError:
            self.cancelled.append(second)
            raise
        if self.fail[second]:
            if self.then_release.get(second):
                self.go[not second].set()
            raise RuntimeError(f"{'hedge' if second else 'primary'} failed")
        return "hedge" if second else "primary"


async def now(value: float | None) -> float | None:
    return value


def mine(before: set[asyncio.Task[Any]]) -> set[asyncio.Task[Any]]:
    """Tasks created since ``before`` that are still alive (a leak)."""
    return {t for t in asyncio.all_tasks() - before if not t.done()} - {asyncio.current_task()}


async def test_a_call_past_its_threshold_is_hedged_and_the_loser_cancelled() -> None:
    before = asyncio.all_tasks()
    r = Requests()
    r.go[True].set()  # the second request answers at once; the first never would
    out = await race(r.start, delay_s=now(0.0), allow=lambda: True)
    assert out == Raced("hedge", hedged=True, winner="hedge")
    assert r.started == [False, True] and r.cancelled == [False]
    assert not mine(before)


async def test_a_call_that_answers_before_its_threshold_is_not_hedged() -> None:
    r = Requests()
    r.go[False].set()
    out = await race(r.start, delay_s=now(60.0), allow=lambda: True)
    assert out == Raced("primary", hedged=False, winner="primary")
    assert r.started == [False]


async def test_no_threshold_or_no_budget_means_no_second_request() -> None:
    for delay, allowed in ((None, True), (0.0, False)):
        r = Requests()
        looked = asyncio.Event()

        async def lookup(d: float | None = delay, e: asyncio.Event = looked) -> float | None:
            e.set()
            return d

        def allow(a: bool = allowed) -> bool:
            return a

        task = asyncio.create_task(race(r.start, delay_s=lookup(), allow=allow))
        await looked.wait()
        await asyncio.sleep(0)  # the race reads the threshold and decides
        r.go[False].set()
        out = await task
        assert out.winner == "primary" and not out.hedged and r.started == [False]


async def test_a_failed_second_request_does_not_hide_the_first_answer() -> None:
    r = Requests()
    r.fail[True] = True
    r.then_release[True] = True  # the hedge fails, then the primary answers
    r.go[True].set()
    out = await race(r.start, delay_s=now(0.0), allow=lambda: True)
    assert out == Raced("primary", hedged=True, winner="primary")


async def test_a_failed_first_request_waits_for_the_second() -> None:
    r = Requests()
    r.fail[False] = True
    r.then_release[False] = True
    task = asyncio.create_task(race(r.start, delay_s=now(0.0), allow=lambda: True))
    await r.both.wait()
    r.go[False].set()  # the primary fails now and lets the hedge answer
    assert (await task).winner == "hedge"


async def test_both_failing_raises_the_first_requests_error() -> None:
    r = Requests()
    r.fail = {False: True, True: True}
    r.then_release[True] = True
    r.go[True].set()
    with pytest.raises(RuntimeError, match="primary failed"):
        await race(r.start, delay_s=now(0.0), allow=lambda: True)


async def test_a_fast_failure_is_raised_not_hedged() -> None:
    r = Requests()
    r.fail[False] = True
    r.go[False].set()
    with pytest.raises(RuntimeError, match="primary failed"):
        await race(r.start, delay_s=now(60.0), allow=lambda: True)
    assert r.started == [False]


async def test_cancelling_the_call_cancels_both_requests() -> None:
    before = asyncio.all_tasks()
    r = Requests()
    task = asyncio.create_task(race(r.start, delay_s=now(0.0), allow=lambda: True))
    await r.both.wait()
    task.cancel()  # the activity is cancelled (the job was, or its timeout passed)
    with pytest.raises(asyncio.CancelledError):
        await task
    assert sorted(r.cancelled) == [False, True]
    assert not mine(before)


async def test_a_slow_threshold_read_never_delays_the_answer() -> None:
    before = asyncio.all_tasks()
    r = Requests()
    stuck = asyncio.Event()

    async def slow_lookup() -> float | None:
        await stuck.wait()  # Redis hangs
        return 0.0

    task = asyncio.create_task(race(r.start, delay_s=slow_lookup(), allow=lambda: True))
    r.go[False].set()
    assert (await task).winner == "primary" and r.started == [False]
    assert not mine(before)


# ---- which calls are hedged --------------------------------------------------------------


class Key(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: Literal["a", "b"]


class Task(BaseModel):
    id: str


RUNS: list[str] = []
GATE = threading.Event()


@tool(read_only=True, pause_median_s=0.001, pause_p90_s=0.002)
async def read_async(key: Literal["a", "b"], ctx: ToolContext) -> str:
    """Read a record."""
    RUNS.append(key)
    if len(RUNS) == 1:
        await asyncio.Event().wait()  # the first request hangs
    return f"read {key} #{len(RUNS)}"


@tool(side_effect=True)
async def write_async(key: Literal["a", "b"]) -> str:
    """Write a record."""
    RUNS.append(key)
    for _ in range(5):
        await asyncio.sleep(0)  # long enough for a hedge to start, were there one
    return f"wrote {key}"


@tool(read_only=True)
async def read_yielding(key: Literal["a", "b"]) -> str:
    """Read a record, taking as long as write_async."""
    RUNS.append(key)
    for _ in range(5):
        await asyncio.sleep(0)
    return f"read {key}"


@tool(read_only=True, pause_median_s=0.001, pause_p90_s=0.002)
def read_sync(key: Literal["a", "b"]) -> str:
    """Read a record (blocking)."""
    RUNS.append(key)
    if len(RUNS) == 1:
        GATE.wait(timeout=30)  # the first request hangs in its thread
    return f"read {key} #{len(RUNS)}"


def _http(*, read_only: bool = True) -> ToolSpec:
    return ToolSpec("fetch", "Fetch a record.", Key, read_only=read_only,
                    pause_median_s=0.001, pause_p90_s=0.002,
                    runner=HttpRunner(url="http://tools.test/fetch"))


class SlowToolset(Toolset):
    """A toolset with its own async ``arun``; its first request hangs."""

    profile = "hedge-toolset"

    def __init__(self) -> None:
        self.calls = 0

    def run(self, req: ToolRequest) -> ToolOutcome:
        self.calls += 1
        return ToolOutcome(ToolResult(ok=True, output=f"looked #{self.calls}"))

    async def arun(self, req: ToolRequest) -> ToolOutcome:
        self.calls += 1
        if self.calls == 1:
            await asyncio.Event().wait()
        return ToolOutcome(ToolResult(ok=True, output=f"looked #{self.calls}"))


class BlockingToolset(Toolset):
    """The default ``arun``: ``run`` on the event loop."""

    profile = "hedge-blocking"

    def __init__(self) -> None:
        self.calls = 0

    def run(self, req: ToolRequest) -> ToolOutcome:
        self.calls += 1
        return ToolOutcome(ToolResult(ok=True, output=f"looked #{self.calls}"))


DONE = ToolSpec("done", "done", Key, finishes_job=True)
LOOKUP = ToolSpec("lookup", "Look up.", Key, read_only=True, pause_median_s=0.001,
                  pause_p90_s=0.002)
PROFILES = (
    Profile(name="hedge-test", system_prompt="s", task_model=Task,
            tools=(read_async.spec, write_async.spec, read_yielding.spec, read_sync.spec,
                   _http(), DONE)),
    Profile(name="hedge-toolset", system_prompt="s", task_model=Task, tools=(LOOKUP, DONE)),
    Profile(name="hedge-blocking", system_prompt="s", task_model=Task, tools=(LOOKUP, DONE)),
)


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    for p in PROFILES:
        REGISTRY.add(p, source="test")
    RUNS.clear()
    GATE.clear()
    yield
    GATE.set()  # a hung thread may end
    for p in PROFILES:
        REGISTRY.remove(p.name)


SEEN: list[httpx.Request] = []


async def _service(request: httpx.Request) -> httpx.Response:
    SEEN.append(request)
    if "X-Warmloop-Hedge" not in request.headers:
        await asyncio.Event().wait()  # the first request hangs
    return httpx.Response(200, json={"record": json.loads(request.content)["key"]})


@pytest.fixture
def redis() -> LedgerRedis:
    return LedgerRedis()


@pytest.fixture
def acts(redis: LedgerRedis) -> ToolActivities:
    SEEN.clear()
    http = httpx.AsyncClient(transport=httpx.MockTransport(_service))
    # no statistics: every tool's prior (median 1 ms, p90 2 ms) sets its threshold
    hedging = Hedging(PauseStats(redis), redis=redis)  # type: ignore[arg-type]
    return ToolActivities([SlowToolset(), BlockingToolset()],
                          EffectLedger(redis), s3=None, bucket="b",  # type: ignore[arg-type]
                          http=http, pauses=PauseStats(redis),  # type: ignore[arg-type]
                          hedging=hedging)


def _req(name: str, *, hedge: bool = True, profile: str = "hedge-test") -> ToolRequest:
    return ToolRequest(job_id="j1", step=3, profile=profile, task_id="T1", name=name,
                       arguments={"key": "a"}, hedge=hedge)


async def test_a_slow_read_only_async_function_is_hedged(acts: ToolActivities,
                                                         redis: LedgerRedis) -> None:
    before = asyncio.all_tasks()
    r = await ActivityEnvironment().run(acts.run_tool, _req("read_async"))
    assert r.ok and r.output == "read a #2" and RUNS == ["a", "a"]
    assert acts.hedging.counts == {("hedge-test", "read_async", "calls"): 1,
                                   ("hedge-test", "read_async", "hedged"): 1,
                                   ("hedge-test", "read_async", "hedge_won"): 1}
    assert await hedge_counts(redis) == acts.hedging.counts  # type: ignore[arg-type]
    assert redis.hashes[HEDGES_KEY]["hedge-test|read_async|hedged"] == 1
    assert not mine(before)


class AtOnce(Hedging):
    """Hedges as soon as the first request yields (a threshold of 0)."""

    async def delay_s(self, profile: Profile, spec: ToolSpec) -> float | None:
        return 0.0


@pytest.mark.parametrize(("name", "hedge", "runs"), [
    ("read_yielding", True, 2),  # the control: this slow a read-only call is asked twice
    ("read_yielding", False, 1),  # the job turned hedging off
    ("write_async", True, 1),  # a side effect: never
])
async def test_only_read_only_tools_of_willing_jobs_are_asked_twice(
        acts: ToolActivities, name: str, hedge: bool, runs: int) -> None:
    acts.hedging = AtOnce()
    r = await ActivityEnvironment().run(acts.run_tool, _req(name, hedge=hedge))
    assert r.ok and len(RUNS) == runs


def test_a_tool_cannot_be_read_only_and_have_a_side_effect() -> None:
    with pytest.raises(ValueError, match="drop read_only if the tool changes anything"):
        ToolSpec("pay", "Pay.", Key, side_effect=True, read_only=True)
    with pytest.raises(ValueError, match="drop read_only if the tool changes anything"):
        ToolSpec("pay", "Pay.", Key, side_effect=True, read_only=True)


async def test_a_sync_function_is_hedged_and_its_thread_left_to_finish(
        acts: ToolActivities) -> None:
    r = await ActivityEnvironment().run(acts.run_tool, _req("read_sync"))
    assert r.output == "read a #2"
    GATE.set()  # the loser's thread returns; its answer is dropped


async def test_an_http_tool_sends_a_marked_second_request(acts: ToolActivities) -> None:
    r = await ActivityEnvironment().run(acts.run_tool, _req("fetch"))
    assert r.ok and json.loads(r.output) == {"record": "a"}
    assert [q.headers.get("X-Warmloop-Hedge") for q in SEEN] == [None, "1"]
    assert acts.hedging.counts[("hedge-test", "fetch", "hedge_won")] == 1


async def test_a_toolset_is_hedged_only_when_its_arun_is_async(acts: ToolActivities) -> None:
    r = await ActivityEnvironment().run(acts.run_tool, _req("lookup", profile="hedge-toolset"))
    assert r.output == "looked #2"
    r = await ActivityEnvironment().run(acts.run_tool, _req("lookup", profile="hedge-blocking"))
    assert r.output == "looked #1"  # run on the event loop: a second request could not start
    assert ("hedge-blocking", "lookup", "calls") not in acts.hedging.counts


# ---- the threshold, the budget -----------------------------------------------------------


async def test_without_statistics_the_prior_sets_the_threshold(redis: LedgerRedis) -> None:
    spec = ToolSpec("lookup", "Look up.", Key, read_only=True, pause_median_s=0.2,
                    pause_p90_s=1.0)
    profile = Profile(name="p", system_prompt="s", task_model=Task, tools=(spec, DONE))
    hedging = Hedging(PauseStats(redis))  # type: ignore[arg-type]
    delay = await hedging.delay_s(profile, spec)
    prior = PauseDistribution(prior_median_s=0.2, prior_p90_s=1.0).points()
    assert delay == prior[round(0.95 * 98)] and 1.0 < delay < 3.0
    assert hedging.threshold_from_prior("p", "lookup") is True


async def test_with_enough_samples_the_observed_p95_sets_it(redis: LedgerRedis) -> None:
    spec = ToolSpec("lookup", "Look up.", Key, read_only=True, pause_median_s=0.2,
                    pause_p90_s=1.0)
    profile = Profile(name="p", system_prompt="s", task_model=Task, tools=(spec, DONE))
    stats = PauseStats(redis)  # type: ignore[arg-type]
    for s in [0.1] * 96 + [4.0] * 4:  # 96 % fast, 4 % slow: the p95 is fast
        await stats.record("p", tool_kind("lookup"), s)
    clock = [0.0]
    hedging = Hedging(stats, fresh_s=10, clock=lambda: clock[0])
    assert await hedging.delay_s(profile, spec) == bucket_mid(bucket_of(0.1))
    assert hedging.threshold_from_prior("p", "lookup") is False
    for _ in range(100):  # the tool turns slow; the cached threshold stands until fresh_s
        await stats.record("p", tool_kind("lookup"), 4.0)
    assert await hedging.delay_s(profile, spec) == bucket_mid(bucket_of(0.1))
    clock[0] = 11.0
    assert await hedging.delay_s(profile, spec) == bucket_mid(bucket_of(4.0))


async def test_a_threshold_past_the_timeout_means_no_hedge() -> None:
    spec = ToolSpec("lookup", "Look up.", Key, read_only=True, pause_median_s=20,
                    pause_p90_s=60, timeout_s=30)
    profile = Profile(name="p", system_prompt="s", task_model=Task, tools=(spec, DONE))
    assert await Hedging().delay_s(profile, spec) is None


def test_the_budget_caps_second_requests_at_the_share() -> None:
    hedging = Hedging(max_extra_share=0.1, burst=3)
    allowed = 0
    for _ in range(1000):  # every call slow: each would want a hedge
        hedging.earn("p", "t")
        allowed += hedging.allow("p", "t")
    assert 99 <= allowed <= 101  # 10 % of 1000, plus the one it starts with


def test_only_read_only_tools_of_willing_jobs_are_eligible() -> None:
    ro = ToolSpec("lookup", "Look up.", Key, read_only=True)
    plain = ToolSpec("lookup", "Look up.", Key)
    fx = ToolSpec("pay", "Pay.", Key, side_effect=True)
    assert Hedging.eligible(ro, True)
    assert not Hedging.eligible(ro, False)
    assert not Hedging.eligible(plain, True)
    assert not Hedging.eligible(fx, True)


# ---- declaring it ------------------------------------------------------------------------


def _doc(**tool_fields: Any) -> dict[str, Any]:
    args = {"type": "object", "properties": {"k": {"type": "string", "enum": ["a"]}},
            "required": ["k"], "additionalProperties": False}
    return {"name": "docp", "system_prompt": "s", "task_schema": {
        "type": "object", "properties": {"id": {"type": "string", "pattern": "^[a-z]+$"}},
        "required": ["id"], "additionalProperties": False},
        "tools": [{"name": "look", "description": "d", "arguments": args,
                   "http": {"url": "http://x.test/"}, **tool_fields},
                  {"name": "done", "description": "d", "arguments": args,
                   "finishes_job": True}]}


def test_a_profile_document_declares_read_only() -> None:
    assert profile_from_document(_doc(read_only=True)).tool("look").read_only
    assert not profile_from_document(_doc()).tool("look").read_only
    with pytest.raises(ProfileDocumentError, match=r"^tools\.0: .*read_only and side_effect"):
        profile_from_document(_doc(read_only=True, side_effect=True))


def test_the_decorator_declares_read_only() -> None:
    assert read_async.spec.read_only and not write_async.spec.read_only
