"""`make bench-gateway`: one seeded multi-turn agent workload, replayed through one
OpenAI-compatible client against the warmloop gateway and the serving peers.

The workload: agent sessions of several kinds (each kind a long system prompt and its
tool schemas, one kind carrying half the sessions), 6-10 model calls a session. Each
call after the first appends the previous assistant turn (a scripted tool call) and its
tool's result to the chat and calls the model again, after a tool pause (lognormal,
with a few of 20-60 s; ``--time-scale`` scales them all, 0.5 by default). ``--live``
sessions (30) run at once, a new one starting as one ends; the first ones start at the
steady state's gap (``--ramp-s``; 0 opens with all of them at once). The replies are
scripted, so every policy and every repeat sends the same prompts; only the routing
differs.

The policies, each from cold caches (vLLM's POST /reset_prefix_cache, a fresh router
process) and with the same requests (streamed, ``temperature`` 0, same ``max_tokens``,
the session headers on every call; only the gateway reads them):

- ``warmloop``: the gateway (``python -m warmloop.workers.gateway``), which routes by
  the prefix directory and the session and holds paused sessions' prefixes;
- ``sglang_cache_aware``: sglang-router, policy ``cache_aware``;
- ``vllm_router_cache_aware``: vllm-router, policy ``cache_aware``;
- ``round_robin``: vllm-router, policy ``round_robin`` (client-side round robin when
  vllm-router is not installed or does not start);
- ``warmloop_replicas``, only when named in ``--policies``: two gateway processes, each
  call sent to the next (a balancer without session stickiness, so a session's calls
  land on both replicas): what running replicas costs against one gateway.

Figures: hit rate and prefill tokens from the engines' own counters (vLLM /metrics;
the gateway's hold touches are counted in the prefill bill and taken out of the hit
rate, which is the workload's own), cross-checked with each response's
``usage.prompt_tokens_details.cached_tokens``; TTFT (time to the first streamed chunk)
p50/p95; session p95 (first call sent to last answer read); each engine's share of the
prompt tokens; and the block-level oracle hit rate of the prompts (tokenized by the
engine with the chat template; every full block computed once). The gateway's added
latency is measured on a quiet fleet before each repeat: interleaved 1-token calls
through the gateway and straight to the engine it chose.

Policies run interleaved, ``--repeat`` times (the order rotated each repeat); figures
are medians with ranges. The last line of output is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import importlib.util
import json
import math
import os
import random
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import redis.asyncio as aioredis
from rich.console import Console
from rich.table import Table

from bench.common import (
    BenchFleet,
    bench_settings,
    bench_stack,
    bounded_oracle_hit_rate,
    cache_geometry,
    counters_of,
    fmt_range,
    histogram_quantile_ms,
    medians_and_ranges,
    pct,
    placement_bound_hit_rate,
    reset_caches,
    rotated,
    run_main,
    scrape,
    steps_hit_rate,
)
from bench.gateway_overhead import GAP_S, WARMUP_PAIRS
from bench.synthetic_profiles import LOOKUP_KEYS, SYNTHETIC_DOMAINS, WORDS
from warmloop.activities.holds import hold_stats
from warmloop.activities.pauses import PAUSES_INDEX
from warmloop.infra.stack import settings_env
from warmloop.workers.settings import Settings
from warmloop.workflows.routing import block_hashes

POLICIES = ("warmloop", "sglang_cache_aware", "vllm_router_cache_aware", "round_robin")
PEERS = POLICIES[1:]
REPLICAS = "warmloop_replicas"
"""Not run unless named: two gateway replicas, each call to the next one (a balancer
without session stickiness: a session's calls land on both)."""
ALL_POLICIES = (*POLICIES, REPLICAS)
GATEWAY_PORT, SGLANG_PORT, VLLM_ROUTER_PORT = 8750, 8751, 8752
SECOND_GATEWAY_PORT = 8753
SESSION_HEADER, KIND_HEADER, FINAL_HEADER = "x-session-id", "x-session-kind", "x-session-final"
ENGINE_HEADER, ROUTE_HEADER = "x-warmloop-engine", "x-warmloop-route"
EST_REQUEST_S = 0.35
"""A call's time on this machine's quiet CPU engines, for the printed duration estimate."""


# ---- the workload ------------------------------------------------------------------------


@dataclass(frozen=True)
class Kind:
    """An agent kind: its system prompt and tool schemas (its sessions' shared prefix)."""

    name: str
    system: str
    tools: list[dict[str, Any]]


@dataclass(frozen=True)
class Session:
    """One scripted session: ``turns[k]`` are the messages appended before call k (the
    system prompt and the task before the first; the assistant's tool call and the tool's
    result after), ``pauses_s[k]`` the tool pause after call k (one fewer than calls)."""

    index: int
    kind: str
    turns: list[list[dict[str, Any]]]
    pauses_s: list[float]

    @property
    def calls(self) -> int:
        return len(self.turns)

    def prompts(self) -> Iterator[list[dict[str, Any]]]:
        """Each call's messages: the previous call's, plus this turn's."""
        messages: list[dict[str, Any]] = []
        for turn in self.turns:
            messages = [*messages, *turn]
            yield messages


@dataclass(frozen=True)
class Workload:
    kinds: dict[str, Kind]
    sessions: list[Session]
    time_scale: float

    @property
    def calls(self) -> int:
        return sum(s.calls for s in self.sessions)

    @property
    def pause_s(self) -> float:
        return sum(sum(s.pauses_s) for s in self.sessions)


def _words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _kind(rng: random.Random, name: str, prefix_words: tuple[int, int]) -> Kind:
    rules: list[str] = []
    left = rng.randint(*prefix_words)
    while left > 0:
        n = min(left, rng.randint(25, 40))
        rules.append(f"Rule {name[:3].upper()}-{len(rules) + 1:02d}: {_words(rng, n)}.")
        left -= n
    system = (f"You are the {name} agent. Work one case at a time, one tool call per "
              "reply, and read each result before the next call.\n\n"
              f"## Rules of the {name} desk\n" + "\n".join(rules))
    key = {"type": "string", "enum": list(LOOKUP_KEYS)}
    tools = [
        {"type": "function", "function": {
            "name": "lookup", "description": f"Look up a {name} record by key.",
            "parameters": {"type": "object", "properties": {"key": key},
                           "required": ["key"], "additionalProperties": False}}},
        {"type": "function", "function": {
            "name": "note", "description": f"Add a note to the {name} case.",
            "parameters": {"type": "object", "properties": {"text": {"type": "string"}},
                           "required": ["text"], "additionalProperties": False}}},
    ]
    return Kind(name=name, system=system, tools=tools)


def tool_pause_s(rng: random.Random, *, median_s: float, sigma: float, long_share: float,
                 long_s: tuple[float, float]) -> float:
    """One tool pause, unscaled: lognormal, or (``long_share`` of them) 20-60 s."""
    if rng.random() < long_share:
        return rng.uniform(*long_s)
    return min(rng.lognormvariate(math.log(median_s), sigma), long_s[1])


def workload(seed: int, sessions: int, *, time_scale: float = 1.0, hot_share: float = 0.5,
             prefix_words: tuple[int, int] = (1400, 2200), calls: tuple[int, int] = (6, 10),
             pause_median_s: float = 2.5, pause_sigma: float = 0.8, long_share: float = 0.08,
             long_s: tuple[float, float] = (20.0, 60.0)) -> Workload:
    """The seeded workload: one kind per synthetic domain, the first carrying
    ``hot_share`` of the sessions. Draws do not depend on ``time_scale`` (it multiplies
    the pauses) and session i is the same whatever ``sessions`` is."""
    rng = random.Random(seed)
    kinds = {d: _kind(rng, d, prefix_words) for d in SYNTHETIC_DOMAINS}
    hot, *others = kinds
    out = []
    for i in range(sessions):
        kind = hot if rng.random() < hot_share else rng.choice(others)
        n = rng.randint(*calls)
        first = [{"role": "system", "content": kinds[kind].system},
                 {"role": "user", "content": f"Case {kind[:3].upper()}-{i:04d}: "
                                             f"{_words(rng, rng.randint(30, 60))}"}]
        turns: list[list[dict[str, Any]]] = [first]
        pauses: list[float] = []
        for k in range(1, n):
            call_id = f"call_{i:04d}_{k}"
            args = json.dumps({"key": rng.choice(LOOKUP_KEYS)})
            turns.append([
                {"role": "assistant", "content": "", "tool_calls": [{
                    "id": call_id, "type": "function",
                    "function": {"name": "lookup", "arguments": args}}]},
                {"role": "tool", "tool_call_id": call_id,
                 "content": f"record {k}: {_words(rng, rng.randint(50, 150))}"},
            ])
            pauses.append(time_scale * tool_pause_s(
                rng, median_s=pause_median_s, sigma=pause_sigma, long_share=long_share,
                long_s=long_s))
        out.append(Session(index=i, kind=kind, turns=turns, pauses_s=pauses))
    return Workload(kinds=kinds, sessions=out, time_scale=time_scale)


def session_s(s: Session, request_s: float = EST_REQUEST_S) -> float:
    return sum(s.pauses_s) + s.calls * request_s


def steady_ramp_s(sessions: list[Session], live: int,
                  request_s: float = EST_REQUEST_S) -> float:
    """The gap between the first ``live`` sessions' starts that arrivals have in the
    steady state (a session ends every mean session time / ``live``), so that the run
    does not open with every slot's first call at once."""
    if not sessions:
        return 0.0
    return sum(session_s(s, request_s) for s in sessions) / len(sessions) / max(1, live)


def estimate_makespan_s(sessions: list[Session], live: int, ramp_s: float = 0.0,
                        request_s: float = EST_REQUEST_S) -> float:
    """How long the sessions take at ``live`` at once, each call ``request_s``: slot j
    opens at ``j * ramp_s``, sessions start in order on the first free slot."""
    slots = [j * ramp_s for j in range(max(1, live))]
    for s in sessions:
        i = min(range(len(slots)), key=slots.__getitem__)
        slots[i] += session_s(s, request_s)
    return max(slots)


def chat_body(kind: Kind, messages: list[dict[str, Any]], *, model: str,
              max_tokens: int) -> dict[str, Any]:
    """The call every policy gets: streamed, usage in the last chunk, greedy."""
    return {"model": model, "messages": messages, "tools": kind.tools,
            "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}


def session_headers(session_id: str, kind: str, final: bool) -> dict[str, str]:
    h = {SESSION_HEADER: session_id, KIND_HEADER: kind}
    if final:
        h[FINAL_HEADER] = "true"
    return h


# ---- the oracle --------------------------------------------------------------------------


def oracle_hit_rate(prompts: list[list[int]], block_size: int) -> float:
    """The block-level oracle: 1 - tokens that must be computed at least once / all
    prompt tokens, with every full block (a hash chain, so a block is its whole prefix)
    computed once however often it is sent, and partial last blocks every time. As
    ``bench.routing.oracle_hit_rate``."""
    total = sum(len(p) for p in prompts)
    if not total:
        return 0.0
    unique: set[str] = set()
    partial = 0
    for p in prompts:
        hashes = block_hashes(p, block_size)
        unique.update(hashes)
        partial += len(p) - len(hashes) * block_size
    return 1 - (len(unique) * block_size + partial) / total


HOLD_FIGURES = ("touches", "touch_prompt_tokens", "touch_computed_tokens", "holds",
                "released_for_room", "trimmed_for_room", "released_lost")
"""The hold statistics a run's figures take (``activities.holds.hold_stats``)."""


def served_bound(w: Workload, chains: list[dict[str, Any]], records: list[CallRecord],
                 block_size: int, fleet_blocks: int) -> float:
    """The most the fleet's pools could hit (``bounded_oracle_hit_rate``) over the calls
    in the order a run sent them. ``chains`` are the calls' prompts as ``{"tokens",
    "hashes"}``, in the workload's order: session by session, call by call."""
    return bounded_oracle_hit_rate(served_trace(w, chains, records), block_size, fleet_blocks)


def served_placement_bound(w: Workload, chains: list[dict[str, Any]],
                           records: list[CallRecord], block_size: int,
                           engine_blocks: int) -> float | None:
    """The most the run's placement allowed (``placement_bound_hit_rate``: each engine's
    own pool over the calls it served); None when a call's engine is unknown."""
    if any(r.engine is None for r in records):
        return None
    return placement_bound_hit_rate(served_trace(w, chains, records), block_size,
                                    engine_blocks)


def served_trace(w: Workload, chains: list[dict[str, Any]],
                 records: list[CallRecord]) -> list[dict[str, Any]]:
    """The calls' chains in the order the run sent them, each with its engine."""
    at: dict[tuple[int, int], int] = {}
    for s in w.sessions:
        for k in range(s.calls):
            at[(s.index, k)] = len(at)
    return [{**chains[at[(r.session, r.call)]], "engine": r.engine}
            for r in sorted(records, key=lambda r: r.sent)]


async def tokenized_prompts(http: httpx.AsyncClient, url: str, w: Workload, model: str,
                            concurrency: int = 4) -> list[list[int]]:
    """Every call's prompt as the engine tokenizes it (chat template, generation prompt)."""
    sem = asyncio.Semaphore(concurrency)

    async def one(kind: Kind, messages: list[dict[str, Any]]) -> list[int]:
        async with sem:
            r = await http.post(f"{url}/tokenize", json={
                "model": model, "messages": messages, "tools": kind.tools,
                "add_generation_prompt": True})
            r.raise_for_status()
            return [int(t) for t in r.json()["tokens"]]

    return await asyncio.gather(*(one(w.kinds[s.kind], m)
                                  for s in w.sessions for m in s.prompts()))


# ---- the routers ------------------------------------------------------------------------


class Server:
    """A router or the gateway, in its own process, for one policy's run."""

    def __init__(self, name: str, argv: list[str], url: str, log_path: Path, *,
                 ready_path: str, env: dict[str, str] | None = None,
                 ready: Callable[[httpx.Response], bool] | None = None) -> None:
        self.name, self.url = name, url
        self._argv, self._log_path, self._env = argv, log_path, env
        self._ready_path = ready_path
        self._ready = ready or (lambda r: r.status_code == 200)
        self._proc: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        self._log_path.parent.mkdir(parents=True, exist_ok=True)
        with self._log_path.open("ab") as log:
            self._proc = subprocess.Popen(self._argv, stdout=log, stderr=subprocess.STDOUT,
                                          env=self._env)

    def exited(self) -> bool:
        return self._proc is None or self._proc.poll() is not None

    def log_tail(self, lines: int = 5) -> str:
        try:
            text = self._log_path.read_text(errors="replace").strip().splitlines()
        except OSError:
            return ""
        return " | ".join(text[-lines:])[-400:]

    async def wait_ready(self, http: httpx.AsyncClient, timeout_s: float = 90) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.exited():
                raise RuntimeError(f"{self.name} exited: {self.log_tail()} "
                                   f"(log {self._log_path})")
            with contextlib.suppress(httpx.HTTPError):
                if self._ready(await http.get(self.url + self._ready_path, timeout=2)):
                    return
            await asyncio.sleep(0.25)
        raise RuntimeError(f"{self.name} not ready after {timeout_s:.0f} s "
                           f"(log {self._log_path})")

    def stop(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait(timeout=5)
        self._proc = None


def gateway_server(settings: Settings, engines: int, *, port: int = GATEWAY_PORT,
                   name: str = "gateway") -> Server:
    def ready(r: httpx.Response) -> bool:
        body = r.json() if r.status_code == 200 else {}
        return body.get("status") == "ok" and len(body.get("engines", [])) >= engines

    return Server(f"warmloop {name}", [
        sys.executable, "-m", "warmloop.workers.gateway", "--host", "127.0.0.1",
        "--port", str(port)], f"http://127.0.0.1:{port}",
        settings.state_dir / "logs" / f"{name}.log", ready_path="/health",
        env={**os.environ, **settings_env(settings)}, ready=ready)


def sglang_server(settings: Settings, urls: list[str]) -> Server:
    return Server("sglang-router", [
        sys.executable, "-m", "sglang_router.launch_router", "--host", "127.0.0.1",
        "--port", str(SGLANG_PORT), "--worker-urls", *urls, "--policy", "cache_aware",
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(SGLANG_PORT + 20000),
        "--log-level", "warn"], f"http://127.0.0.1:{SGLANG_PORT}",
        settings.state_dir / "logs" / "sglang-router.log", ready_path="/readiness")


def vllm_router_server(settings: Settings, urls: list[str], policy: str) -> Server:
    return Server(f"vllm-router ({policy})", [
        sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
        "--port", str(VLLM_ROUTER_PORT), "--worker-urls", *urls, "--policy", policy,
        "--prometheus-host", "127.0.0.1", "--prometheus-port", str(VLLM_ROUTER_PORT + 20000),
        "--log-level", "warning"], f"http://127.0.0.1:{VLLM_ROUTER_PORT}",
        settings.state_dir / "logs" / "vllm-router.log", ready_path="/readiness")


def vllm_router_missing() -> str | None:
    """Why vllm-router cannot be compared here, or None."""
    if importlib.util.find_spec("vllm_router") is None:
        return "vllm-router is not installed (pip install vllm-router==0.1.17)"
    return None


# ---- replaying -----------------------------------------------------------------------------


@dataclass
class CallRecord:
    session: int
    call: int
    sent: float
    ttft_ms: float | None = None
    done: float | None = None
    prompt_tokens: int = 0
    cached_tokens: int = 0
    engine: str | None = None
    route: str | None = None
    error: str | None = None


class Target:
    """Where calls go: one URL (a router, the gateway), or engines in turn (the
    client-side round robin)."""

    def __init__(self, urls: list[str]) -> None:
        self.urls = urls
        self._next = 0

    def url(self) -> str:
        u = self.urls[self._next % len(self.urls)]
        self._next += 1
        return u


async def stream_call(http: httpx.AsyncClient, url: str, body: dict[str, Any],
                      headers: dict[str, str], rec: CallRecord) -> None:
    """One streamed call: the first chunk's time, usage from the last, errors kept."""
    try:
        async with http.stream("POST", f"{url}/v1/chat/completions", json=body,
                               headers=headers) as r:
            rec.engine, rec.route = r.headers.get(ENGINE_HEADER), r.headers.get(ROUTE_HEADER)
            if r.status_code != 200:
                rec.error = f"{r.status_code}: {(await r.aread())[:200]!r}"
                return
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    rec.error = str(chunk["error"])[:200]
                    continue
                if rec.ttft_ms is None and chunk.get("choices"):
                    rec.ttft_ms = (time.perf_counter() - rec.sent) * 1000
                usage = chunk.get("usage")
                if usage:
                    rec.prompt_tokens = int(usage.get("prompt_tokens") or 0)
                    details = usage.get("prompt_tokens_details") or {}
                    rec.cached_tokens = int(details.get("cached_tokens") or 0)
    except (httpx.HTTPError, ValueError) as e:
        rec.error = f"{type(e).__name__}: {e}"[:200]
    finally:
        rec.done = time.perf_counter()


async def replay(http: httpx.AsyncClient, target: Target, w: Workload, *, live: int,
                 ramp_s: float, tag: str, model: str, max_tokens: int) -> list[CallRecord]:
    """Every session, ``live`` at once in the workload's order (slot j opening at
    ``j * ramp_s``), each call after its session's previous answer and pause."""
    queue = list(reversed(w.sessions))
    records: list[CallRecord] = []

    async def run(s: Session) -> None:
        kind = w.kinds[s.kind]
        for k, messages in enumerate(s.prompts()):
            rec = CallRecord(session=s.index, call=k, sent=time.perf_counter())
            records.append(rec)
            await stream_call(http, target.url(), chat_body(
                kind, messages, model=model, max_tokens=max_tokens), session_headers(
                f"{tag}-s{s.index:04d}", s.kind, final=k == s.calls - 1), rec)
            if k < len(s.pauses_s):
                await asyncio.sleep(s.pauses_s[k])

    async def slot(j: int) -> None:
        await asyncio.sleep(j * ramp_s)
        while queue:
            await run(queue.pop())

    await asyncio.gather(*(slot(j) for j in range(max(1, live))))
    return records


# ---- measuring --------------------------------------------------------------------------


@dataclass
class PolicyRun:
    policy: str
    records: list[CallRecord]
    engines: dict[str, dict[str, float]]
    """Per engine id: its counters' deltas over the run (``bench.common.COUNTERS``)."""
    touches: dict[str, dict[str, int]] = field(default_factory=dict)
    """Per engine id: the deltas of its hold statistics (the gateway's touches)."""
    makespan_s: float = 0.0
    served_by: str = ""
    gateway: dict[str, Any] | None = None
    """The gateway's own /metrics after a warmloop run (``gateway_metrics``)."""


def policy_figures(run: PolicyRun) -> dict[str, Any]:
    """One policy's figures in one repeat (the per-policy JSON object)."""
    recs = run.records
    ok = [r for r in recs if r.error is None]
    queries = sum(e["vllm:prefix_cache_queries_total"] for e in run.engines.values())
    hits = sum(e["vllm:prefix_cache_hits_total"] for e in run.engines.values())
    t = {k: sum(v.get(k, 0) for v in run.touches.values()) for k in HOLD_FIGURES}
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    per_engine = {e: max(0.0, c["vllm:prompt_tokens_total"]
                         - run.touches.get(e, {}).get("touch_prompt_tokens", 0))
                  for e, c in run.engines.items()}
    all_prompt = sum(per_engine.values())
    sessions: dict[int, list[CallRecord]] = {}
    for r in recs:
        sessions.setdefault(r.session, []).append(r)
    session_s = [max(r.done or r.sent for r in rs) - min(r.sent for r in rs)
                 for rs in sessions.values()]
    ttft = [r.ttft_ms for r in ok if r.ttft_ms is not None]
    out: dict[str, Any] = {
        # the workload's: the touches' prompts are out (``steps_hit_rate``)
        "hit_rate": round(steps_hit_rate(queries, hits, t), 4),
        "usage_hit_rate": round(cached / prompt, 4) if prompt else 0.0,
        "prefill_tokens": int(queries - hits),
        "workload_prefill_tokens": prompt - cached,
        "prompt_tokens": prompt,
        "ttft_p50_ms": round(pct(ttft, 0.5), 1),
        "ttft_p95_ms": round(pct(ttft, 0.95), 1),
        "session_p50_s": round(pct(session_s, 0.5), 2),
        "session_p95_s": round(pct(session_s, 0.95), 2),
        "makespan_s": round(run.makespan_s, 1),
        "engine_shares": {e: round(v / all_prompt, 4) if all_prompt else 0.0
                          for e, v in sorted(per_engine.items())},
        "touches": t["touches"],
        "touch_computed_tokens": t["touch_computed_tokens"],
        "holds": t["holds"],
        "holds_released_for_room": t["released_for_room"],
        "holds_trimmed_for_room": t["trimmed_for_room"],
        "holds_lost": t["released_lost"],
        "requests": len(recs),
        "errors": len(recs) - len(ok),
        "served_by": run.served_by,
    }
    if len(ok) < len(recs):  # what went wrong, so that a run's errors can be told apart
        out["error_samples"] = sorted({r.error or "" for r in recs if r.error is not None})[:3]
    routes: dict[str, int] = {}
    for r in ok:
        if r.route:
            routes[r.route] = routes.get(r.route, 0) + 1
    if routes:
        out["route_reasons"] = routes
    if run.gateway is not None:
        out["hold_decisions"] = run.gateway["hold_decisions"]
        out["learn_skipped"] = run.gateway["learn_skipped"]
        out["failovers"] = run.gateway["failovers"]
        out["sessions_moved"] = run.gateway["sessions_moved"]
        # its own time before each call left for the engine, under the run's load: the
        # part of warmloop's TTFT that no engine and no peer router adds
        out["own_added_mean_ms"] = run.gateway["own_added_mean_ms"]
    return out


_METRIC = re.compile(r'^(warmloop_gateway_[a-z_]+)(?:\{([^}]*)\})? ([0-9.eE+-]+|NaN)$')


def gateway_metrics(text: str) -> dict[str, Any]:
    """What the gateway's own /metrics says about a run: its hold decisions by action,
    prompts it did not learn, failovers, and its added latency (mean; the p50 as the
    upper bound of its histogram bucket)."""
    holds: dict[str, float] = {}
    plain: dict[str, float] = {}
    buckets: dict[float, float] = {}
    for line in text.splitlines():
        m = _METRIC.match(line.strip())
        if not m:
            continue
        name, labels, value = m.group(1), m.group(2) or "", float(m.group(3))
        if name == "warmloop_gateway_hold_decisions_total":
            action = re.search(r'action="([^"]*)"', labels)
            holds[action.group(1) if action else "?"] = value
        elif name == "warmloop_gateway_added_latency_seconds_bucket":
            le = re.search(r'le="([^"]*)"', labels)
            if le:
                buckets[float(le.group(1))] = value
        elif not labels or name.endswith("_total"):
            plain[name] = plain.get(name, 0.0) + value
    count = plain.get("warmloop_gateway_added_latency_seconds_count", 0.0)
    total = plain.get("warmloop_gateway_added_latency_seconds_sum", 0.0)
    return {
        "hold_decisions": holds,
        "learn_skipped": plain.get("warmloop_gateway_learn_skipped_total", 0.0),
        "failovers": plain.get("warmloop_gateway_failovers_total", 0.0),
        "sessions_moved": plain.get("warmloop_gateway_sessions_moved_total", 0.0),
        "own_added_mean_ms": round(1000 * total / count, 3) if count else None,
        "own_added_p50_ms": histogram_quantile_ms(buckets, {}, 0.5),
    }


async def engine_counters_by_id(http: httpx.AsyncClient, urls: list[str],
                                engine_ids: list[str]) -> dict[str, dict[str, float]]:
    pages = await scrape(http, urls)
    return {e: counters_of([p]) for e, p in zip(engine_ids, pages, strict=True)}


async def clear_gateway_learning(redis: aioredis.Redis) -> None:
    """The gateway's pause statistics (profiles ``gateway:<kind>``) go, so that every
    warmloop run learns its pauses from the same start."""
    keys = [k async for k in redis.scan_iter(match="warmloop:pauses:gateway:*")]
    if keys:
        await redis.delete(*keys)
    members = [m for m in await redis.smembers(PAUSES_INDEX)
               if (m.decode() if isinstance(m, bytes) else m).startswith("gateway:")]
    if members:
        await redis.srem(PAUSES_INDEX, *members)


async def run_policy(policy: str, target: Target, served_by: str, w: Workload, *,
                     http: httpx.AsyncClient, fleet: BenchFleet, tag: str, args: argparse.Namespace,
                     model: str, gateway_url: str | None = None) -> PolicyRun:
    before = await engine_counters_by_id(http, fleet.urls, fleet.engine_ids)
    holds_before = {e: await hold_stats(fleet.redis, e) for e in fleet.engine_ids}
    t0 = time.perf_counter()
    records = await replay(http, target, w, live=args.live, ramp_s=args.ramp_s, tag=tag,
                           model=model, max_tokens=args.max_tokens)
    makespan = time.perf_counter() - t0
    gateway = None
    if gateway_url is not None:
        await asyncio.sleep(1.0)  # the gateway's last touches and hold counts land
        gateway = gateway_metrics((await http.get(f"{gateway_url}/metrics")).text)
    after = await engine_counters_by_id(http, fleet.urls, fleet.engine_ids)
    holds_after = {e: await hold_stats(fleet.redis, e) for e in fleet.engine_ids}
    engines = {e: {k: after[e][k] - before[e][k] for k in after[e]} for e in fleet.engine_ids}
    touches = {e: {k: holds_after[e].get(k, 0) - holds_before[e].get(k, 0)
                   for k in HOLD_FIGURES}
               for e in fleet.engine_ids}
    return PolicyRun(policy=policy, records=records, engines=engines, touches=touches,
                     makespan_s=makespan, served_by=served_by, gateway=gateway)


OVERHEAD_WARMUP = WARMUP_PAIRS
"""Paired calls the overhead phase sends before it measures (``bench.gateway_overhead``'s;
3 before 2026-12-06)."""
OVERHEAD_GAP_S = GAP_S
"""The pause after each overhead call (``bench.gateway_overhead``'s; none before
2026-12-06)."""


async def measure_overhead(http: httpx.AsyncClient, gateway_url: str,
                           engine_urls: dict[str, str], *, model: str, n: int,
                           tag: str, warmup: int = OVERHEAD_WARMUP,
                           gap_s: float = OVERHEAD_GAP_S) -> dict[str, Any]:
    """The gateway's added latency on a quiet fleet: ``n`` 1-token calls through the
    gateway, each paired with the same call straight to the engine the gateway chose,
    the order alternating. The added latency is each pair's difference.

    Measured as ``bench.gateway_overhead`` measures it: ``warmup`` pairs first (a
    gateway process just started: its first calls open connections and fill caches),
    and ``gap_s`` after each call, so that no call lands on the gateway's after-call
    work for the one before (its tokenize and records, which on this 2-core host share
    the cores with the engine serving the next call: not a quiet fleet)."""
    messages = [{"role": "system", "content": "You answer in one word."},
                {"role": "user", "content": "Overhead probe: say ok."}]
    body = {"model": model, "messages": messages, "max_tokens": 1, "temperature": 0}

    async def call(url: str, headers: dict[str, str] | None = None) -> tuple[float, str | None]:
        t = time.perf_counter()
        r = await http.post(f"{url}/v1/chat/completions", json=body, headers=headers)
        r.raise_for_status()
        return (time.perf_counter() - t) * 1000, r.headers.get(ENGINE_HEADER)

    for url in engine_urls.values():  # warm: every path serves the probe from cache
        await call(url)
    first = next(iter(engine_urls))
    engine: str | None = first
    for i in range(3):
        _, engine = await call(gateway_url, session_headers(f"{tag}-warm{i}", "overhead",
                                                            final=True))
    diffs: list[float] = []
    via: list[float] = []
    direct: list[float] = []
    for i in range(warmup + n):
        headers = session_headers(f"{tag}-o{i:03d}", "overhead", final=True)
        if i % 2:
            d, _ = await call(engine_urls[engine or first])
            await asyncio.sleep(gap_s)
            g, engine = await call(gateway_url, headers)
        else:
            g, engine = await call(gateway_url, headers)
            await asyncio.sleep(gap_s)
            d, _ = await call(engine_urls[engine or first])
        await asyncio.sleep(gap_s)
        if i >= warmup:
            via.append(g)
            direct.append(d)
            diffs.append(g - d)
    return {"overhead_p50_ms": round(pct(diffs, 0.5), 2),
            "overhead_p95_ms": round(pct(diffs, 0.95), 2),
            "gateway_call_p50_ms": round(pct(via, 0.5), 2),
            "direct_call_p50_ms": round(pct(direct, 0.5), 2)}


# ---- the run ------------------------------------------------------------------------------


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    started = time.monotonic()
    w = workload(args.seed, args.sessions, time_scale=args.time_scale)
    if args.ramp_s is None:
        args.ramp_s = steady_ramp_s(w.sessions, args.live)
    est = estimate_makespan_s(w.sessions, args.live, args.ramp_s)
    console.print(
        f"workload: {len(w.sessions)} sessions ({args.live} live, the first {args.live} "
        f"starting {args.ramp_s:.2f} s apart), {w.calls} calls, "
        f"kinds {', '.join(f'{k} {sum(s.kind == k for s in w.sessions)}' for k in w.kinds)}; "
        f"tool pauses total {w.pause_s:,.0f} s at time scale {args.time_scale} "
        f"(longest {max((p for s in w.sessions for p in s.pauses_s), default=0):.1f} s): "
        f"~{est:.0f} s a policy, ~{est * len(args.policies) * args.repeat / 60:.1f} min "
        f"for {len(args.policies)} policies x {args.repeat} repeat(s)")
    settings = bench_settings("gateway", engines=2,
                              kv_cache_bytes=args.kv_cache_bytes)
    model = settings.engine_endpoints[0].model
    missing = vllm_router_missing()
    repeats: list[dict[str, Any]] = []
    call_rows: list[dict[str, Any]] = []
    run_tag = f"{int(time.time()) % 100000}"
    async with (bench_stack(settings, console, keep=args.keep_stack) as fleet,
                httpx.AsyncClient(timeout=httpx.Timeout(300.0, connect=5.0),
                                  limits=httpx.Limits(max_connections=256)) as http):
        urls = fleet.urls
        by_id = dict(zip(fleet.engine_ids, urls, strict=True))
        block_size, fleet_blocks = await cache_geometry(http, urls)
        console.print("tokenizing every call's prompt for the oracle ...")
        prompts = await tokenized_prompts(http, urls[0], w, model)
        oracle = oracle_hit_rate(prompts, block_size)
        # each call's block chain, hashed once for every repeat's bound
        chains = [{"tokens": len(p), "hashes": block_hashes(p, block_size)} for p in prompts]
        console.print(f"oracle hit rate {oracle:.4f} over {sum(map(len, prompts)):,} prompt "
                      f"tokens (block {block_size})")
        gateway = gateway_server(settings, len(urls))
        sglang = sglang_server(settings, urls)
        try:
            for rep in range(args.repeat):
                figures: dict[str, Any] = {}
                tag = f"gw{run_tag}-r{rep}"
                await reset_caches(http, urls, fleet.redis, fleet.engine_ids)
                await clear_gateway_learning(fleet.redis)
                console.print(f"repeat {rep + 1}/{args.repeat}: gateway overhead on a quiet "
                              f"fleet, {args.overhead_calls} paired calls ...")
                gateway.launch()
                try:
                    await gateway.wait_ready(http)
                    overhead = await measure_overhead(
                        http, gateway.url, by_id, model=model, n=args.overhead_calls,
                        tag=f"{tag}-oh", warmup=args.overhead_warmup,
                        gap_s=args.overhead_gap_ms / 1000)
                    own = gateway_metrics((await http.get(f"{gateway.url}/metrics")).text)
                    overhead["gateway_own_added_mean_ms"] = own["own_added_mean_ms"]
                finally:
                    gateway.stop()
                console.print(f"  added latency p50 {overhead['overhead_p50_ms']:.2f} ms, p95 "
                              f"{overhead['overhead_p95_ms']:.2f} ms (direct call p50 "
                              f"{overhead['direct_call_p50_ms']:.1f} ms; the gateway's own "
                              f"mean before sending {own['own_added_mean_ms']} ms)")
                for policy in rotated(list(args.policies), rep):
                    await reset_caches(http, urls, fleet.redis, fleet.engine_ids)
                    console.print(f"repeat {rep + 1}/{args.repeat}, policy {policy} ...")
                    server: Server | None
                    second: Server | None = None
                    if policy == "warmloop":
                        await clear_gateway_learning(fleet.redis)
                        server, served_by = gateway, "warmloop gateway"
                    elif policy == REPLICAS:
                        await clear_gateway_learning(fleet.redis)
                        server = gateway
                        second = gateway_server(settings, len(urls), port=SECOND_GATEWAY_PORT,
                                                name="gateway-2")
                        served_by = "two warmloop gateways, each call to the next (no stickiness)"
                    elif policy == "sglang_cache_aware":
                        server, served_by = sglang, "sglang-router 0.3.2, cache_aware"
                    elif missing is None:
                        p = "cache_aware" if policy == "vllm_router_cache_aware" else policy
                        server = vllm_router_server(settings, urls, p)
                        served_by = f"vllm-router 0.1.17, {p}"
                    elif policy == "round_robin":
                        server, served_by = None, f"client-side round robin ({missing})"
                    else:
                        figures[policy] = {"unavailable": missing}
                        console.print(f"  unavailable: {missing}")
                        continue
                    if server is not None:
                        server.launch()
                        try:
                            await server.wait_ready(http)
                        except RuntimeError as e:
                            server.stop()
                            if policy != "round_robin":
                                figures[policy] = {"unavailable": str(e)[:300]}
                                console.print(f"  unavailable: {e}")
                                continue
                            server = None
                            served_by = f"client-side round robin (vllm-router: {e})"[:300]
                    if second is not None:
                        second.launch()
                        try:
                            await second.wait_ready(http)
                        except RuntimeError:
                            second.stop()
                            if server is not None:
                                server.stop()
                            raise
                    target = Target([u.url for u in (server, second) if u is not None]
                                    if server is not None else urls)
                    try:
                        run = await run_policy(
                            policy, target, served_by, w, http=http, fleet=fleet,
                            tag=f"{tag}-{policy}", args=args, model=model,
                            gateway_url=gateway.url if policy in ("warmloop", REPLICAS)
                            else None)
                    finally:
                        for up in (server, second):
                            if up is not None:
                                up.stop()
                    f = figures[policy] = policy_figures(run)
                    call_rows += [{"repeat": rep, "policy": policy, **dataclasses.asdict(r)}
                                  for r in run.records]
                    if policy == "warmloop" and fleet_blocks:
                        figures["bounded_oracle_hit_rate"] = round(served_bound(
                            w, chains, run.records, block_size, fleet_blocks), 4)
                        placed = served_placement_bound(w, chains, run.records, block_size,
                                                        fleet_blocks // len(urls))
                        if placed is not None:
                            figures["placement_bound_hit_rate"] = round(placed, 4)
                    console.print(
                        f"  hit rate {f['hit_rate']:.3f} (usage {f['usage_hit_rate']:.3f}), "
                        f"prefill {f['prefill_tokens']:,}, TTFT p50/p95 "
                        f"{f['ttft_p50_ms']:.0f}/{f['ttft_p95_ms']:.0f} ms, session p95 "
                        f"{f['session_p95_s']:.1f} s, makespan {f['makespan_s']:.0f} s, "
                        f"shares {f['engine_shares']}, errors {f['errors']}"
                        + (f" ({'; '.join(f['error_samples'])})" if f.get("error_samples")
                           else "")
                        + (f", routes {f['route_reasons']}" if "route_reasons" in f else ""))
                repeats.append({"oracle_hit_rate": round(oracle, 4), **figures, **overhead})
        finally:
            gateway.stop()
            sglang.stop()
    if args.calls_json:
        args.calls_json.write_text(json.dumps(call_rows))
    medians, ranges = medians_and_ranges(repeats)
    wall = time.monotonic() - started
    report(medians, ranges, len(repeats), console)
    console.print(f"total wall time {wall / 60:.1f} min (time scale {args.time_scale}, "
                  f"tool pauses {w.pause_s:,.0f} s a policy)")
    return result_json(medians, ranges, len(repeats), args=args, wall_s=wall, w=w,
                       block_size=block_size)


def result_json(medians: dict[str, Any], ranges: dict[str, Any], n: int, *,
                args: argparse.Namespace, wall_s: float, w: Workload,
                block_size: int) -> dict[str, Any]:
    """The last line: the medians (policies keyed by name), ranges with the same keys."""
    out: dict[str, Any] = {"oracle_hit_rate": medians.get("oracle_hit_rate"),
                           "bounded_oracle_hit_rate": medians.get("bounded_oracle_hit_rate"),
                           "placement_bound_hit_rate": medians.get("placement_bound_hit_rate")}
    for p in ALL_POLICIES:
        if p in medians:
            out[p] = medians[p]
    for k in ("overhead_p50_ms", "overhead_p95_ms", "gateway_call_p50_ms",
              "direct_call_p50_ms", "gateway_own_added_mean_ms"):
        out[k] = medians.get(k)
    return {**out, "ranges": ranges, "repeats": n, "sessions": len(w.sessions),
            "live": args.live, "ramp_s": round(args.ramp_s, 3), "calls": w.calls,
            "time_scale": args.time_scale,
            "tool_pause_s": round(w.pause_s, 1), "max_tokens": args.max_tokens,
            "kv_cache_bytes": args.kv_cache_bytes, "block_size": block_size,
            "seed": args.seed, "wall_s": round(wall_s, 1)}


def best_peer(m: dict[str, Any], key: str, *, lowest: bool) -> tuple[str, float] | None:
    peers = [(p, m[p][key]) for p in PEERS
             if isinstance(m.get(p), dict) and isinstance(m[p].get(key), int | float)]
    if not peers:
        return None
    return (min if lowest else max)(peers, key=lambda x: x[1])


def report(m: dict[str, Any], rg: dict[str, Any], n: int, console: Console) -> None:
    """Every policy side by side, ratios against the best peer, and the targets."""
    oracle = m.get("oracle_hit_rate")
    bp_prefill = best_peer(m, "prefill_tokens", lowest=True)
    bp_ttft = best_peer(m, "ttft_p95_ms", lowest=True)
    bp_hit = best_peer(m, "hit_rate", lowest=False)
    table = Table(title=f"bench-gateway: medians \\[ranges] of {n} interleaved repeat(s); "
                        "engines' own counters, client-side TTFT")
    for c in ("policy", "hit rate", "vs oracle", "usage hit rate", "prefill tokens",
              "vs best peer", "TTFT p50 ms", "TTFT p95 ms", "vs best peer", "session p95 s",
              "engine shares", "errors"):
        table.add_column(c, justify="left" if c == "policy" else "right",
                         no_wrap=c in ("policy", "engine shares"))

    def cell(p: str, key: str, spec: str) -> str:
        return fmt_range(m[p][key], (rg.get(p) or {}).get(key), spec)

    for p in ALL_POLICIES:
        f = m.get(p)
        if not isinstance(f, dict):
            continue
        if "hit_rate" not in f:
            table.add_row(p, "unavailable", *[""] * 10)
            continue
        shares = " / ".join(f"{e} {v:.0%}" for e, v in (f.get("engine_shares") or {}).items())
        table.add_row(
            p, cell(p, "hit_rate", ".3f"),
            f"{f['hit_rate'] / oracle:.3f}x" if oracle else "-",
            cell(p, "usage_hit_rate", ".3f"), cell(p, "prefill_tokens", ",.0f"),
            f"{f['prefill_tokens'] / bp_prefill[1]:.2f}x" if bp_prefill and bp_prefill[1]
            else "-",
            cell(p, "ttft_p50_ms", ".0f"), cell(p, "ttft_p95_ms", ".0f"),
            f"{f['ttft_p95_ms'] / bp_ttft[1]:.2f}x" if bp_ttft and bp_ttft[1] else "-",
            cell(p, "session_p95_s", ".1f"), shares, f"{f['errors']:.0f}")
    console.print(table)
    console.print("served by: " + "; ".join(
        f"{p} = {m[p].get('served_by') or m[p].get('unavailable')}" for p in ALL_POLICIES
        if isinstance(m.get(p), dict)))
    if oracle is not None:
        console.print(f"oracle hit rate (every full block computed once): "
                      f"{fmt_range(oracle, rg.get('oracle_hit_rate'), '.4f')}")
    wl = m.get("warmloop")
    if isinstance(wl, dict) and "hit_rate" in wl:
        console.print(f"warmloop: {wl.get('touches', 0):.0f} hold touches computed "
                      f"{wl.get('touch_computed_tokens', 0):,.0f} tokens (in its prefill); "
                      f"{wl.get('holds', 0):.0f} holds, {wl.get('holds_released_for_room', 0):.0f} "
                      f"released for room, {wl.get('holds_trimmed_for_room', 0):.0f} cut short for "
                      f"room, {wl.get('holds_lost', 0):.0f} lost; "
                      f"routes {wl.get('route_reasons')}; hold decisions "
                      f"{wl.get('hold_decisions')}; prompts not learned "
                      f"{wl.get('learn_skipped', 0):.0f}; failovers {wl.get('failovers', 0):.0f}; "
                      f"its own time before sending under load, mean "
                      f"{wl.get('own_added_mean_ms')} ms")
    if m.get("overhead_p50_ms") is not None:
        console.print(
            f"gateway added latency on a quiet fleet: p50 "
            f"{fmt_range(m['overhead_p50_ms'], rg.get('overhead_p50_ms'), '.2f')} ms, p95 "
            f"{fmt_range(m['overhead_p95_ms'], rg.get('overhead_p95_ms'), '.2f')} ms "
            f"(1-token call: direct p50 {m['direct_call_p50_ms']:.1f} ms, through the "
            f"gateway {m['gateway_call_p50_ms']:.1f} ms; the gateway's own time before it "
            f"sends, mean {m.get('gateway_own_added_mean_ms')} ms)")
    two = m.get(REPLICAS)
    if isinstance(wl, dict) and "hit_rate" in wl and isinstance(two, dict) and "hit_rate" in two:
        console.print(
            f"two replicas, no stickiness, against one gateway: hit rate "
            f"{two['hit_rate']:.3f} vs {wl['hit_rate']:.3f}, prefill "
            f"{two['prefill_tokens'] / max(1, wl['prefill_tokens']):.2f}x, TTFT p95 "
            f"{two['ttft_p95_ms'] / max(1e-9, wl['ttft_p95_ms']):.2f}x; sessions moved between "
            f"replicas (the first's count) {two.get('sessions_moved', 0):.0f}")
    if not (isinstance(wl, dict) and "hit_rate" in wl):
        return
    checks = []
    if bp_prefill and bp_prefill[1]:
        checks.append(f"prefill {wl['prefill_tokens'] / bp_prefill[1]:.2f}x the best peer's "
                      f"({bp_prefill[0]}; target <= 0.70)")
    if oracle:
        checks.append(f"hit rate {wl['hit_rate'] / oracle:.3f}x oracle (target >= 0.97)")
    if bounded := m.get("bounded_oracle_hit_rate"):
        checks.append(f"{wl['hit_rate'] / bounded:.3f}x the most these pools could hit "
                      f"({bounded:.4f}, Belady's MIN on one pool the fleet's size)")
    if placed := m.get("placement_bound_hit_rate"):
        checks.append(f"{wl['hit_rate'] / placed:.3f}x the most its placement allowed "
                      f"({placed:.4f}, Belady's MIN on each engine's pool over its calls)")
    if bp_hit:
        checks.append(f"{wl['hit_rate'] / max(1e-9, bp_hit[1]):.3f}x the best peer's hit rate "
                      f"({bp_hit[0]})")
    if bp_ttft and bp_ttft[1]:
        checks.append(f"TTFT p95 {wl['ttft_p95_ms'] / bp_ttft[1]:.2f}x the best peer's "
                      f"({bp_ttft[0]}; target <= 1.00)")
    if m.get("overhead_p50_ms") is not None:
        checks.append(f"overhead p50 {m['overhead_p50_ms']:.2f} ms (target < 2)")
    console.print("targets (medians): " + "; ".join(checks))


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=60)
    p.add_argument("--live", type=int, default=30, help="sessions running at once")
    p.add_argument("--time-scale", type=float, default=0.5,
                   help="multiplies every tool pause (1.0: median 2.5 s, a few of 20-60 s; "
                        "0.5 makes the default run ~10 min here)")
    p.add_argument("--ramp-s", type=float, default=None,
                   help="gap between the first --live sessions' starts (default: the "
                        "steady state's, mean session time / --live; 0: all at once)")
    p.add_argument("--repeat", type=int, default=1,
                   help="interleaved repeats; figures are medians with ranges")
    p.add_argument("--seed", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--kv-cache-bytes", type=int, default=16 * 1024 * 1024,
                   help="KV pool per engine (2,048 bytes per token on the tiny model)")
    p.add_argument("--overhead-calls", type=int, default=100)
    p.add_argument("--overhead-warmup", type=int, default=OVERHEAD_WARMUP,
                   help="paired calls sent first in the overhead phase, not measured")
    p.add_argument("--overhead-gap-ms", type=float, default=OVERHEAD_GAP_S * 1000,
                   help="pause after each overhead call (0: back to back, the gateway's "
                   "after-call work for one call then lands on the next)")
    p.add_argument("--policies", nargs="+", default=list(POLICIES), choices=ALL_POLICIES,
                   help=f"{REPLICAS}: two gateway replicas, calls alternating (not by default)")
    p.add_argument("--keep-stack", action="store_true", help="leave the bench stack running")
    p.add_argument("--calls-json", type=Path, default=None,
                   help="write every policy's calls (session, engine, TTFT, tokens) here")
    run_main(p, main_async, argv,
             console=Console(stderr=True, width=None if sys.stderr.isatty() else 180))


if __name__ == "__main__":
    main()
