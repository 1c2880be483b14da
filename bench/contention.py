"""`make bench-contention`: the floor under any batch lane on this host.

No warmloop in the request path: raw requests straight to two vLLM engines of the
embedded stack (its workers, Temporal and the rest idle beside them). A probe, shaped
like an interactive step (a warm ~1.4k-token prefix, ~100 new tokens, priority 0, 8
output tokens), goes to engine e1 every 0.4 s, while "batch streams" (a shared prefix,
a fresh suffix, priority 10, 48 output tokens, one request after another) run:

- none (idle);
- on the other engine only (e0), 4 streams;
- on both engines, 1 stream each (what batch admission at K = 1 leaves running);
- on both engines, 4 streams each.

TTFT is the client's time to the first streamed chunk (vLLM sends it when the first
token is sampled). If one batch stream per engine already puts the probe's p95 past
2x idle, no K >= 1 meets that target here: the engines' compute processes and the rest
of the stack share the same cores. The last line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench.common import bench_settings, bench_stack, pct, run_main

WORDS = ["alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota",
         "kappa", "lambda", "mu", "nu", "xi", "omicron", "pi", "rho", "sigma", "tau"]
# (label, engines carrying batch streams, streams per engine)
SCENARIOS: list[tuple[str, tuple[int, ...], int]] = [
    ("idle", (), 0), ("batch on e0 only, 4 streams", (0,), 4),
    ("batch on both, 1 stream each", (0, 1), 1), ("batch on both, 4 streams each", (0, 1), 4)]


def text(words: int, seed: int) -> str:
    """About 2.7 tokens a word with the tiny model's tokenizer."""
    r = random.Random(seed)
    return " ".join(r.choice(WORDS) for _ in range(words))


PROBE_PREFIX, BATCH_PREFIX = text(520, 1), text(520, 2)


async def ttft_ms(http: httpx.AsyncClient, url: str, content: str, priority: int,
                  max_tokens: int) -> float:
    body = {"model": "tiny", "messages": [{"role": "user", "content": content}],
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "priority": priority, "ignore_eos": True}
    t0 = time.perf_counter()
    first: float | None = None
    async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as r:
        r.raise_for_status()
        async for line in r.aiter_lines():
            if first is None and line.startswith("data: {"):
                first = time.perf_counter()
    return ((first or time.perf_counter()) - t0) * 1000


async def batch_stream(http: httpx.AsyncClient, url: str, stop: asyncio.Event,
                       seed: int) -> None:
    i = 0
    while not stop.is_set():
        await ttft_ms(http, url, f"{BATCH_PREFIX} {text(60, seed * 100_000 + i)}", 10, 48)
        i += 1


async def probes(http: httpx.AsyncClient, url: str, seconds: float, seed: int) -> list[float]:
    tasks = []
    end = time.monotonic() + seconds
    i = 0
    while time.monotonic() < end:
        tasks.append(asyncio.ensure_future(
            ttft_ms(http, url, f"{PROBE_PREFIX} {text(40, seed + i)}", 0, 8)))
        i += 1
        await asyncio.sleep(0.4)
    return list(await asyncio.gather(*tasks))


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    settings = bench_settings("contention", engines=2,
                              kv_cache_bytes=args.kv_cache_bytes)
    results: dict[str, list[float]] = {}
    async with (bench_stack(settings, console, keep=False) as fleet,
                httpx.AsyncClient(timeout=httpx.Timeout(120.0, connect=5.0)) as http):
        urls = fleet.urls
        await ttft_ms(http, urls[1], PROBE_PREFIX, 0, 1)  # the probe's prefix is warm
        for n, (label, on, streams) in enumerate(SCENARIOS):
            stop = asyncio.Event()
            # seeds differ per scenario: no batch prompt is ever cached from an earlier one
            load = [asyncio.ensure_future(batch_stream(http, urls[e], stop,
                                                       100 * n + 10 * e + k))
                    for e in on for k in range(streams)]
            if load:
                await asyncio.sleep(2)  # the streams are under way
            results[label] = await probes(http, urls[1], args.seconds, 1_000_000 * (n + 1))
            stop.set()
            await asyncio.gather(*load)
            console.print(f"  {label}: probe TTFT p50/p95 {pct(results[label], .5):.0f}/"
                          f"{pct(results[label], .95):.0f} ms over {len(results[label])}")
    idle95 = pct(results["idle"], .95)
    table = Table(title="bench-contention: probe TTFT on e1 (raw vLLM, no warmloop)")
    for c in ("batch streams", "p50 ms", "p95 ms", "p95 / idle p95"):
        table.add_column(c, justify="right")
    for label, v in results.items():
        table.add_row(label, f"{pct(v, .5):.0f}", f"{pct(v, .95):.0f}",
                      f"{pct(v, .95) / max(1e-9, idle95):.2f}x")
    console.print(table)
    return {"probe_ttft_p50_ms": {k: round(pct(v, .5), 1) for k, v in results.items()},
            "probe_ttft_p95_ms": {k: round(pct(v, .95), 1) for k, v in results.items()},
            "probes": {k: len(v) for k, v in results.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--seconds", type=float, default=30.0, help="probing per scenario")
    p.add_argument("--kv-cache-bytes", type=int, default=24 * 1024 * 1024)
    run_main(p, main_async, argv)


if __name__ == "__main__":
    main()
