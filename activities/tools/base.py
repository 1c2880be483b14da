"""What a profile's tools implement, and the ledger that makes side effects idempotent."""

from __future__ import annotations

import abc
import hashlib
import json
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError

from warmloop.workflows.contracts import ToolRequest, ToolResult


@dataclass(frozen=True)
class ToolOutcome:
    """A tool's answer, and the change it asks to make in the world (if any).

    Tools never apply side effects themselves: the activity applies ``effect``
    through the ledger, once per effect identity (``ToolSpec.effect_key``; by default
    once per (job, step)), however often the activity is retried, a killed worker's
    task is re-run or the model asks again.
    """

    result: ToolResult
    effect: dict[str, Any] | None = None


class Toolset(abc.ABC):
    """The tools of one profile."""

    profile: str

    @abc.abstractmethod
    def run(self, req: ToolRequest) -> ToolOutcome:
        """Run one validated call. Expected failures (not found, ...) are results the model
        reads, with ``ok=False``; only unexpected errors raise."""

    async def arun(self, req: ToolRequest) -> ToolOutcome:
        """The call as the activity runs it; tools that wait on I/O override this."""
        return self.run(req)


def load_json(package: str, name: str) -> Any:
    return json.loads(resources.files(package).joinpath(name).read_text())


class LedgerUnavailableError(RuntimeError):
    """Redis, where the ledger lives, did not answer: nothing was applied. The caller
    must fail the call retryably, never apply the effect without the ledger."""


@dataclass(frozen=True)
class EffectRecord:
    """One applied side effect, as the ledger keeps it: which call applied it and what
    that call answered, so a repeat reads the same answer."""

    tool: str
    step: int
    ok: bool
    output: str | None
    """What the applying call answered; None in a record written before the ledger kept
    results (the caller then answers with its own fresh result, as it used to)."""
    effect: dict[str, Any] | None = None
    """The change a toolset asked for; None for a function or HTTP tool (the change is
    theirs, the ledger keeps their answer)."""
    identity: str | None = None
    """``ToolSpec.effect_identity`` of the call, or None when keyed by (job, step)."""
    job_id: str | None = None
    """The job whose call applied it; None in a record written before records carried
    it (always this job's then: identities were per job)."""
    fresh: bool = False
    """True for the record this very call wrote (not stored)."""

    def to_json(self) -> str:
        return json.dumps({"tool": self.tool, "step": self.step, "ok": self.ok,
                           "output": self.output, "effect": self.effect,
                           "identity": self.identity, "job_id": self.job_id},
                          sort_keys=True)

    @classmethod
    def from_json(cls, raw: str | bytes, key_step: int | None) -> EffectRecord:
        """A stored record; one written before records carried their step and result
        (``{"tool", **effect}`` or ``{"tool", "ok", "output"}``) is read as it was."""
        data = json.loads(raw)
        if "step" in data:
            return cls(tool=data["tool"], step=int(data["step"]), ok=bool(data["ok"]),
                       output=data["output"], effect=data.get("effect"),
                       identity=data.get("identity"), job_id=data.get("job_id"))
        rest = {k: v for k, v in data.items() if k not in ("tool", "ok", "output")}
        return cls(tool=data.get("tool", ""), step=-1 if key_step is None else key_step,
                   ok=bool(data.get("ok", True)), output=data.get("output"),
                   effect=rest or None)


class EffectLedger:
    """Side effects in Redis, one key each: SET NX makes each apply once.

    The key is the effect's business identity when its tool declares one
    (``ToolSpec.effect_key``): an invoice is paid once however many steps ask; within
    the job, or within its tenant for ``effect_scope="tenant"`` (the ``owner``), however
    many jobs ask. Otherwise it is (job, step), which only makes a retried or re-run
    call idempotent. Each record keeps the applying call's result (and job), which a
    repeat answers with.

    Redis is not optional here: an effect is "applied" when its record is written, so
    without Redis nothing can be applied safely. Every method raises
    ``LedgerUnavailableError`` when Redis fails.
    """

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    @staticmethod
    def key(job_id: str, step: int, identity: str | None = None,
            owner: str | None = None) -> str:
        """The record's key; an identity is hashed (it holds argument values of any
        length), and kept readable inside the record. ``owner``: whose effects the
        identity is unique among (``ToolSpec.effect_owner``; default the job)."""
        if identity is None:
            return f"warmloop:effect:{job_id}:{step}"
        digest = hashlib.sha256(identity.encode()).hexdigest()
        return f"warmloop:effect:{owner or job_id}:id:{digest}"

    @staticmethod
    def _counts_key(job_id: str) -> str:
        return f"warmloop:effects:{job_id}"

    @staticmethod
    def _shared_key(job_id: str) -> str:
        """The keys of the effects the job applied under another owner (its tenant)."""
        return f"warmloop:effects-shared:{job_id}"

    async def apply_once(self, job_id: str, step: int, tool: str, *, ok: bool, output: str,
                         effect: dict[str, Any] | None = None, identity: str | None = None,
                         owner: str | None = None) -> EffectRecord:
        """Record the effect unless its key holds one already; returns the record that
        stands: this call's (``fresh``) or the earlier one (a retry, a repeat at another
        step or, with an ``owner`` other than the job, in another job, or a concurrent
        attempt that won)."""
        record = EffectRecord(tool=tool, step=step, ok=ok, output=output, effect=effect,
                              identity=identity, job_id=job_id)
        key = self.key(job_id, step, identity, owner)
        try:
            applied = await self._redis.set(key, record.to_json(), nx=True)
            await self._redis.hincrby(self._counts_key(job_id),
                                      "applied" if applied else "deduplicated", 1)
            if applied and identity is not None and owner not in (None, job_id):
                await self._redis.sadd(self._shared_key(job_id), key)
            if applied:
                return replace(record, fresh=True)
            raw = await self._redis.get(key)
        except RedisError as e:
            raise _unavailable(e) from e
        # gone between SET and GET only if someone deleted it: ours is what was applied
        return record if raw is None else EffectRecord.from_json(raw, step)

    async def recorded(self, job_id: str, step: int, identity: str | None = None,
                       owner: str | None = None) -> EffectRecord | None:
        """The effect recorded under this call's key, or None: checked before a side
        effect runs, so a repeat never runs it again."""
        try:
            raw = await self._redis.get(self.key(job_id, step, identity, owner))
        except RedisError as e:
            raise _unavailable(e) from e
        return None if raw is None else EffectRecord.from_json(raw, step)

    async def note_repeat(self, job_id: str) -> None:
        """Count a call answered from the ledger instead of being applied."""
        try:
            await self._redis.hincrby(self._counts_key(job_id), "deduplicated", 1)
        except RedisError as e:
            raise _unavailable(e) from e

    async def effects(self, job_id: str) -> dict[int, dict[str, Any]]:
        """Every effect applied by ``job_id``'s calls, by the step that applied it (its
        tenant's shared ones included)."""
        prefix = f"warmloop:effect:{job_id}:"
        out: dict[int, dict[str, Any]] = {}
        async for key in self._redis.scan_iter(match=_glob_escape(prefix) + "*"):
            k = key.decode() if isinstance(key, bytes) else key
            rest = k[len(prefix):]
            if not (rest.isdigit() or rest.startswith("id:")):
                continue  # another job whose id starts with this one's and a colon
            raw = await self._redis.get(k)
            if raw is not None:
                rec = EffectRecord.from_json(raw, int(rest) if rest.isdigit() else None)
                out[rec.step] = json.loads(rec.to_json())
        for key in await self._redis.smembers(self._shared_key(job_id)):
            raw = await self._redis.get(key)
            if raw is not None:
                rec = EffectRecord.from_json(raw, None)
                out[rec.step] = json.loads(rec.to_json())
        return out

    async def counts(self, job_id: str) -> dict[str, int]:
        raw = await self._redis.hgetall(self._counts_key(job_id))
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}


def _unavailable(e: RedisError) -> LedgerUnavailableError:
    # the class only: a Redis error's text may name hosts, and this reaches the prompt
    return LedgerUnavailableError(f"the effect ledger (Redis) is unreachable "
                                  f"({type(e).__name__}); nothing was applied")


def _glob_escape(text: str) -> str:
    """``text`` matched literally by Redis' glob-style MATCH."""
    return "".join(f"\\{c}" if c in "*?[]\\" else c for c in text)
