"""A served step's directory record is on the step's path, so everything the inference
worker reads and counts around it goes in one round trip (real Redis). What that must
keep: the job's previous chain is read before the new one replaces it, the detector
still sees both busts, and a step without a bust writes nothing more."""

from __future__ import annotations

from typing import Any

import pytest
import redis.asyncio as aioredis

from warmloop.activities.cachebust import CacheBustDetector
from warmloop.activities.directory import PrefixDirectory, PromptChain


def chain(*hashes: str, reusable: int | None = None) -> PromptChain:
    return PromptChain(hashes=list(hashes), block_size=16,
                       reusable_blocks=len(hashes) if reusable is None else reusable)


class RoundTrips:
    """Counts the client's round trips: single commands and pipeline executions."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, redis: aioredis.Redis) -> None:
        self.n = 0
        command, execute = redis.execute_command, aioredis.client.Pipeline.execute

        async def counted_command(*args: Any, **kw: Any) -> Any:
            self.n += 1
            return await command(*args, **kw)

        async def counted_execute(pipe: Any, *args: Any, **kw: Any) -> Any:
            self.n += 1
            return await execute(pipe, *args, **kw)

        monkeypatch.setattr(redis, "execute_command", counted_command)
        monkeypatch.setattr(aioredis.client.Pipeline, "execute", counted_execute)


async def test_one_round_trip_reads_the_old_chain_and_writes_the_new(
        redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    d = PrefixDirectory(redis)
    await d.record_served("e0", "j1", chain("a", "b", "c", reusable=2), capacity_blocks=None)
    await d.set_profile_chain("fam", ["a"], 16)
    trips = RoundTrips(monkeypatch, redis)
    got = await d.record_step("e1", "j1", chain("a", "b", "x", "y", reusable=3),
                              capacity_blocks=2, accuracy=(32, 48), read_previous=True,
                              family="fam")
    assert trips.n == 1
    assert got.previous_job_chain == ["a", "b"]  # as it stood: only the reusable blocks
    assert got.profile_chain == ["a"]
    assert await d.job_chain("j1") == (["a", "b", "x"], "e1")
    # the estimated trim ran in the same round: two blocks left, the prompt's head
    assert await d.matched_blocks(["a", "b", "x", "y"], ["e1"]) == {"e1": 2}
    assert await d.accuracy() == {"steps": 1, "predicted": 32, "actual": 48,
                                  "abs_error": 16, "exact": 0}


async def test_nothing_asked_nothing_read(redis: aioredis.Redis) -> None:
    d = PrefixDirectory(redis)
    got = await d.record_step("e0", "j2", chain("a"), capacity_blocks=None)
    assert (got.previous_job_chain, got.profile_chain) == (None, None)
    # a first step (no chain yet) and a new family read as None, not as an error
    got = await d.record_step("e0", "j3", chain("a"), capacity_blocks=None,
                              read_previous=True, family="new")
    assert (got.previous_job_chain, got.profile_chain) == (None, None)
    assert await d.accuracy() == {}


async def test_the_detector_judges_from_what_the_record_read(
        redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    d = PrefixDirectory(redis)
    busts: list[Any] = []
    detector = CacheBustDetector(redis, d, on_bust=busts.append)

    async def step(job: str, n: int, c: PromptChain) -> None:
        rec = await d.record_step("e0", job, c, capacity_blocks=None,
                                  read_previous=n > 1, family="p")
        await detector.judge(profile="p", job_id=job, step=n, hashes=c.hashes,
                             block_size=16, stable_blocks=2, previous=rec.previous_job_chain,
                             reference=rec.profile_chain)

    await step("j1", 1, chain("s1", "s2", "j1a"))  # sets the family's reference
    assert await d.profile_chain("p") == ["s1", "s2"] and busts == []
    trips = RoundTrips(monkeypatch, redis)
    await step("j1", 2, chain("s1", "s2", "j1a", "j1b"))  # extends: no bust
    assert trips.n == 1 and busts == []  # and nothing written beyond the record
    await step("j1", 3, chain("s1", "s2", "zz", "j1c"))  # rewrote its own history
    assert [(b.kind, b.block) for b in busts] == [("job_prefix", 2)]
    await step("j2", 1, chain("s1", "s9", "j2a"))  # a changed stable prefix
    assert [(b.kind, b.block) for b in busts[1:]] == [("stable_prefix", 1)]
    assert await d.profile_chain("p") == ["s1", "s9"]  # the newest is the reference


async def test_a_jobs_engine_and_step_are_read_back_for_its_holds(redis: aioredis.Redis) -> None:
    """What an engine's holds ask at each touch: where each job was last served, and at
    which step (``HoldManager._drop_moved``), in one round trip."""
    d = PrefixDirectory(redis)
    await d.record_step("e0", "m1", chain("a"), capacity_blocks=None, step=2)
    await d.record_step("e1", "m1", chain("a", "b"), capacity_blocks=None, step=3)
    await d.record_served("e0", "m2", chain("a"), capacity_blocks=None)  # the gateway's
    assert await d.job_engines(["m1", "m2", "m3"]) == {"m1": ("e1", 3), "m2": ("e0", None)}
    assert await d.job_engines([]) == {}
