"""Measure a GPU's calibration for a Llama-3.1-8B-shaped model with PyTorch alone.

Why this exists: the GPU presets in ``workflows/calibration.py`` quote NVIDIA's NIM decode
figures for the H100 and *derive* prefill from the datasheet's TFLOPS at an assumed 40 %
utilisation. When a session is lent a GPU (the ``device`` tool: one H200, PyTorch but no
vLLM and no model hub), this script checks those numbers by measurement: a forward pass of
the model's exact shapes (32 layers, hidden 4,096, 32 query / 8 KV heads of 128, MLP
14,336, vocabulary 128,256) with random bf16 weights, which costs what the real weights
cost.

- Prefill: one prompt alone, all tokens uncached, for lengths 64 to 32,768 (FlashAttention
  through ``scaled_dot_product_attention``; the GEMMs are cuBLAS, as in vLLM).
- Decode: one step for batches 1 to 256, every sequence with ``--decode-context`` tokens of
  KV, captured in a CUDA graph (as vLLM captures its decode steps). The attention is a
  dense GQA over a contiguous cache, not vLLM's paged kernel, and RMSNorm/RoPE/SiLU are
  unfused, so a step here is an upper bound on vLLM's.
- KV pool: what vLLM would get at ``gpu_memory_utilization`` 0.9: 90 % of the card minus
  the weights and the measured activation peak, in blocks of 16 tokens.

Prints a line per point and writes the figures as ``EngineCalibration`` JSON (plain dict:
the device has no pydantic; ``bench.gpu_calibrate_check`` validates it here). Runs on a
CPU with ``--tiny`` (a few-layer model) so its code is tested without a GPU.

    python3 bench/gpu_calibrate.py --out /tmp/h200.json [--budget-s 300]
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Shape:
    """A decoder-only transformer's shapes (Llama-3.1-8B's by default, from its
    config.json)."""

    layers: int = 32
    hidden: int = 4_096
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    mlp: int = 14_336
    vocab: int = 128_256

    @property
    def params(self) -> int:
        per_layer = (self.hidden * (self.heads + 2 * self.kv_heads) * self.head_dim
                     + self.heads * self.head_dim * self.hidden + 3 * self.hidden * self.mlp
                     + 2 * self.hidden)
        return self.layers * per_layer + 2 * self.vocab * self.hidden + self.hidden

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.layers * 2 * self.kv_heads * self.head_dim * dtype_bytes


TINY = Shape(layers=2, hidden=256, heads=4, kv_heads=2, head_dim=64, mlp=512, vocab=1_000)


class Model:
    """Weights in the fused layouts vLLM uses (one QKV matrix, one gate-up matrix)."""

    def __init__(self, shape: Shape, device: torch.device, dtype: torch.dtype) -> None:
        self.s = shape
        gen = torch.Generator(device=device).manual_seed(0)

        def w(*dims: int) -> torch.Tensor:
            t = torch.empty(*dims, device=device, dtype=dtype)
            return t.normal_(0.0, 0.02, generator=gen)

        q_out = (shape.heads + 2 * shape.kv_heads) * shape.head_dim
        self.embed = w(shape.vocab, shape.hidden)
        self.layers = [dict(norm1=torch.ones(shape.hidden, device=device, dtype=dtype),
                            qkv=w(shape.hidden, q_out),
                            o=w(shape.heads * shape.head_dim, shape.hidden),
                            norm2=torch.ones(shape.hidden, device=device, dtype=dtype),
                            gate_up=w(shape.hidden, 2 * shape.mlp),
                            down=w(shape.mlp, shape.hidden))
                       for _ in range(shape.layers)]
        self.norm = torch.ones(shape.hidden, device=device, dtype=dtype)
        self.lm_head = w(shape.hidden, shape.vocab)
        inv = 1.0 / (500_000.0 ** (torch.arange(0, shape.head_dim, 2, device=device,
                                                 dtype=torch.float32) / shape.head_dim))
        self.inv_freq = inv

    def rope(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        f = torch.outer(positions.float(), self.inv_freq)
        return f.cos().to(self.embed.dtype), f.sin().to(self.embed.dtype)

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        a, b = x[..., ::2], x[..., 1::2]
        return torch.cat((a * cos - b * sin, a * sin + b * cos), dim=-1)

    @staticmethod
    def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        v = x.float().pow(2).mean(-1, keepdim=True)
        return (x.float() * torch.rsqrt(v + 1e-5)).to(x.dtype) * w

    def mlp(self, h: torch.Tensor, layer: dict[str, torch.Tensor]) -> torch.Tensor:
        g, u = (h @ layer["gate_up"]).chunk(2, dim=-1)
        return (F.silu(g) * u) @ layer["down"]

    def prefill(self, tokens: torch.Tensor) -> torch.Tensor:
        """Logits of the last position of one prompt ``tokens`` [n]."""
        s = self.s
        n = tokens.shape[0]
        x = self.embed[tokens]
        cos, sin = self.rope(torch.arange(n, device=tokens.device))
        qd, kd = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for layer in self.layers:
            qkv = self.rms(x, layer["norm1"]) @ layer["qkv"]
            q = qkv[:, :qd].view(n, s.heads, s.head_dim)
            k = qkv[:, qd:qd + kd].view(n, s.kv_heads, s.head_dim)
            v = qkv[:, qd + kd:].view(n, s.kv_heads, s.head_dim)
            q, k = self.rotate(q, cos[:, None], sin[:, None]), self.rotate(k, cos[:, None],
                                                                           sin[:, None])
            a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], k.transpose(0, 1)[None],
                                               v.transpose(0, 1)[None], is_causal=True,
                                               enable_gqa=True)
            x = x + a[0].transpose(0, 1).reshape(n, qd) @ layer["o"]
            x = x + self.mlp(self.rms(x, layer["norm2"]), layer)
        return self.rms(x[-1:], self.norm) @ self.lm_head

    def prefill_on_cache(self, tokens: torch.Tensor, k_cache: list[torch.Tensor],
                         v_cache: list[torch.Tensor]) -> torch.Tensor:
        """Prefill ``tokens`` [n] after a cached prefix: each layer's cache is
        [kv_heads, cached + n, head_dim], the new K/V written into its last n slots (as
        vLLM writes into its blocks) and every new token attending to the whole of it.
        Not causal among the n new tokens: at most n^2/2 extra scores, small beside
        n x cached when the prefix is long, and the timing stays an upper bound."""
        s = self.s
        n = tokens.shape[0]
        total = k_cache[0].shape[1]
        x = self.embed[tokens]
        cos, sin = self.rope(torch.arange(total - n, total, device=tokens.device))
        qd, kd = s.heads * s.head_dim, s.kv_heads * s.head_dim
        for layer, kc, vc in zip(self.layers, k_cache, v_cache, strict=True):
            qkv = self.rms(x, layer["norm1"]) @ layer["qkv"]
            q = self.rotate(qkv[:, :qd].view(n, s.heads, s.head_dim), cos[:, None], sin[:, None])
            k = self.rotate(qkv[:, qd:qd + kd].view(n, s.kv_heads, s.head_dim), cos[:, None],
                            sin[:, None])
            kc[:, total - n:].copy_(k.transpose(0, 1))
            vc[:, total - n:].copy_(qkv[:, qd + kd:].view(n, s.kv_heads, s.head_dim)
                                    .transpose(0, 1))
            a = F.scaled_dot_product_attention(q.transpose(0, 1)[None], kc[None], vc[None],
                                               enable_gqa=True)
            x = x + a[0].transpose(0, 1).reshape(n, qd) @ layer["o"]
            x = x + self.mlp(self.rms(x, layer["norm2"]), layer)
        return self.rms(x[-1:], self.norm) @ self.lm_head

    def decode(self, tokens: torch.Tensor, k_cache: list[torch.Tensor],
               v_cache: list[torch.Tensor]) -> torch.Tensor:
        """One decode step for ``tokens`` [b], each sequence attending to its whole cache
        ([b, kv_heads, context, head_dim] per layer); the new K/V overwrite the last slot
        so the step's shapes stay fixed (graph-capturable)."""
        s = self.s
        b = tokens.shape[0]
        ctx = k_cache[0].shape[2]
        group = s.heads // s.kv_heads
        x = self.embed[tokens]
        cos, sin = self.rope(torch.full((1,), ctx - 1, device=tokens.device))
        qd, kd = s.heads * s.head_dim, s.kv_heads * s.head_dim
        scale = 1.0 / math.sqrt(s.head_dim)
        for layer, kc, vc in zip(self.layers, k_cache, v_cache, strict=True):
            qkv = self.rms(x, layer["norm1"]) @ layer["qkv"]
            q = self.rotate(qkv[:, :qd].view(b, s.heads, s.head_dim), cos, sin)
            k = self.rotate(qkv[:, qd:qd + kd].view(b, s.kv_heads, s.head_dim), cos, sin)
            kc[:, :, ctx - 1].copy_(k)
            vc[:, :, ctx - 1].copy_(qkv[:, qd + kd:].view(b, s.kv_heads, s.head_dim))
            qg = q.view(b, s.kv_heads, group, s.head_dim)
            att = torch.matmul(qg, kc.transpose(-1, -2)).float().mul_(scale).softmax(-1)
            a = torch.matmul(att.to(vc.dtype), vc).reshape(b, qd)
            x = x + a @ layer["o"]
            x = x + self.mlp(self.rms(x, layer["norm2"]), layer)
        return self.rms(x, self.norm) @ self.lm_head


def graphed(fn: Callable[[], object], device: torch.device
            ) -> tuple[Callable[[], object], bool]:
    """``fn`` replayed from a CUDA graph (warmed on a side stream first, as capture needs);
    ``fn`` itself on a CPU. Returns the callable and whether it is graphed."""
    if device.type != "cuda":
        return fn, False
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay, True


def timed(fn, device: torch.device, *, warmup: int, repeats: int) -> float:
    """Median seconds of ``fn()`` (CUDA events on a GPU, perf_counter on a CPU)."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / 1000.0)
        else:
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def compare_sim(cached_file: Path, preset_name: str) -> list[dict[str, float]]:
    """The simulator's step time (``sim/engine.py``: a decode step of the batch plus the
    new tokens at the prompt length's prefill rate) for each measured warm prefill of
    ``cached_file`` (``--cached``), by ``preset_name``'s calibration; prints the table.
    Runs here (it needs warmloop), not on the device."""
    from warmloop.sim.engine import prefill_step_seconds
    from warmloop.workflows.calibration import preset

    cal = preset(preset_name)
    rows = []
    print("| cached | new | measured ms | simulated ms | simulated / measured |")
    print("| --- | --- | --- | --- | --- |")
    for pt in json.loads(cached_file.read_text())["cached_prefill_raw"]:
        c, n = pt["cached_tokens"], pt["new_tokens"]
        sim_s = prefill_step_seconds(cal, 1, n, c + n)
        rows.append({"cached": c, "new": n, "measured_s": pt["seconds"], "simulated_s": sim_s})
        print(f"| {c:,} | {n:,} | {pt['seconds'] * 1000:.1f} | {sim_s * 1000:.1f} | "
              f"{sim_s / pt['seconds']:.2f} |")
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--compare-sim", type=Path, default=None, metavar="CACHED_JSON",
                   help="run nothing: compare the simulator's step model with a --cached "
                        "run's figures (by --preset's calibration)")
    p.add_argument("--preset", default="h200-llama-3.1-8b-bf16")
    p.add_argument("--out", type=Path, help="calibration JSON written here")
    p.add_argument("--tiny", action="store_true", help="a 2-layer model (tests, CPUs)")
    p.add_argument("--prompt-lengths", type=int, nargs="*",
                   default=[64, 256, 1_024, 2_048, 4_096, 8_192, 16_384, 32_768])
    p.add_argument("--batches", type=int, nargs="*", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--cached", type=int, nargs="*", default=[],
                   help="also time prefills of --cached-new tokens after a cached prefix of "
                        "each of these lengths (what a warm agent step costs)")
    p.add_argument("--cached-new", type=int, nargs="+", default=[64, 256, 1_024])
    p.add_argument("--decode-context", type=int, default=1_024,
                   help="KV tokens each decoding sequence attends to")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=300.0,
                   help="stop measuring new points after this long (figures so far kept)")
    p.add_argument("--compile", action="store_true",
                   help="torch.compile the decode step (fused elementwise kernels, as vLLM "
                        "compiles its model); prefill stays eager")
    p.add_argument("--graph-prefill-max", type=int, default=512,
                   help="prompts up to this long are replayed from a CUDA graph (vLLM "
                        "captures batches up to 512 tokens)")
    p.add_argument("--gpu-hour-usd", type=float, default=3.50,
                   help="assumed price of the card an hour (not measured)")
    args = p.parse_args(argv)
    if args.compare_sim is not None:
        compare_sim(args.compare_sim, args.preset)
        return 0
    if args.out is None:
        p.error("--out is required (or --compare-sim)")

    t_start = time.monotonic()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    shape = TINY if args.tiny else Shape()
    torch.backends.cuda.matmul.allow_tf32 = True
    name = torch.cuda.get_device_name(0) if device.type == "cuda" else "cpu"
    total_mem = torch.cuda.get_device_properties(0).total_memory if device.type == "cuda" else 0
    print(f"device {name}, {total_mem / 2**30:.1f} GiB, torch {torch.__version__}, "
          f"model {shape}, {shape.params / 1e9:.2f}e9 parameters", flush=True)
    model = Model(shape, device, dtype)
    if device.type == "cuda":
        torch.cuda.synchronize()
    weights_bytes = shape.params * (2 if dtype == torch.bfloat16 else 4)
    print(f"weights built in {time.monotonic() - t_start:.1f} s", flush=True)

    result: dict = {}
    prefill_fn = model.prefill
    decode_fn = torch.compile(model.decode, dynamic=True) if args.compile else model.decode

    def over_budget() -> bool:
        return time.monotonic() - t_start > args.budget_s

    prefill_points = []
    act_peak = 0
    with torch.inference_mode():
        for n in sorted(args.prompt_lengths):
            if over_budget():
                print(f"budget spent: prefill stops before {n}", flush=True)
                break
            tokens = torch.randint(0, shape.vocab, (n,), device=device)
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            reps = args.repeats if n <= 8_192 else max(2, args.repeats // 2)
            run: Callable[[], object] = partial(prefill_fn, tokens)
            is_graphed = False
            if n <= args.graph_prefill_max:
                run, is_graphed = graphed(run, device)
            sec = timed(run, device, warmup=2, repeats=reps)
            if device.type == "cuda":
                act_peak = max(act_peak, torch.cuda.max_memory_allocated() - weights_bytes)
            tps = n / sec
            tflops = 2 * shape.params * n / sec / 1e12
            print(f"prefill {n:>6} tokens: {sec * 1000:8.2f} ms, {tps:12,.0f} tokens/s, "
                  f"{tflops:6.1f} TFLOP/s on the matrices (attention not counted)"
                  f"{' (CUDA graph)' if is_graphed else ''}", flush=True)
            prefill_points.append({"prompt_tokens": n, "tokens_per_s": round(tps, 1),
                                   "seconds": round(sec, 6), "linear_tflops": round(tflops, 1)})
            result["prefill_raw"] = prefill_points
            _write(args.out, result)

        kv_dtype_bytes = 2 if dtype == torch.bfloat16 else 4
        cached_points = []
        for c in sorted(args.cached):
            for n in sorted(args.cached_new):
                if over_budget():
                    break
                kc = [torch.randn(shape.kv_heads, c + n, shape.head_dim, device=device,
                                  dtype=dtype) for _ in range(shape.layers)]
                vc = [torch.randn_like(k) for k in kc]
                tokens = torch.randint(0, shape.vocab, (n,), device=device)
                warm_run: Callable[[], object] = partial(model.prefill_on_cache, tokens, kc, vc)
                is_graphed = False
                if n <= args.graph_prefill_max:
                    warm_run, is_graphed = graphed(warm_run, device)
                sec = timed(warm_run, device, warmup=2, repeats=args.repeats)
                print(f"prefill {n:>6} new tokens on {c:>6} cached: {sec * 1000:8.2f} ms, "
                      f"{n / sec:12,.0f} new tokens/s{' (CUDA graph)' if is_graphed else ''}",
                      flush=True)
                cached_points.append({"cached_tokens": c, "new_tokens": n,
                                      "seconds": round(sec, 6),
                                      "new_tokens_per_s": round(n / sec, 1)})
                result["cached_prefill_raw"] = cached_points
                _write(args.out, result)
                del kc, vc

        decode_points = []
        if args.batches:  # no decode cache for a prefill-only run
            max_b = max(args.batches)
            ctx = args.decode_context
            kv_alloc_bytes = 2 * shape.layers * max_b * shape.kv_heads * ctx * shape.head_dim \
                * kv_dtype_bytes
            print(f"decode cache {kv_alloc_bytes / 2**30:.1f} GiB for batch {max_b} x {ctx} "
                  "tokens", flush=True)
            k_full = [torch.randn(max_b, shape.kv_heads, ctx, shape.head_dim, device=device,
                                  dtype=dtype) for _ in range(shape.layers)]
            v_full = [torch.randn_like(k) for k in k_full]
            for b in sorted(args.batches):
                if over_budget():
                    print(f"budget spent: decode stops before batch {b}", flush=True)
                    break
                kc = [k[:b] for k in k_full]
                vc = [v[:b] for v in v_full]
                tokens = torch.randint(0, shape.vocab, (b,), device=device)
                decode_fn(tokens, kc, vc)  # compiles here when --compile (not timed)
                step, is_graphed = graphed(partial(decode_fn, tokens, kc, vc), device)
                sec = timed(step, device, warmup=3, repeats=max(10, args.repeats * 4))
                print(f"decode batch {b:>4}: {sec * 1000:8.3f} ms a step, {b / sec:10,.0f} "
                      f"tokens/s{' (CUDA graph)' if is_graphed else ''}", flush=True)
                decode_points.append({"batch_size": b, "step_s": round(sec, 6)})
                result["decode_raw"] = decode_points
                _write(args.out, result)
            del k_full, v_full

    kv_tok = shape.kv_bytes_per_token(kv_dtype_bytes)
    if device.type == "cuda":
        free_for_kv = total_mem * 0.9 - weights_bytes - act_peak
        blocks = max(1, int(free_for_kv // (kv_tok * 16)))
    else:
        blocks = 64
    if not prefill_points or not decode_points:
        print("no calibration: it needs prefill and decode points", flush=True)
        return 0
    # The calibration schema wants step time never falling with batch: smooth noise up.
    steps, monotone = [], 0.0
    for d in decode_points:
        monotone = max(monotone, d["step_s"])
        steps.append({"batch_size": d["batch_size"], "step_s": monotone})
    when = dt.datetime.now(dt.UTC).replace(microsecond=0).isoformat()
    result.update({
        "calibration": {
            "model": "meta-llama/Llama-3.1-8B-Instruct" if not args.tiny else "tiny-random",
            "hardware": f"1x {name}, {'bf16' if dtype == torch.bfloat16 else 'fp32'}",
            "source": (f"measured {when} by bench/gpu_calibrate.py: PyTorch {torch.__version__} "
                       "forward of the model's shapes with random weights (no vLLM on the "
                       "device): prefill one prompt alone, decode a "
                       f"{'torch.compile-d, ' if args.compile else ''}CUDA-graphed step at "
                       f"{ctx} tokens of context with dense GQA attention (an upper bound on "
                       "vLLM's paged step); KV pool = 90 % of memory - weights - measured "
                       f"activation peak; price assumed (${args.gpu_hour_usd}/h)"),
            "prefill": [{"prompt_tokens": d["prompt_tokens"], "tokens_per_s": d["tokens_per_s"]}
                        for d in prefill_points],
            "decode": steps,
            "step_overhead_s": 0.005,
            "kv_pool_blocks": blocks, "block_size": 16, "kv_bytes_per_token": kv_tok,
            "gpu_hour_usd": args.gpu_hour_usd, "max_batch": 256, "max_batched_tokens": 8_192,
            "measured_at": when,
        },
        "weights_bytes": weights_bytes, "activation_peak_bytes": int(act_peak),
        "total_memory_bytes": int(total_mem), "elapsed_s": round(time.monotonic() - t_start, 1),
    })
    _write(args.out, result)
    print(json.dumps({k: v for k, v in result.items() if k != "calibration"}), flush=True)
    print(f"kv pool {blocks} blocks of 16 = {blocks * 16:,} tokens; written {args.out}",
          flush=True)
    return 0


def _write(path: Path, result: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1))
    tmp.replace(path)


if __name__ == "__main__":
    sys.exit(main())
