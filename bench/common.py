"""What the benchmarks share: a stack of their own, the engines' counters, percentiles."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import heapq
import json
import os
import re
import signal
import socket
import statistics
import time
from collections.abc import AsyncIterator, Callable, Coroutine, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import httpx
import redis.asyncio as aioredis
from rich.console import Console
from temporalio.client import Client

from bench.plugin import PAUSES_ENV
from bench.synthetic_pauses import SyntheticPauses
from warmloop.activities.registry import parse_cache_config
from warmloop.infra.stack import Stack
from warmloop.workers.clients import connect, redis_options
from warmloop.workers.engine_metrics import (  # noqa: F401 - the benchmarks import them from here
    COUNTERS,
    counters_of,
    delta,
    engine_counters,
    prefill_computed,
    reset_caches,
    scrape,
)
from warmloop.workers.plugins import load_plugins
from warmloop.workers.settings import Settings

BENCH_MAX_MODEL_LEN = 6144
TINY_KV_BYTES_PER_TOKEN = 2048
"""The tiny model's KV cache per token (bf16, its layers and heads)."""


def min_kv_bytes(max_model_len: int = BENCH_MAX_MODEL_LEN) -> int:
    """The smallest pool an engine starts with: one max-length request plus the ~128
    tokens vLLM keeps back (a 12 MiB pool offers 6,016 tokens), with a margin."""
    return (max_model_len + 256) * TINY_KV_BYTES_PER_TOKEN


MIN_BENCH_KV_BYTES = min_kv_bytes()

BENCH_OFFSETS: dict[str, int] = {
    "routing": 0, "replay": 7, "burst": 10, "pauses": 20, "contention": 30, "faults": 40,
    "gateway": 50, "hedge": 60, "lazy-tools": 70, "hygiene": 80, "ladder-test": 95,
}
"""Each bench stack's port offset (``bench_ports``): one table, so that two benches, or a
bench and ``warmloop dev up``, never share a port (``tests/unit/test_bench_ports.py``)."""

MAX_BENCH_ENGINES = 3


def bench_ports(offset: int) -> dict[str, int]:
    """The ports of the bench stack at ``offset`` (0-99), each kind in a range of its own
    that no other offset's stack and no default port falls into. Engines and their KV
    event publishers get ``MAX_BENCH_ENGINES`` consecutive ports each."""
    if not 0 <= offset < 100:
        raise ValueError(f"bench offset {offset} is outside 0-99")
    return {"temporal": 7300 + offset, "temporal_ui": 7400 + offset, "redis": 6400 + offset,
            "s3": 9020 + offset, "inbox": 8400 + offset, "gateway": 8600 + offset,
            "engine_base": 10_000 + offset * 10, "kv_events_base": 11_000 + offset * 10}


def bench_settings(name: str, *, engines: int, kv_cache_bytes: int,
                   synthetic_pauses: SyntheticPauses | None = None,
                   max_model_len: int = BENCH_MAX_MODEL_LEN, **extra: Any) -> Settings:
    """A stack apart from `warmloop dev up`'s: its own state dir and ports (its offset in
    ``BENCH_OFFSETS`` keeps two benches apart), small KV pools, prompt chains traced for
    the oracle.

    The synthetic profiles come in as a plugin (``bench.plugin``), as a user's would;
    this process loads it too, and the stack's processes inherit the pauses."""
    if name not in BENCH_OFFSETS:
        raise ValueError(f"bench {name!r} has no port offset: add it to BENCH_OFFSETS")
    if not 1 <= engines <= MAX_BENCH_ENGINES:
        raise ValueError(f"a bench stack runs 1-{MAX_BENCH_ENGINES} engines, not {engines}")
    if kv_cache_bytes < (floor := min_kv_bytes(max_model_len)):
        # vLLM refuses a pool that cannot hold one request of max_model_len, but only
        # after minutes of start-up, from inside an engine's log
        raise ValueError(
            f"a KV pool of {kv_cache_bytes:,} bytes cannot hold one {max_model_len:,}"
            f"-token request beside vLLM's reserve: pass at least {floor:,} "
            f"(--kv-cache-bytes; {TINY_KV_BYTES_PER_TOKEN:,} bytes a token on the tiny model)")
    ports = bench_ports(BENCH_OFFSETS[name])
    os.environ[PAUSES_ENV] = (synthetic_pauses or SyntheticPauses()).model_dump_json()
    load_plugins(plugins="bench.plugin")
    return Settings(plugins="bench.plugin",
        state_dir=Path(f".warmloop/bench-{name}"),
        temporal_address=f"127.0.0.1:{ports['temporal']}",
        temporal_ui_port=ports["temporal_ui"],
        redis_url=f"redis://127.0.0.1:{ports['redis']}/0",
        s3_endpoint_url=f"http://127.0.0.1:{ports['s3']}", engine_count=engines,
        engine_base_port=ports["engine_base"],
        engine_kv_events_base_port=ports["kv_events_base"],
        engine_kv_cache_bytes=kv_cache_bytes, engine_max_model_len=max_model_len,
        agent_metrics_port=None, inference_metrics_base_port=None,
        inbox_port=ports["inbox"], approvals_url=f"http://127.0.0.1:{ports['inbox']}",
        gateway_port=ports["gateway"],
        trace_prompt_chains=True, log_format="json", **extra,
    )


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


def pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    s = sorted(values)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


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
    a run that ends normally or is stopped (Ctrl-C, SIGTERM through ``run_main``),
    unless ``keep``. A run that fails leaves it up to inspect."""
    stack = Stack(settings, log=lambda m: console.print(f"  {m}", highlight=False))
    kv = settings.engine_kv_cache_bytes or 0
    console.print(f"starting the bench stack ({settings.engine_count} engines, KV pool "
                  f"{kv // TINY_KV_BYTES_PER_TOKEN:,} tokens each) ...")
    fresh_state(settings)
    await asyncio.to_thread(stack.up)
    redis = aioredis.Redis.from_url(settings.redis_url, **redis_options(settings))
    failed = False
    try:
        yield BenchFleet(client=await connect(settings), redis=redis,
                         urls=[e.url.rstrip("/") for e in settings.engine_endpoints],
                         engine_ids=[e.id for e in settings.engine_endpoints])
    except Exception:
        failed = True  # not Ctrl-C or a cancel (BaseException): those come down too
        raise
    finally:
        try:
            await redis.aclose()
        finally:  # a second SIGTERM cancels the close; the stack still comes down
            if not (keep or failed):
                await asyncio.to_thread(stack.down)


# ---- the oracle under pressure ------------------------------------------------------------


async def cache_geometry(http: httpx.AsyncClient, urls: list[str]) -> tuple[int, int]:
    """(block size, blocks in all the engines' pools), from the first engine's cache
    config (the bench's engines are alike); (0, 0) when it does not say."""
    block_size, pool_tokens = parse_cache_config((await http.get(f"{urls[0]}/metrics")).text)
    return block_size, len(urls) * pool_tokens // block_size if block_size else 0


def bounded_oracle_hit_rate(trace: list[dict[str, Any]], block_size: int,
                            capacity_blocks: int) -> float:
    """The most any routing could hit with the fleet's pools: Belady's MIN (evict the
    block used again furthest ahead, or never) on one pool the size of all the engines'
    pools together, over the prompts in the order they were served.

    Under pressure the unbounded oracle is out of reach for anyone; this is the bound
    to judge a router against. It is an upper bound: one pool of the fleet's size can
    hold whatever the engines hold between them, and it ignores that a running
    request's blocks are pinned and that a block hits only behind a cached prefix, both
    of which only lower what real engines reach. Partial last blocks miss, as in
    ``bench.routing.oracle_hit_rate``."""
    seq = [h for t in trace for h in t["hashes"]]
    never = len(seq)
    next_use = [never] * len(seq)
    seen: dict[str, int] = {}
    for i in range(len(seq) - 1, -1, -1):
        next_use[i] = seen.get(seq[i], never)
        seen[seq[i]] = i
    cached: dict[str, int] = {}  # block -> its next use
    furthest: list[tuple[int, str]] = []  # (-next use, block); stale entries skipped
    hits = 0
    for i, h in enumerate(seq):
        if h in cached:
            hits += 1
        cached[h] = next_use[i]
        heapq.heappush(furthest, (-next_use[i], h))
        while len(cached) > capacity_blocks:
            neg, victim = heapq.heappop(furthest)
            if cached.get(victim) == -neg:
                del cached[victim]
    total = sum(t["tokens"] for t in trace)
    return hits * block_size / total if total else 0.0


def steps_hit_rate(queries: float, hits: float, touches: Mapping[str, float]) -> float:
    """The steps' hit rate from the engines' counters, which also count the touches that
    keep held prefixes warm (``touches``: the hold statistics' ``touches``,
    ``touch_prompt_tokens``, ``touch_computed_tokens``): a touch's prompt was served from
    cache but what it computed (its uncached prompt and its one output token), so take
    both out."""
    touch_hits = touches.get("touch_prompt_tokens", 0) - touches.get(
        "touch_computed_tokens", 0) + touches.get("touches", 0)
    q = queries - touches.get("touch_prompt_tokens", 0)
    return max(0.0, hits - touch_hits) / q if q > 0 else 0.0


def placement_bound_hit_rate(trace: list[dict[str, Any]], block_size: int,
                             engine_blocks: int) -> float:
    """The most a router's placement allowed: Belady's MIN on each engine's own pool
    over the prompts that engine served (the trace's ``engine``). Between
    ``bounded_oracle_hit_rate`` and this lies what the placement cost; between this and
    the hit rate reached, what the engines' LRU evicted that a perfect eviction order
    would have kept (the loss holds can recover)."""
    by_engine: dict[str, list[dict[str, Any]]] = {}
    for t in trace:
        by_engine.setdefault(t["engine"], []).append(t)
    total = sum(t["tokens"] for t in trace)
    hit_tokens = sum(bounded_oracle_hit_rate(sub, block_size, engine_blocks)
                     * sum(t["tokens"] for t in sub) for sub in by_engine.values())
    return hit_tokens / total if total else 0.0



# ---- repeats: medians and ranges ---------------------------------------------------------


def rotated(policies: list[str], repeat: int) -> list[str]:
    """The policy order of one repeat: rotated by the repeat's index, so that no policy
    always runs first (on a cold machine) or last (after the others' leftovers)."""
    k = repeat % len(policies) if policies else 0
    return policies[k:] + policies[:k]


def medians_and_ranges(runs: list[dict[str, Any]]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Fold the JSON of several repeats into (medians, ranges).

    Numbers become their median and ``[min, max]``; nested objects fold key by key;
    anything else (end states, route reasons) is kept from the last repeat and has no
    range. A key missing from some repeats folds over the repeats that have it."""
    medians: dict[str, Any] = {}
    ranges: dict[str, Any] = {}
    keys = list(dict.fromkeys(k for r in runs for k in r))
    for key in keys:
        values = [r[key] for r in runs if key in r]
        numbers = [v for v in values if isinstance(v, int | float) and not isinstance(v, bool)]
        if values and len(numbers) == len(values):
            med = statistics.median(numbers)
            medians[key] = round(med, 4) if isinstance(med, float) else med
            ranges[key] = [min(numbers), max(numbers)]
        elif values and all(isinstance(v, dict) for v in values) and _numeric_leaves(values):
            medians[key], ranges[key] = medians_and_ranges(values)
        else:
            medians[key] = values[-1] if values else None
    return medians, ranges


def _numeric_leaves(values: list[Any]) -> bool:
    return any(isinstance(x, int | float) and not isinstance(x, bool)
               for v in values for x in v.values())


def fmt_range(median: float, lo_hi: list[float] | None, spec: str = ".3f") -> str:
    """``0.887 [0.852-0.901]``: a median and its range, for the benchmarks' tables."""
    if not lo_hi or len(lo_hi) != 2 or lo_hi[0] == lo_hi[1]:
        return format(median, spec)
    return f"{format(median, spec)} [{format(lo_hi[0], spec)}–{format(lo_hi[1], spec)}]"


def policy_cell(medians: dict[str, Any], ranges: dict[str, Any], key: str, policy: str,
                spec: str = ".3f") -> str:
    """One policy's figure ``key`` as ``median [range]`` (per-policy JSON objects)."""
    return fmt_range(medians[key][policy], (ranges.get(key) or {}).get(policy), spec)


def overlaps(a: list[float] | None, b: list[float] | None) -> bool | None:
    """Whether two ranges overlap; None when either is missing."""
    if not a or not b:
        return None
    return a[0] <= b[1] and b[0] <= a[1]


async def calibrate_fleet(settings: Settings, http: httpx.AsyncClient, redis: aioredis.Redis,
                          console: Console, *, timeout_s: float = 120.0) -> dict[str, Any]:
    """``warmloop calibrate`` each engine of a bench stack (one at a time, each alone),
    publish it, and wait until every engine heartbeats with its own: the policies then
    run on measured figures. Returns what was measured, per engine, for the JSON."""
    from warmloop.activities.registry import EngineRegistry
    from warmloop.workers.calibrate import measure_engine, store_calibration, summary

    out: dict[str, Any] = {}
    for e in settings.engine_endpoints:
        base = settings.engine_calibration_base(e)
        cal = await measure_engine(http, e.url, e.model, engine_id=e.id,
                                   gpu_hour_usd=base.gpu_hour_usd, base=base,
                                   max_model_len=settings.engine_max_model_len)
        await store_calibration(redis, e.id, cal)
        console.print(summary(cal), highlight=False)
        out[e.id] = {"prefill_tokens_per_s": {p.prompt_tokens: round(p.tokens_per_s)
                                              for p in cal.prefill},
                     "decode_step_ms": {d.batch_size: round(d.step_s * 1000, 2)
                                        for d in cal.decode},
                     "step_overhead_ms": round(cal.step_overhead_s * 1000, 2),
                     "source": cal.source}
        registry = EngineRegistry(redis, ttl_s=settings.engine_ttl_s)
        deadline = time.monotonic() + timeout_s
        while not any(hb.engine_id == e.id and hb.calibration == cal
                      for hb in await registry.live()):
            if time.monotonic() > deadline:
                raise RuntimeError(f"engine {e.id}'s worker did not take its calibration "
                                   f"within {timeout_s:.0f} s")
            await asyncio.sleep(0.5)
    return out


_Out = TypeVar("_Out")


async def _cancelled_by_sigterm(coro: Coroutine[Any, Any, _Out]) -> _Out:
    """Run ``coro``; SIGTERM cancels it, as Ctrl-C does, so its ``finally`` (the bench's
    stack teardown) runs. Python would otherwise die on SIGTERM without cleaning up.
    The handler is the loop's own, not a relay to SIGINT: a bench started in the
    background (``nohup ... &``) inherits SIGINT ignored, and a relayed SIGINT would
    then do nothing."""
    task = asyncio.ensure_future(coro)
    loop = asyncio.get_running_loop()
    loop.add_signal_handler(signal.SIGTERM, task.cancel)
    try:
        return await task
    finally:
        loop.remove_signal_handler(signal.SIGTERM)


def run_main(parser: argparse.ArgumentParser,
             main_async: Callable[[argparse.Namespace, Console], Coroutine[Any, Any, _Out]],
             argv: list[str] | None = None, *, console: Console | None = None,
             prepare: Callable[[argparse.Namespace, Console], None] | None = None,
             report: Callable[[_Out, Console], Any] | None = None,
             json_default: Callable[[Any], Any] | None = None) -> Any:
    """A bench's command line: parse ``argv``, run ``main_async(args, console)`` and print
    its result as one JSON line on stdout (the line a caller parses); returns what was
    printed.

    ``console`` defaults to one on stderr (stdout keeps the JSON line alone);
    ``prepare(args, console)`` runs before the bench, ``report(result, console)`` after
    it, and gives what is printed instead of the result; ``json_default`` is
    ``json.dumps``'s ``default``."""
    args = parser.parse_args(argv)
    if console is None:
        console = Console(stderr=True)
    if prepare is not None:
        prepare(args, console)
    out: Any = asyncio.run(_cancelled_by_sigterm(main_async(args, console)))
    if report is not None:
        out = report(out, console)
    print(json.dumps(out, default=json_default), flush=True)
    return out
