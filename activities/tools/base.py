"""What a profile's tools implement, and the ledger that makes side effects idempotent."""

from __future__ import annotations

import abc
import json
from dataclasses import dataclass
from importlib import resources
from typing import Any

import redis.asyncio as aioredis

from warmloop.workflows.contracts import ToolRequest, ToolResult


@dataclass(frozen=True)
class ToolOutcome:
    """A tool's answer, and the change it asks to make in the world (if any).

    Tools never apply side effects themselves: the activity applies ``effect``
    through the ledger, once per (job, step), however often the activity is retried
    or a killed worker's task is re-run.
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


class EffectLedger:
    """Side effects keyed by (job, step) in Redis: SET NX makes each one apply once."""

    def __init__(self, redis: aioredis.Redis) -> None:
        self._redis = redis

    @staticmethod
    def key(job_id: str, step: int) -> str:
        return f"warmloop:effect:{job_id}:{step}"

    async def apply_once(self, job_id: str, step: int, tool: str,
                         effect: dict[str, Any]) -> bool:
        """Record the effect; False when it was already applied (a retry or a replay)."""
        record = json.dumps({"tool": tool, **effect}, sort_keys=True)
        applied = await self._redis.set(self.key(job_id, step), record, nx=True)
        await self._redis.hincrby(f"warmloop:effects:{job_id}",
                                  "applied" if applied else "deduplicated", 1)
        return bool(applied)

    async def recorded(self, job_id: str, step: int) -> dict[str, Any] | None:
        """The effect recorded for (job, step), or None: a retry checks it first."""
        raw = await self._redis.get(self.key(job_id, step))
        return None if raw is None else json.loads(raw)

    async def effects(self, job_id: str) -> dict[int, dict[str, Any]]:
        """Every effect applied for ``job_id``, by step."""
        out: dict[int, dict[str, Any]] = {}
        async for key in self._redis.scan_iter(match=self.key(job_id, 0)[:-1] + "*"):
            k = key.decode() if isinstance(key, bytes) else key
            raw = await self._redis.get(k)
            if raw is not None:
                out[int(k.rsplit(":", 1)[1])] = json.loads(raw)
        return out

    async def counts(self, job_id: str) -> dict[str, int]:
        raw = await self._redis.hgetall(f"warmloop:effects:{job_id}")
        return {(k.decode() if isinstance(k, bytes) else k): int(v) for k, v in raw.items()}
