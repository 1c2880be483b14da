"""The prefix directory: which engine likely holds which prompt prefix.

Kept in Redis, one sorted set per engine of block hashes
(``warmloop.workflows.routing.block_hashes``) scored by last use. Two ways to keep it true:

- **precise**: the engine publishes its KV events (vLLM ``--kv-events-config``) and the
  inference worker applies each ``BlockStored``/``BlockRemoved`` (``KvEventApplier``);
- **estimated**: without events, the blocks of each served prompt are recorded and the
  set is trimmed, least recently used first, to the engine's KV capacity.

Each job's latest prompt chain and each profile's stable-prefix chain are kept too, so
the router can ask "how much of this step's prompt does engine E hold?" with one walk.

Tenants: a tenant's prompts carry its ``cache_salt``, which vLLM mixes into the first
block's hash, so the chain here starts from the salt too (``prompt_chain(salt=...)``,
and ``KvEventApplier`` reads the salt from the event's ``extra_keys``). The same
tokens of two tenants are then different blocks here, as they are in the engine. Job
chains are per tenant by the job's namespaced id; a profile's stable prefix is kept
under the tenant's ``scoped`` family name.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import redis.asyncio as aioredis
import structlog

from warmloop.workflows.holding import EvictionRegret
from warmloop.workflows.routing import block_hashes

log = structlog.get_logger(__name__)

ENGINE_BLOCKS = "warmloop:dir:engine:{}"
JOB_CHAIN = "warmloop:dir:job:{}"
PROFILE_CHAIN = "warmloop:dir:profile:{}"
TRACE = "warmloop:dir:trace"
"""List of served prompts' chains, kept only when tracing is on (benchmarks)."""
ACCURACY = "warmloop:dir:accuracy"
"""Hash: steps, predicted and actual cached token sums, absolute error sum."""
JOB_CHAIN_TTL_S = 24 * 3600
MAX_WALK_BLOCKS = 512
"""Longest prefix the router walks (64k tokens at block 128)."""


@dataclass(frozen=True)
class PromptChain:
    """A prompt's block-hash chain, and how much of it the job's next step shares.

    The volatile tail (budget line) is last in every prompt and changes each step, so
    only the blocks wholly before it can be reused by the next step."""

    hashes: list[str]
    block_size: int
    reusable_blocks: int
    tokens: int = 0
    """Prompt length in tokens (the last, partial block is not hashed)."""


@dataclass(frozen=True)
class ServedRecord:
    """What the directory held just before a served prompt's record replaced it. The
    cache-bust detector compares the new prompt against these; they come back from the
    round trip that writes the record, so the check adds no Redis round to the step."""

    previous_job_chain: list[str] | None
    """The job's reusable blocks as of its previous step (None: not asked, or none)."""
    profile_chain: list[str] | None
    """The prefix family's stable chain (None: not asked, or none yet)."""


def _hashes(raw: Any) -> list[str] | None:
    """The ``hashes`` of a stored job or profile chain."""
    return None if raw is None else list(json.loads(raw)["hashes"])


def _queue_accuracy(pipe: Any, predicted: int, actual: int) -> None:
    pipe.hincrby(ACCURACY, "steps", 1)
    pipe.hincrby(ACCURACY, "predicted", predicted)
    pipe.hincrby(ACCURACY, "actual", actual)
    pipe.hincrby(ACCURACY, "abs_error", abs(predicted - actual))
    pipe.hincrby(ACCURACY, "exact", int(predicted == actual))


class PrefixDirectory:
    def __init__(self, redis: aioredis.Redis, *, trace: bool = False) -> None:
        self._redis = redis
        self._trace = trace

    # ---- writes (inference worker) ----------------------------------------------------

    async def record_served(self, engine_id: str, job_id: str, chain: PromptChain, *,
                            capacity_blocks: int | None, now: float | None = None) -> None:
        """The engine just served this prompt: its blocks are now the most recently used
        there. Without KV events, trim the engine's set to ``capacity_blocks``."""
        await self.record_step(engine_id, job_id, chain, capacity_blocks=capacity_blocks,
                               now=now)

    async def record_step(self, engine_id: str, job_id: str, chain: PromptChain, *,
                          capacity_blocks: int | None, accuracy: tuple[int, int] | None = None,
                          read_previous: bool = False, family: str | None = None,
                          now: float | None = None, step: int | None = None) -> ServedRecord:
        """``record_served`` plus what the inference worker reads and counts around it, in
        one round trip (a step's records are on its path: its job's next step may be
        routed the moment it returns).

        ``accuracy``: (predicted, actual) cached tokens for the router's accuracy counters.
        ``read_previous``: return the job's chain as it stood before this record (Redis
        runs a pipeline's commands in order, so the read sees the old value).
        ``family``: return that prefix family's stable chain (the cache-bust detector's
        reference). ``step``: the job's step, kept with its chain (``job_engines``: a
        hold on another engine learns the job has moved)."""
        now = time.time() if now is None else now
        key = ENGINE_BLOCKS.format(engine_id)
        job_key = JOB_CHAIN.format(job_id)
        pipe = self._redis.pipeline(transaction=False)
        reads = 0
        if read_previous:
            pipe.get(job_key)
            reads += 1
        if family is not None:
            pipe.get(PROFILE_CHAIN.format(family))
            reads += 1
        if accuracy is not None:
            _queue_accuracy(pipe, *accuracy)
        if chain.hashes:
            # Later blocks are evicted first by vLLM's LRU; give them slightly older
            # scores so an estimated trim drops a prompt's tail before its head.
            n = len(chain.hashes)
            pipe.zadd(key, {h: now - (i / n) * 1e-3 for i, h in enumerate(chain.hashes)})
        if capacity_blocks is not None:
            pipe.zremrangebyrank(key, 0, -(capacity_blocks + 1))
        record: dict[str, Any] = {"engine": engine_id, "block_size": chain.block_size,
                                  "hashes": chain.hashes[:chain.reusable_blocks]}
        if step is not None:
            record["step"] = step
        pipe.set(job_key, json.dumps(record), ex=JOB_CHAIN_TTL_S)
        if self._trace:
            pipe.rpush(TRACE, json.dumps({"job": job_id, "engine": engine_id,
                                          "tokens": chain.tokens, "hashes": chain.hashes}))
        got = (await pipe.execute())[:reads]
        previous = _hashes(got.pop(0)) if read_previous else None
        reference = _hashes(got.pop(0)) if family is not None else None
        return ServedRecord(previous_job_chain=previous, profile_chain=reference)

    async def traced(self) -> list[dict[str, Any]]:
        return [json.loads(r) for r in await self._redis.lrange(TRACE, 0, -1)]

    async def store_blocks(self, engine_id: str, hashes: Iterable[str], now: float) -> None:
        mapping = {h: now for h in hashes}
        if mapping:
            await self._redis.zadd(ENGINE_BLOCKS.format(engine_id), mapping)

    async def remove_blocks(self, engine_id: str, hashes: Iterable[str]) -> None:
        hs = list(hashes)
        if hs:
            await self._redis.zrem(ENGINE_BLOCKS.format(engine_id), *hs)

    async def clear_engine(self, engine_id: str) -> None:
        await self._redis.delete(ENGINE_BLOCKS.format(engine_id))

    async def set_profile_chain(self, profile: str, hashes: list[str], block_size: int) -> None:
        await self._redis.set(PROFILE_CHAIN.format(profile),
                              json.dumps({"hashes": hashes, "block_size": block_size}))

    async def profile_chain(self, profile: str) -> list[str] | None:
        return _hashes(await self._redis.get(PROFILE_CHAIN.format(profile)))

    async def record_accuracy(self, predicted: int, actual: int) -> None:
        pipe = self._redis.pipeline(transaction=False)
        _queue_accuracy(pipe, predicted, actual)
        await pipe.execute()

    async def accuracy(self) -> dict[str, int]:
        raw = await self._redis.hgetall(ACCURACY)
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}

    # ---- reads (router) ---------------------------------------------------------------

    async def job_chain(self, job_id: str) -> tuple[list[str], str] | None:
        """The reusable blocks of the job's last prompt and the engine that served it."""
        raw = await self._redis.get(JOB_CHAIN.format(job_id))
        if raw is None:
            return None
        d = json.loads(raw)
        return list(d["hashes"]), str(d["engine"])

    async def job_engines(self, job_ids: list[str]) -> dict[str, tuple[str, int | None]]:
        """Each job's last recorded (engine, step), in one round trip; jobs without a
        record are left out, a record without a step (the gateway's) has None."""
        if not job_ids:
            return {}
        pipe = self._redis.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.get(JOB_CHAIN.format(job_id))
        out: dict[str, tuple[str, int | None]] = {}
        for job_id, raw in zip(job_ids, await pipe.execute(), strict=True):
            if raw is not None:
                d = json.loads(raw)
                step = d.get("step")
                out[job_id] = (str(d["engine"]), int(step) if step is not None else None)
        return out

    async def matched_blocks(self, chain: list[str], engine_ids: list[str]) -> dict[str, int]:
        """For each engine, how many leading blocks of ``chain`` it holds."""
        chain = chain[:MAX_WALK_BLOCKS]
        if not chain or not engine_ids:
            return {e: 0 for e in engine_ids}
        pipe = self._redis.pipeline(transaction=False)
        for e in engine_ids:
            pipe.zmscore(ENGINE_BLOCKS.format(e), chain)
        out = {}
        for e, scores in zip(engine_ids, await pipe.execute(), strict=True):
            n = 0
            for s in scores:
                if s is None:
                    break
                n += 1
            out[e] = n
        return out

    async def engine_blocks(self, engine_id: str) -> int:
        return int(await self._redis.zcard(ENGINE_BLOCKS.format(engine_id)))


def prompt_chain(prompt_token_ids: list[int], block_size: int, *,
                 tail_tokens: int, salt: str | None = None) -> PromptChain:
    """The chain of a prompt sent with ``cache_salt`` ``salt`` (None: none)."""
    hashes = block_hashes(prompt_token_ids, block_size, salt=salt or "")
    reusable = max(0, len(prompt_token_ids) - tail_tokens) // block_size
    return PromptChain(hashes=hashes, block_size=block_size,
                       reusable_blocks=min(reusable, len(hashes)), tokens=len(prompt_token_ids))


class KvEventApplier:
    """Turns an engine's KV events into directory updates (precise mode).

    vLLM names blocks by its own hashes; the directory names them by the token chain
    (``block_hashes``) so that the router can hash a prompt without the engine. A
    ``BlockStored`` event carries the token ids and the parent, which is enough to map
    one onto the other; the map lives here, bounded by what the engine holds.

    The map is also the engine's block set as far as the events tell: when Redis
    missed some updates (it was away), ``publish`` rewrites the engine's entry from it
    rather than leaving the directory wrong (a missed removal would otherwise stay
    there for good: the engine never removes that block again).
    """

    def __init__(self, directory: PrefixDirectory, engine_id: str, *,
                 regret: EvictionRegret | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        """``regret``: told every eviction and store the events show (the hold model's
        rent, ``HoldManager``)."""
        self._dir = directory
        self._engine = engine_id
        self._regret = regret
        self._clock = clock
        self._block_size: int | None = None
        self._ours: dict[Any, str] = {}
        self._stored: list[str] = []
        self._removed: list[str] = []
        self._cleared = False
        self.behind = False
        """Updates were lost or skipped: the next ``publish`` rewrites the entry whole."""
        self.stored = 0
        self.removed = 0

    async def apply(self, events: list[Any], now: float | None = None) -> None:
        """Follow ``events`` and write them to the directory."""
        self.follow(events)
        await self.publish(now)

    def follow(self, events: list[Any]) -> None:
        """Take ``events`` into the map (no I/O); ``publish`` writes them."""
        regret, now = self._regret, self._clock()
        for ev in events:
            kind, body = _event_kind(ev)
            if kind == "BlockStored":
                stored = self._on_stored(body)
                self._stored.extend(stored)
                if regret is not None and stored and self._block_size:
                    regret.stored(stored, self._block_size, now)
            elif kind == "BlockRemoved":
                if body.get("medium") not in (None, "GPU"):
                    continue  # an offload tier's drop: the engine's own pool still has it
                removed = []
                for vh in body.get("block_hashes") or []:
                    ours = self._ours.pop(_key(vh), None)
                    if ours is not None:
                        removed.append(ours)
                self._removed.extend(removed)
                if regret is not None and removed and self._block_size:
                    regret.evicted(removed, self._block_size, now)
            elif kind == "AllBlocksCleared":
                self._ours.clear()
                self._stored, self._removed, self._cleared = [], [], True

    async def publish(self, now: float | None = None) -> None:
        """Write what was followed since the last publish (all of the map when
        ``behind``). A Redis error leaves the applier ``behind`` and is raised."""
        now = time.time() if now is None else now
        stored, removed, cleared = self._stored, self._removed, self._cleared
        self._stored, self._removed, self._cleared = [], [], False
        try:
            if self.behind:
                await self._dir.clear_engine(self._engine)
                await self._dir.store_blocks(self._engine, list(self._ours.values()), now)
                self.behind = False
                return
            if cleared:
                await self._dir.clear_engine(self._engine)
            # Removals of blocks stored in the same batch must win, so store first.
            await self._dir.store_blocks(self._engine, stored, now)
            await self._dir.remove_blocks(self._engine, removed)
        except BaseException:
            self.behind = True
            raise
        self.stored += len(stored)
        self.removed += len(removed)

    def _on_stored(self, body: dict[str, Any]) -> list[str]:
        if body.get("medium") not in (None, "GPU"):
            return []  # an offload tier, not the pool the engine serves prefixes from
        bs = self._block_size = int(body["block_size"])
        tokens = list(body.get("token_ids") or [])
        parent_vh = body.get("parent_block_hash")
        seed: bytes | None
        if parent_vh is None:
            seed = _first_block_seed(body.get("extra_keys"))
        else:
            parent = self._ours.get(_key(parent_vh))
            seed = None if parent is None else bytes.fromhex(parent)
        if seed is None:
            # parent unknown (stored before we subscribed), or a first block keyed by
            # more than a salt (a LoRA, images): cannot chain
            return []
        out = []
        for i, vh in enumerate(body.get("block_hashes") or []):
            chunk = tokens[i * bs:(i + 1) * bs]
            if len(chunk) < bs:
                break
            ours = _chain_step(seed, chunk)
            self._ours[_key(vh)] = ours
            out.append(ours)
            seed = bytes.fromhex(ours)
        return out


def _first_block_seed(extra_keys: Any) -> bytes | None:
    """What a prompt's chain starts from, by its first block's ``extra_keys`` (vLLM
    publishes them untagged): nothing, or the request's ``cache_salt`` alone (a
    tenant's prompt, see ``block_hashes(salt=...)``); None for anything else."""
    first = extra_keys[0] if isinstance(extra_keys, (list, tuple)) and extra_keys else None
    if not first:
        return b""
    if isinstance(first, (list, tuple)) and len(first) == 1 and isinstance(first[0], str):
        return first[0].encode()
    return None


def _chain_step(parent: bytes, tokens: list[int]) -> str:
    # Same construction as warmloop.workflows.routing.block_hashes, one block at a time:
    # ``parent`` is the previous block's digest, or the salt (b"" for none) at block 0.
    h = hashlib.blake2b(parent, digest_size=8)
    h.update(b"".join(t.to_bytes(4, "little", signed=False) for t in tokens))
    return h.hexdigest()


def _key(vh: Any) -> Any:
    return bytes(vh) if isinstance(vh, (bytes, bytearray, memoryview)) else vh


def _event_kind(ev: Any) -> tuple[str, dict[str, Any]]:
    """msgspec tagged structs arrive as maps with a ``type`` key (or as arrays whose
    first item is the tag, depending on vLLM's encoder settings)."""
    if isinstance(ev, dict):
        return str(ev.get("type", "")), ev
    if isinstance(ev, (list, tuple)) and ev:
        tag = ev[0]
        names = {"BlockStored": ["block_hashes", "parent_block_hash", "token_ids",
                                 "block_size", "lora_id", "medium", "lora_name",
                                 "extra_keys"],
                 "BlockRemoved": ["block_hashes", "medium"]}
        fields = names.get(str(tag), [])
        return str(tag), dict(zip(fields, ev[1:], strict=False))
    return "", {}
