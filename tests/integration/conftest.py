"""Fixtures the real-stack tests share (the stack itself is in tests/conftest.py)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
import redis.asyncio as aioredis

from warmloop.workers.clients import build_redis
from warmloop.workers.settings import Settings


@pytest.fixture
async def redis(settings: Settings) -> AsyncIterator[aioredis.Redis]:
    """A client of the stack's Redis, built as the workers build theirs."""
    r = build_redis(settings)
    try:
        yield r
    finally:
        await r.aclose()
