"""What an engine's shared batch slots cost a batch step: acquire + release of one
batch slot without (``shared_slots: false``) and with the Redis lease, interleaved,
against a throwaway local redis-server. ``python -m bench.batch_slots``."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import subprocess
import time

import redis.asyncio as aioredis

from bench.common import pct
from warmloop.activities.admission import BatchAdmission, SharedBatchSlots
from warmloop.infra.stack import find_redis_server
from warmloop.workflows.lanes import AdmissionConfig


async def measure(url: str, pairs: int, rounds: int) -> dict[str, dict[str, float]]:
    redis = aioredis.Redis.from_url(url)
    config = AdmissionConfig(k_start=4, k_min=4, k_max=4, idle_grow_s=3600)
    samples: dict[str, list[float]] = {"local": [], "shared": []}
    try:
        for _ in range(rounds):
            for mode, times in samples.items():
                admission = BatchAdmission(config, shared=SharedBatchSlots(
                    redis, "e0", holder="bench") if mode == "shared" else None)
                for i in range(pairs):
                    t = time.perf_counter()
                    await admission.acquire(f"job-{i}")
                    await admission.release()
                    if i >= pairs // 10:  # the first tenth warms the connection
                        times.append((time.perf_counter() - t) * 1e6)
    finally:
        await redis.aclose()
    return {m: {"p50_us": round(pct(s, 0.5), 1), "p95_us": round(pct(s, 0.95), 1)}
            for m, s in samples.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--pairs", type=int, default=2000)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = subprocess.Popen([find_redis_server(), "--bind", "127.0.0.1", "--port",
                               str(port), "--save", "", "--appendonly", "no"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:  # until it listens
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)
        out = asyncio.run(measure(f"redis://127.0.0.1:{port}/0", args.pairs, args.rounds))
    finally:
        server.kill()
        server.wait(timeout=10)
    for mode, f in out.items():
        print(f"{mode}: acquire + release p50 {f['p50_us']:.0f} us, p95 {f['p95_us']:.0f} us")
    print(json.dumps(out))


if __name__ == "__main__":
    main()
