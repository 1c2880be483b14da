"""Cache-bust detector: notices a prompt prefix that changed where it should not.

Two checks, on the block-hash chains of served prompts:

- **across jobs**: every job of a profile must start with the same stable prefix
  (system prompt and tool schemas). A timestamp or request id in the system prompt, or
  tools in a different order, changes it and every job re-prefills it;
- **within a job**: each step's prompt must extend the one before, up to the volatile
  tail. A rewritten transcript or a volatile field before stable content breaks it.

A bust is logged as a structured warning naming the profile and the first differing
block, counted in Redis and a metric, and listed by ``warmloop doctor``.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable

import redis.asyncio as aioredis
import structlog
from pydantic import BaseModel

from warmloop.activities.directory import PrefixDirectory
from warmloop.workflows.routing import first_difference, prefix_family

log = structlog.get_logger(__name__)

BUST_COUNTS = "warmloop:busts:count"
"""Hash: '<profile>|<kind>' -> count."""
BUST_RECENT = "warmloop:busts:recent"
RECENT_KEPT = 50


class CacheBust(BaseModel):
    """One prefix change that costs a re-prefill every model step pays again."""

    profile: str
    kind: str
    """``stable_prefix`` (differs from the profile's other jobs) or ``job_prefix``
    (a step does not extend its job's previous prompt)."""
    job_id: str
    step: int
    block: int
    """Index of the first differing block."""
    token_offset: int
    """Where that block starts in the prompt, in tokens."""
    at: float


def reference_family(profile: str, *, hashes: list[str], stable_blocks: int,
                     tools: list[str] | None) -> str | None:
    """The prefix family whose stable chain ``CacheBustDetector.judge`` compares a prompt
    with (jobs offering other tools differ, rightly); None when the prompt has no stable
    block, so there is nothing to read."""
    return prefix_family(profile, tools) if stable_blocks > 0 and hashes else None


class CacheBustDetector:
    def __init__(self, redis: aioredis.Redis, directory: PrefixDirectory, *,
                 on_bust: Callable[[CacheBust], None] | None = None) -> None:
        self._redis = redis
        self._dir = directory
        self._on_bust = on_bust

    async def check(self, *, profile: str, job_id: str, step: int, hashes: list[str],
                    block_size: int, stable_blocks: int,
                    previous: list[str] | None,
                    tools: list[str] | None = None) -> list[CacheBust]:
        """Compare a served prompt's chain with its profile's stable prefix and with the
        job's previous prompt (``previous``: its reusable blocks). Returns the busts."""
        family = reference_family(profile, hashes=hashes, stable_blocks=stable_blocks,
                                  tools=tools)
        reference = None if family is None else await self._dir.profile_chain(family)
        return await self.judge(profile=profile, job_id=job_id, step=step, hashes=hashes,
                                block_size=block_size, stable_blocks=stable_blocks,
                                previous=previous, tools=tools, reference=reference)

    async def judge(self, *, profile: str, job_id: str, step: int, hashes: list[str],
                    block_size: int, stable_blocks: int, previous: list[str] | None,
                    reference: list[str] | None,
                    tools: list[str] | None = None) -> list[CacheBust]:
        """``check`` with the prefix family's stable chain (``reference``) already read:
        the inference worker reads it in the round trip that records the prompt
        (``PrefixDirectory.record_step``), so a step without a bust costs no Redis call
        here. Writes only when the reference changes or a bust fires."""
        busts: list[CacheBust] = []
        stable = hashes[:stable_blocks]
        if stable:
            ref = reference
            if ref is not None:
                i = first_difference(ref[:len(stable)], stable)
                if i is not None or len(ref) != len(stable):
                    at = i if i is not None else min(len(ref), len(stable))
                    busts.append(self._bust(profile, "stable_prefix", job_id, step, at,
                                            block_size))
            if ref != stable:
                # The newest stable prefix is the reference: a deliberate profile change
                # fires once, a timestamp in the system prompt fires on every job.
                family = prefix_family(profile, tools)  # other tools differ, rightly
                await self._dir.set_profile_chain(family, stable, block_size)
        if previous:
            i = first_difference(previous, hashes)
            if i is None and len(hashes) < len(previous):
                i = len(hashes)
            if i is not None:
                busts.append(self._bust(profile, "job_prefix", job_id, step, i, block_size))
        for b in busts:
            await self._record(b)
        return busts

    def _bust(self, profile: str, kind: str, job_id: str, step: int, block: int,
              block_size: int) -> CacheBust:
        return CacheBust(profile=profile, kind=kind, job_id=job_id, step=step, block=block,
                         token_offset=block * block_size, at=time.time())

    async def _record(self, b: CacheBust) -> None:
        log.warning("cache_bust", profile=b.profile, kind=b.kind, job_id=b.job_id,
                    step=b.step, first_differing_block=b.block, token_offset=b.token_offset)
        pipe = self._redis.pipeline(transaction=False)
        pipe.hincrby(BUST_COUNTS, f"{b.profile}|{b.kind}", 1)
        pipe.lpush(BUST_RECENT, b.model_dump_json())
        pipe.ltrim(BUST_RECENT, 0, RECENT_KEPT - 1)
        await pipe.execute()
        if self._on_bust is not None:
            self._on_bust(b)


async def bust_report(redis: aioredis.Redis) -> tuple[dict[tuple[str, str], int], list[CacheBust]]:
    """Counts per (profile, kind) and the most recent busts, newest first."""
    counts: dict[tuple[str, str], int] = {}
    for k, v in (await redis.hgetall(BUST_COUNTS)).items():
        key = k.decode() if isinstance(k, bytes) else k
        profile, _, kind = key.partition("|")
        counts[(profile, kind)] = int(v)
    recent = [CacheBust.model_validate(json.loads(r))
              for r in await redis.lrange(BUST_RECENT, 0, RECENT_KEPT - 1)]
    return counts, recent
