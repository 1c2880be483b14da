"""Measure one engine: ``warmloop calibrate ENGINE``.

A short standard load against the engine's own OpenAI-compatible API gives the figures
every policy prices it by (``warmloop.workflows.calibration.EngineCalibration``):

- prefill throughput against prompt length: one streamed request of ``n`` fresh
  tokens at a time (a random first token, so nothing is cached), time to first token
  less the fixed overhead of a 16-token request;
- decode step time against batch size: ``b`` streams at once, each generating
  ``decode_tokens`` with ``ignore_eos``, the median gap between a stream's tokens;
- the KV pool and its block size from ``vllm:cache_config_info``.

The result goes to Redis (``CALIBRATION_KEY``; the engine's inference worker reads it
and heartbeats with it) and to a JSON file. Hazard: the figures are those of the
engine as loaded *now*; calibrate an engine while it serves no other traffic, or
expect it to look slower than it is.
"""

from __future__ import annotations

import asyncio
import json
import random
import statistics
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

import httpx
import redis.asyncio as aioredis
import structlog
from redis.exceptions import RedisError

from warmloop.activities.registry import parse_cache_config
from warmloop.workflows.calibration import (
    CALIBRATION_KEY,
    DecodePoint,
    EngineCalibration,
    PrefillPoint,
    preset,
)

log = structlog.get_logger(__name__)

OVERHEAD_PROMPT_TOKENS = 16
"""The short request whose TTFT is the engine's fixed cost per step."""


@dataclass(frozen=True)
class CalibrationLoad:
    """The standard load. The defaults take about a minute on the embedded engines."""

    prompt_lengths: tuple[int, ...] = (128, 512, 1024, 2048)
    """Prompt lengths prefilled (longer than the engine's context are dropped)."""
    batch_sizes: tuple[int, ...] = (1, 2, 4, 8)
    """Concurrent streams the decode step is timed at."""
    repeats: int = 5
    """Requests per prefill point (the median is kept)."""
    decode_tokens: int = 24
    """Tokens each decode stream generates."""
    timeout_s: float = 120.0
    """Longest one request may take."""


QUICK_LOAD = CalibrationLoad(prompt_lengths=(256, 1024), batch_sizes=(1, 4), repeats=2,
                             decode_tokens=12)
"""For tests and a first look: a few seconds."""


class CalibrationError(RuntimeError):
    """The engine did not answer the standard load as an OpenAI-compatible vLLM does."""


async def measure_engine(http: httpx.AsyncClient, url: str, model: str, *,
                         engine_id: str, gpu_hour_usd: float,
                         kv_bytes_per_token: int | None = None,
                         max_model_len: int | None = None,
                         load: CalibrationLoad = CalibrationLoad(),
                         base: EngineCalibration | None = None,
                         seed: int | None = None) -> EngineCalibration:
    """Run ``load`` against the engine at ``url`` and return its calibration.

    ``base`` (default: the ``cpu-tiny`` preset) supplies what the load does not
    measure (the cached-input discount, the reference sizes, bytes of KV a token when
    ``kv_bytes_per_token`` is None)."""
    base = base or preset("cpu-tiny")
    rng = random.Random(seed)
    url = url.rstrip("/")
    block_size, capacity = await _cache_config(http, url)
    words = await _vocabulary(http, url, model)
    limit = (max_model_len or 1 << 30) - load.decode_tokens - 8
    lengths = sorted({n for n in load.prompt_lengths if OVERHEAD_PROMPT_TOKENS < n <= limit})
    if not lengths:
        raise CalibrationError(f"no prompt length of {load.prompt_lengths} fits a context "
                               f"of {max_model_len} tokens; give shorter ones")

    async def ttft(n: int) -> float:
        return await _first_token_s(http, url, model, _fresh_prompt(words, n, rng),
                                    load.timeout_s)

    await ttft(OVERHEAD_PROMPT_TOKENS)  # warm-up: the first request pays one-off costs
    # Lengths interleaved, so a burst of noise from a neighbour on the host spreads over
    # all points instead of bending one; the median of each length's repeats.
    samples: dict[int, list[float]] = {n: [] for n in [OVERHEAD_PROMPT_TOKENS, *lengths]}
    for _ in range(max(1, load.repeats)):
        for n in samples:
            samples[n].append(await ttft(n))
    medians = {n: statistics.median(ts) for n, ts in samples.items()}
    overhead, prefill = prefill_points(medians)
    decode: list[DecodePoint] = []
    slowest = 0.0
    for b in sorted(set(load.batch_sizes)):
        gaps = await asyncio.gather(*(
            _token_gaps(http, url, model, _fresh_prompt(words, OVERHEAD_PROMPT_TOKENS, rng),
                        load.decode_tokens, load.timeout_s) for _ in range(b)))
        step = statistics.median([g for gs in gaps for g in gs] or [overhead])
        slowest = max(slowest, step)  # a step with more sequences is never faster
        decode.append(DecodePoint(batch_size=b, step_s=slowest))
    # TTFT of the short request is overhead + one decode step (``ttft_seconds``)
    step_overhead = max(0.0, overhead - decode[0].step_s)
    per_token = kv_bytes_per_token or base.kv_bytes_per_token
    return base.model_copy(update={
        "model": model,
        "hardware": f"engine {engine_id} at {url}",
        "source": f"measured {engine_id} {datetime.now(UTC):%Y-%m-%d %H:%M} UTC "
                  f"(warmloop calibrate: {len(lengths)} prompt lengths x {load.repeats}, "
                  f"batches {', '.join(str(b) for b in sorted(set(load.batch_sizes)))})",
        "prefill": prefill, "decode": tuple(decode),
        "step_overhead_s": step_overhead,
        "kv_pool_blocks": max(1, capacity // block_size) if capacity else base.kv_pool_blocks,
        "block_size": block_size or base.block_size,
        "kv_bytes_per_token": per_token,
        "gpu_hour_usd": gpu_hour_usd,
        "measured_at": datetime.now(UTC).isoformat(timespec="seconds"),
    })


def prefill_points(ttft_by_length: dict[int, float]
                   ) -> tuple[float, tuple[PrefillPoint, ...]]:
    """(fixed overhead, prefill points) from median TTFTs by prompt length.

    A least-squares line ``t = a + n / r`` through all lengths gives the overhead ``a``
    (the intercept, at least 0) and the mean rate ``r``; each length's own rate is then
    ``n / (t - a)``, which keeps the measured bend with length. Hazard: one length's
    time can sit near ``a`` by noise and would give an absurd rate, so a point's time
    above the overhead is never taken below half the line's (its rate at most twice the
    mean rate)."""
    xs = sorted(ttft_by_length)
    if len(xs) < 2:
        raise CalibrationError("need TTFTs at two prompt lengths at least")
    mean_x = statistics.fmean(xs)
    mean_t = statistics.fmean(ttft_by_length[n] for n in xs)
    var = sum((n - mean_x) ** 2 for n in xs)
    slope = sum((n - mean_x) * (ttft_by_length[n] - mean_t) for n in xs) / var
    if slope <= 0:
        raise CalibrationError("TTFT did not grow with prompt length: the engine was too "
                               "busy to measure; calibrate it while it serves nothing else")
    overhead = max(0.0, mean_t - slope * mean_x)
    points = tuple(
        PrefillPoint(prompt_tokens=n,
                     tokens_per_s=n / max(ttft_by_length[n] - overhead, 0.5 * slope * n))
        for n in xs if n > OVERHEAD_PROMPT_TOKENS)
    return overhead, points


# ---- storing and reading ---------------------------------------------------------------


async def store_calibration(redis: aioredis.Redis, engine_id: str,
                            calibration: EngineCalibration) -> None:
    """Into Redis, where the engine's inference worker reads it (no expiry: a
    calibration holds until the engine is measured again)."""
    await redis.set(CALIBRATION_KEY.format(engine_id=engine_id),
                    calibration.model_dump_json())


async def read_calibration(redis: aioredis.Redis, engine_id: str) -> EngineCalibration | None:
    """The engine's stored calibration; None when there is none or it does not parse
    (a calibration written by an incompatible version is ignored, not fatal)."""
    raw = await redis.get(CALIBRATION_KEY.format(engine_id=engine_id))
    if raw is None:
        return None
    try:
        return EngineCalibration.model_validate_json(raw)
    except ValueError:
        return None


def calibration_file(state_dir: Path, engine_id: str) -> Path:
    return state_dir / "calibration" / f"{engine_id}.json"


def write_calibration_file(path: Path, calibration: EngineCalibration) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(calibration.model_dump_json(indent=2) + "\n")
    tmp.replace(path)


def read_calibration_file(path: Path) -> EngineCalibration | None:
    try:
        return EngineCalibration.model_validate_json(path.read_text())
    except (OSError, ValueError):
        return None


def summary(c: EngineCalibration) -> str:
    """A few lines for a person."""
    pre = ", ".join(f"{p.prompt_tokens}: {p.tokens_per_s:,.0f}" for p in c.prefill)
    dec = ", ".join(f"{d.batch_size}: {d.step_s * 1000:.1f} ms" for d in c.decode)
    return (f"{c.hardware} ({c.model})\n"
            f"  prefill tokens/s by prompt length  {pre}\n"
            f"  decode step by batch size          {dec}\n"
            f"  step overhead {c.step_overhead_s * 1000:.1f} ms; KV pool {c.kv_pool_blocks} "
            f"blocks of {c.block_size} ({c.kv_pool_tokens:,} tokens); "
            f"${c.gpu_hour_usd:.2f}/h\n"
            f"  source: {c.source}")


# ---- the load --------------------------------------------------------------------------


async def _cache_config(http: httpx.AsyncClient, url: str) -> tuple[int, int]:
    try:
        r = await http.get(f"{url}/metrics", timeout=10.0)
        r.raise_for_status()
    except httpx.HTTPError as e:
        raise CalibrationError(f"engine at {url} does not serve /metrics: {e}") from None
    return parse_cache_config(r.text)


async def _vocabulary(http: httpx.AsyncClient, url: str, model: str) -> list[int]:
    """Token ids of ordinary text, to build prompts of exact lengths from."""
    text = " ".join(f"item {i} costs {i * 7 % 100} units and ships on day {i % 28}"
                    for i in range(200))
    try:
        r = await http.post(f"{url}/tokenize", json={"model": model, "prompt": text},
                            timeout=30.0)
        r.raise_for_status()
        ids = [int(t) for t in r.json()["tokens"]]
    except (httpx.HTTPError, KeyError, TypeError, ValueError) as e:
        raise CalibrationError(f"engine at {url} did not tokenize: {e!r}") from None
    distinct = sorted(set(ids))
    if len(distinct) < 8:
        raise CalibrationError(f"engine at {url}: its tokenizer gave {len(distinct)} "
                               "distinct ids for the calibration text")
    return distinct


def _fresh_prompt(words: list[int], n: int, rng: random.Random) -> list[int]:
    """``n`` token ids that start unlike any earlier prompt (nothing cached)."""
    return [rng.choice(words) for _ in range(n)]


async def _first_token_s(http: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                         timeout_s: float) -> float:
    body = {"model": model, "prompt": prompt, "max_tokens": 1, "stream": True,
            "temperature": 0}
    start = time.perf_counter()
    async for _ in _tokens(http, url, body, timeout_s):
        return time.perf_counter() - start
    raise CalibrationError(f"engine at {url} streamed no token")


async def _token_gaps(http: httpx.AsyncClient, url: str, model: str, prompt: list[int],
                      tokens: int, timeout_s: float) -> list[float]:
    body = {"model": model, "prompt": prompt, "max_tokens": tokens, "min_tokens": tokens,
            "ignore_eos": True, "stream": True, "temperature": 0}
    stamps = [time.perf_counter() async for _ in _tokens(http, url, body, timeout_s)]
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]  # after the first


async def _tokens(http: httpx.AsyncClient, url: str, body: dict[str, object],
                  timeout_s: float) -> AsyncIterator[None]:
    """One timestamp-worthy event per streamed chunk that carries text."""
    try:
        async with asyncio.timeout(timeout_s):
            async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
                if r.status_code != 200:
                    raise CalibrationError(f"engine at {url} answered {r.status_code}: "
                                           f"{(await r.aread())[:200]!r}")
                async for line in r.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    chunk = json.loads(line[6:])
                    if any(c.get("text") is not None for c in chunk.get("choices") or []):
                        yield None
    except (httpx.HTTPError, TimeoutError) as e:
        raise CalibrationError(f"engine at {url} failed the standard load: {e!r}") from None


class CalibrationSource:
    """An inference worker's view of its engine's calibration: the one published in
    Redis (``warmloop calibrate``), else the file, else the engine's preset. Re-read
    every ``refresh_s``, so a new calibration reaches the heartbeat without a restart;
    a Redis outage keeps the last one."""

    def __init__(self, redis: aioredis.Redis, engine_id: str, *, preset_calibration:
                 EngineCalibration, file: Path | None = None, refresh_s: float = 5.0,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._redis, self._engine_id, self._file = redis, engine_id, file
        self._refresh_s, self._clock = refresh_s, clock
        self._read_at: float | None = None
        self.current: EngineCalibration = (
            (read_calibration_file(file) if file is not None else None) or preset_calibration)

    async def refresh(self) -> EngineCalibration:
        """The calibration now (at most one Redis read per ``refresh_s``)."""
        now = self._clock()
        if self._read_at is not None and now - self._read_at < self._refresh_s:
            return self.current
        self._read_at = now
        try:
            async with asyncio.timeout(1.0):  # beside the heartbeat: never hold it up long
                stored = await read_calibration(self._redis, self._engine_id)
        except (RedisError, OSError, TimeoutError):
            return self.current
        if stored is not None and stored != self.current:
            log.info("engine_calibration", engine=self._engine_id, source=stored.source)
            self.current = stored
        return self.current
