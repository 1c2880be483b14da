"""The engines' own counters, read from their /metrics pages, and cold-cache resets:
what `warmloop replay` and the benchmarks measure a configuration with."""

from __future__ import annotations

import asyncio
import time

import httpx
import redis.asyncio as aioredis

from warmloop.activities.directory import TRACE, PrefixDirectory
from warmloop.activities.registry import parse_vllm_metrics
from warmloop.activities.routing import ROUND_ROBIN_KEY

COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total", "vllm:request_prefill_kv_computed_tokens_sum",
            "vllm:generation_tokens_total",
            # where the engine's own time went, per request: its queue and its prefill
            "vllm:request_queue_time_seconds_sum", "vllm:request_queue_time_seconds_count",
            "vllm:request_prefill_time_seconds_sum",
            # and its decode: with the prefill time per computed token, it shows engines
            # slowed by sharing the host's cores (the same tokens take longer)
            "vllm:request_decode_time_seconds_sum")


class CacheResetError(RuntimeError):
    """An engine refused POST /reset_prefix_cache (vLLM serves it only with
    VLLM_SERVER_DEV_MODE=1)."""


async def scrape(http: httpx.AsyncClient, urls: list[str]) -> list[str]:
    """Each engine's /metrics page, read once for every figure taken from it."""
    return [(await http.get(f"{u}/metrics")).text for u in urls]


def counters_of(pages: list[str]) -> dict[str, float]:
    """The engines' own counters, summed over the fleet."""
    total: dict[str, float] = dict.fromkeys(COUNTERS, 0.0)
    for page in pages:
        m = parse_vllm_metrics(page)
        for k in COUNTERS:
            total[k] += m.get(k, 0.0)
    return total


async def engine_counters(http: httpx.AsyncClient, urls: list[str]) -> dict[str, float]:
    return counters_of(await scrape(http, urls))


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def prefill_computed(d: dict[str, float]) -> int:
    """Prompt tokens the engines computed (not served from their caches)."""
    return int(d["vllm:prefix_cache_queries_total"] - d["vllm:prefix_cache_hits_total"])


async def reset_caches(http: httpx.AsyncClient, urls: list[str], redis: aioredis.Redis,
                       engine_ids: list[str]) -> None:
    """Cold caches (vLLM's POST /reset_prefix_cache, VLLM_SERVER_DEV_MODE=1) and a
    directory that knows it; ``CacheResetError`` when an engine refuses."""
    for u in urls:
        try:
            r = await http.post(f"{u}/reset_prefix_cache")
        except httpx.HTTPError as e:
            raise CacheResetError(f"{u}/reset_prefix_cache: {e}") from None
        if r.status_code != 200:
            raise CacheResetError(f"{u}/reset_prefix_cache answered {r.status_code} (vLLM "
                                  "serves it only with VLLM_SERVER_DEV_MODE=1)")
    directory = PrefixDirectory(redis)
    # The engines' AllBlocksCleared events empty the directory; wait for it to show.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all([await directory.engine_blocks(i) == 0 for i in engine_ids]):
            break
        await asyncio.sleep(0.1)
    for engine_id in engine_ids:
        await directory.clear_engine(engine_id)
    await redis.delete(TRACE, ROUND_ROBIN_KEY)
