"""The gateway's overhead: the latency a call gains by going through `warmloop gateway`
instead of straight to its engine, on a quiet fleet.

Runs against the embedded stack (`warmloop dev up`). Starts a gateway process on a free
port (or uses ``--url``), then sends ``--requests`` pairs of the same non-streamed call
(``max_tokens=1``, temperature 0): one straight to the engine the gateway keeps the
session on, one through the gateway (the same session, so the same engine, and both
served from its prefix cache), interleaved with the order alternating so that drift on
the host falls on both alike, ``--gap-ms`` apart. ``--distinct`` ends each pair's
prompt differently, so that the gateway reuses no directory answer and tokenizes every
prompt after its call (an agent's calls). Reports direct and gateway p50/p95, the
added latency per pair (gateway minus direct, its p50/p95), and the gateway's own time
before it sends a call (its ``warmloop_gateway_added_latency_seconds`` histogram). The
last line is one JSON object.

Hazard: on the 2-core dev host the gateway shares the cores with both engines, the
stack and this client; what it adds there is CPU contention as much as its own work
(its after-call tokenize lands on the engine that serves the next call). Run it when
nothing else is (no benchmark, no test run), or read the spread."""

from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import httpx
from rich.console import Console
from rich.table import Table

from bench.common import pct
from warmloop.workers.settings import Settings

WARMUP_PAIRS = 20
"""Paired calls sent before the measured ones: a gateway just started opens its
connections and fills its caches on its first calls (bench-gateway's overhead phase
measures the same way)."""
GAP_S = 0.02
"""The pause after each call: a quiet fleet, where no call lands on the gateway's
after-call work (tokenize, records) for the one before."""

PROMPT = [{"role": "system", "content": "You are a terse assistant. " * 20},
          {"role": "user", "content": "Say one word."}]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextmanager
def gateway_process(url: str | None) -> Iterator[str]:
    """The gateway's base URL: ``url``, or a gateway started here (stopped after)."""
    if url is not None:
        yield url.rstrip("/")
        return
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "warmloop.workers.gateway", "--port",
                             str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env={**os.environ, "WARMLOOP_LOG_LEVEL": "WARNING"})
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{base}/health", timeout=1).json()["engines"]:
                    break
            except (httpx.HTTPError, ValueError):
                pass
            if time.monotonic() > deadline or proc.poll() is not None:
                raise SystemExit("the gateway did not come up (is the stack up? "
                                 "`warmloop dev up`)")
            time.sleep(0.2)
        yield base
    finally:
        proc.terminate()
        proc.wait(timeout=30)


def timed(http: httpx.Client, url: str, body: dict[str, Any],
          headers: dict[str, str]) -> tuple[float, httpx.Response]:
    started = time.perf_counter()
    r = http.post(url, json=body, headers=headers)
    elapsed = (time.perf_counter() - started) * 1000
    r.raise_for_status()
    return elapsed, r


def measure(base: str, settings: Settings, requests: int, warmup: int, gap_s: float,
            distinct: bool) -> tuple[dict[str, list[float]], str]:
    """(latencies in ms by path, the engine) for ``requests`` interleaved pairs."""
    body = {"model": "tiny", "messages": PROMPT, "max_tokens": 1, "temperature": 0}
    session = {"x-session-id": f"overhead-{uuid.uuid4().hex[:8]}"}
    with httpx.Client(timeout=60) as http:
        _, first = timed(http, f"{base}/v1/chat/completions", body, session)
        engine = first.headers["x-warmloop-engine"]
        direct_url = settings.engine(engine).url.rstrip("/") + "/v1/chat/completions"
        gateway_url = f"{base}/v1/chat/completions"
        out: dict[str, list[float]] = {"direct": [], "gateway": []}
        for i in range(warmup + requests):
            if distinct:  # a new last message each pair: nothing the gateway saw before
                body["messages"] = [*PROMPT[:-1], {"role": "user",
                                                  "content": f"Say one word. ({i})"}]
            order = [("direct", direct_url, {}), ("gateway", gateway_url, session)]
            for path, url, headers in (order if i % 2 else order[::-1]):
                ms, r = timed(http, url, body, headers)
                if path == "gateway" and r.headers["x-warmloop-engine"] != engine:
                    raise SystemExit("the gateway moved the session: the fleet is not quiet")
                if i >= warmup:
                    out[path].append(ms)
                time.sleep(gap_s)
    return out, engine


def presend_ms(base: str) -> tuple[float, float]:
    """(mean, p50 bucket bound) of the gateway's own time before sending, in ms."""
    text = httpx.get(f"{base}/metrics", timeout=5).text
    name = "warmloop_gateway_added_latency_seconds"
    total, count = _sample(text, f"{name}_sum"), _sample(text, f"{name}_count")
    buckets = [(float(le) if le != "+Inf" else float("inf"), float(n)) for le, n in
               re.findall(rf'^{name}_bucket{{le="([^"]+)"}} (\S+)$', text, re.M)]
    p50 = next((le for le, n in buckets if n >= count / 2), float("inf"))
    return (total / count * 1000 if count else 0.0), p50 * 1000


def _sample(text: str, name: str) -> float:
    m = re.search(rf"^{name} (\S+)$", text, re.M)
    if m is None:
        raise SystemExit(f"the gateway's /metrics has no {name}")
    return float(m.group(1))


def summary(lat: dict[str, list[float]], engine: str, presend: tuple[float, float],
            distinct: bool) -> dict[str, Any]:
    added = [g - d for d, g in zip(lat["direct"], lat["gateway"], strict=True)]
    return {
        "requests": len(added), "engine": engine, "distinct": distinct,
        "direct_p50_ms": round(pct(lat["direct"], 0.5), 3),
        "direct_p95_ms": round(pct(lat["direct"], 0.95), 3),
        "gateway_p50_ms": round(pct(lat["gateway"], 0.5), 3),
        "gateway_p95_ms": round(pct(lat["gateway"], 0.95), 3),
        "overhead_p50_ms": round(pct(added, 0.5), 3),
        "overhead_p95_ms": round(pct(added, 0.95), 3),
        "p50_difference_ms": round(pct(lat["gateway"], 0.5) - pct(lat["direct"], 0.5), 3),
        "gateway_presend_mean_ms": round(presend[0], 3),
        "gateway_presend_p50_bucket_ms": presend[1],
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=200, help="measured pairs")
    p.add_argument("--warmup", type=int, default=WARMUP_PAIRS,
                   help="pairs sent first, not measured")
    p.add_argument("--url", default=None, help="a running gateway (default: start one)")
    p.add_argument("--gap-ms", type=float, default=GAP_S * 1000,
                   help="pause after each call: a quiet fleet, where a call does not land "
                   "on the gateway's after-call work (tokenize, records) for the one before; "
                   "0 sends them back to back")
    p.add_argument("--distinct", action="store_true",
                   help="each pair's prompt ends differently (the same system prompt): the "
                   "gateway reuses no directory answer and tokenizes every prompt")
    args = p.parse_args(argv)
    console = Console(stderr=True)
    settings = Settings()
    with gateway_process(args.url) as base:
        lat, engine = measure(base, settings, args.requests, args.warmup, args.gap_ms / 1000,
                              args.distinct)
        out = summary(lat, engine, presend_ms(base), args.distinct)
    prompts = "a new prompt each pair" if args.distinct else "one prompt"
    table = Table("path", "p50 ms", "p95 ms", title=f"{out['requests']} non-streamed calls "
                  f"(max_tokens=1) on {engine}, interleaved, {prompts}")
    table.add_row("direct to the engine", f"{out['direct_p50_ms']:.2f}",
                  f"{out['direct_p95_ms']:.2f}")
    table.add_row("through the gateway", f"{out['gateway_p50_ms']:.2f}",
                  f"{out['gateway_p95_ms']:.2f}")
    table.add_row("added (per pair)", f"{out['overhead_p50_ms']:.2f}",
                  f"{out['overhead_p95_ms']:.2f}")
    table.add_row("gateway before sending (mean)", f"{out['gateway_presend_mean_ms']:.2f}", "")
    console.print(table)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
