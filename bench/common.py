"""What the benchmarks share: a stack of their own, the engines' counters, percentiles."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from rich.console import Console
from temporalio.client import Client

from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.registry import parse_vllm_metrics
from warmloop.infra.stack import Stack
from warmloop.workers.clients import connect
from warmloop.workers.settings import Settings

COUNTERS = ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total",
            "vllm:prompt_tokens_total", "vllm:request_prefill_kv_computed_tokens_sum",
            "vllm:generation_tokens_total")


def bench_settings(name: str, *, offset: int, engines: int, kv_cache_bytes: int,
                   **extra: Any) -> Settings:
    """A stack apart from `warmloop dev up`'s: its own state dir and ports (``offset``
    keeps two benches apart), small KV pools, prompt chains traced for the oracle."""
    return Settings(
        state_dir=Path(f".warmloop/bench-{name}"),
        temporal_address=f"127.0.0.1:{7300 + offset}", temporal_ui_port=7350 + offset,
        redis_url=f"redis://127.0.0.1:{6400 + offset}/0",
        s3_endpoint_url=f"http://127.0.0.1:{9020 + offset}", engine_count=engines,
        engine_base_port=8200 + offset * 10, engine_kv_events_base_port=5600 + offset * 10,
        engine_kv_cache_bytes=kv_cache_bytes, engine_max_model_len=6144,
        agent_metrics_port=None, inference_metrics_base_port=None,
        trace_prompt_chains=True, log_format="json", **extra,
    )


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


TTFT_BUCKET = "vllm:time_to_first_token_seconds_bucket"
_LE = re.compile(r'le="([^"]+)"')


def ttft_buckets_of(pages: list[str]) -> dict[float, float]:
    """The engines' own TTFT histogram (cumulative counts per upper bound, in seconds),
    summed over the fleet."""
    out: dict[float, float] = {}
    for page in pages:
        for line in page.splitlines():
            if line.startswith(TTFT_BUCKET):
                le = _LE.search(line)
                if le:
                    bound = float(le.group(1))  # "+Inf" parses as inf
                    out[bound] = out.get(bound, 0.0) + float(line.rsplit(" ", 1)[1])
    return out


def histogram_quantile_ms(after: dict[float, float], before: dict[float, float],
                          q: float) -> float | None:
    """The upper bound (ms) of the histogram bucket holding quantile ``q`` of the
    requests counted between two scrapes; None when there were none."""
    counts = sorted((b, after[b] - before.get(b, 0.0)) for b in after)
    if not counts or counts[-1][1] <= 0:
        return None
    for bound, cumulative in counts:
        if cumulative >= q * counts[-1][1]:
            return bound * 1000 if bound != float("inf") else None
    return None


def delta(after: dict[str, float], before: dict[str, float]) -> dict[str, float]:
    return {k: after[k] - before[k] for k in after}


def prefill_computed(d: dict[str, float]) -> int:
    """Prompt tokens the engines computed (not served from their caches)."""
    return int(d["vllm:prefix_cache_queries_total"] - d["vllm:prefix_cache_hits_total"])


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


async def reset_caches(http: httpx.AsyncClient, urls: list[str], redis: aioredis.Redis,
                       engine_ids: list[str]) -> None:
    """Cold caches (vLLM's POST /reset_prefix_cache, VLLM_SERVER_DEV_MODE=1) and a
    directory that knows it."""
    for u in urls:
        r = await http.post(f"{u}/reset_prefix_cache")
        r.raise_for_status()
    directory = PrefixDirectory(redis)
    # The engines' AllBlocksCleared events empty the directory; wait for it to show.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        if all([await directory.engine_blocks(e) == 0 for e in engine_ids]):
            break
        await asyncio.sleep(0.1)
    for e in engine_ids:
        await directory.clear_engine(e)
    await redis.delete("warmloop:dir:trace", "warmloop:route:rr")


def fresh_state(settings: Settings) -> None:
    """A benchmark starts from an empty Temporal database: workflows left running by an
    interrupted run would otherwise resume and load the engines. A server still running
    (a stack kept with --keep-stack) keeps its database."""
    host, port = settings.temporal_address.rsplit(":", 1)
    with socket.socket() as sock:
        sock.settimeout(0.5)
        if sock.connect_ex((host, int(port))) == 0:
            return
    for f in settings.state_dir.glob("temporal.db*"):
        f.unlink()


@dataclass(frozen=True)
class BenchFleet:
    """A running bench stack and the clients every benchmark uses."""

    client: Client
    redis: aioredis.Redis
    urls: list[str]
    engine_ids: list[str]


@contextlib.asynccontextmanager
async def bench_stack(settings: Settings, console: Console, *,
                      keep: bool) -> AsyncIterator[BenchFleet]:
    """Start the bench's own stack from an empty Temporal database; take it down after
    a run that ends normally, unless ``keep`` (a failed run leaves it up to inspect)."""
    stack = Stack(settings, log=lambda m: console.print(f"  {m}", highlight=False))
    kv = settings.engine_kv_cache_bytes or 0
    console.print(f"starting the bench stack ({settings.engine_count} engines, KV pool "
                  f"{kv // 2048:,} tokens each) ...")
    fresh_state(settings)
    await asyncio.to_thread(stack.up)
    redis = aioredis.Redis.from_url(settings.redis_url)
    try:
        yield BenchFleet(client=await connect(settings), redis=redis,
                         urls=[e.url.rstrip("/") for e in settings.engine_endpoints],
                         engine_ids=[e.id for e in settings.engine_endpoints])
    finally:
        await redis.aclose()
    if not keep:
        await asyncio.to_thread(stack.down)
