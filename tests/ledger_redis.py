"""An in-memory Redis with the commands the tool activities use (the effect ledger's
claims and counters, the hedging statistics' pipelines): for unit tests of the tool
path. The tests that prove the ledger against a real Redis are in tests/integration."""

from __future__ import annotations

import asyncio
import fnmatch
from collections.abc import AsyncIterator
from typing import Any

import redis.exceptions


class LedgerRedis:
    """The commands the ledger uses; ``down`` makes every one fail as an outage does.
    ``set`` and ``get`` yield to the event loop once, so concurrent calls interleave as
    they would over a socket."""

    def __init__(self) -> None:
        self.kv: dict[str, str] = {}
        self.hashes: dict[str, dict[str, int]] = {}
        self.sets: dict[str, set[str]] = {}
        self.down = False

    def _check(self) -> None:
        if self.down:
            raise redis.exceptions.ConnectionError("Error 111 connecting to redis:6379")

    async def set(self, key: str, value: str, nx: bool = False, **_: Any) -> bool:
        self._check()
        await asyncio.sleep(0)
        if nx and key in self.kv:
            return False
        self.kv[key] = value
        return True

    async def get(self, key: str) -> str | None:
        self._check()
        await asyncio.sleep(0)
        return self.kv.get(key)

    async def hincrby(self, key: str, field: str, n: int) -> None:
        self._check()
        h = self.hashes.setdefault(key, {})
        h[field] = h.get(field, 0) + n

    async def hgetall(self, key: str) -> dict[str, int]:
        self._check()
        return dict(self.hashes.get(key, {}))

    async def sadd(self, key: str, *members: str) -> None:
        self._check()
        self.sets.setdefault(key, set()).update(members)

    async def smembers(self, key: str) -> frozenset[str]:
        self._check()
        return frozenset(self.sets.get(key, ()))

    async def scan_iter(self, match: str) -> AsyncIterator[str]:
        self._check()
        for k in list(self.kv):
            if fnmatch.fnmatchcase(k, match):
                yield k

    def pipeline(self, transaction: bool = False) -> LedgerPipeline:
        return LedgerPipeline(self)


class LedgerPipeline:
    """Commands queued, then run in order by ``execute``."""

    def __init__(self, redis: LedgerRedis) -> None:
        self.redis = redis
        self.ops: list[tuple[str, tuple[Any, ...]]] = []

    def __getattr__(self, name: str) -> Any:
        def queue(*args: Any) -> None:
            self.ops.append((name, args))
        return queue

    async def execute(self) -> None:
        for name, args in self.ops:
            await getattr(self.redis, name)(*args)
