"""The unit tests' throwaway redis-servers (``engine_fakes.RedisServer``) and their clients."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest
import redis.asyncio as aioredis

from tests.unit.engine_fakes import RedisServer, redis_server
from warmloop.workers.clients import build_redis
from warmloop.workers.settings import Settings


@pytest.fixture
def server() -> Iterator[RedisServer]:
    """A redis-server of the test's own, which it may kill, restart, stop and continue."""
    yield from redis_server()


@pytest.fixture
async def client(server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """The processes' own client (``build_redis``: its pool, retries and timeouts) of
    ``server``."""
    r = build_redis(Settings(redis_url=server.url))
    try:
        yield r
    finally:
        await r.aclose()


@pytest.fixture(scope="module")
def module_server() -> Iterator[RedisServer]:
    """One redis-server for a module's tests (``redis`` empties it before each)."""
    yield from redis_server()


@pytest.fixture
async def redis(module_server: RedisServer) -> AsyncIterator[aioredis.Redis]:
    """A plain client of ``module_server``, emptied first."""
    r = aioredis.Redis.from_url(module_server.url)
    await r.flushdb()
    try:
        yield r
    finally:
        await r.aclose()
