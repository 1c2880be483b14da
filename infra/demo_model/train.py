"""Train the demo model on CPU and export it where vLLM loads it.

Seeded and deterministic (fixed thread count, fixed step count, no time-based stops):
the same data and seed give the same weights. Loss is only on the tokens of each
step's tool call (``<tool_call>`` ... ``<|end|>``); the prompt is context, never a target.
"""

from __future__ import annotations

import json
import random
import shutil
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from warmloop.infra.demo_model.data import Transcript, read_transcripts


@dataclass(frozen=True)
class TrainConfig:
    seed: int = 0
    steps: int = 130
    lr: float = 3e-3
    warmup: int = 20
    weight_decay: float = 0.05
    batch_tokens: int = 6000
    """Job tokens per optimizer step (the shared prefix comes on top, once)."""
    full_prefix_share: float = 0.15
    """Share of batches that attend to the whole ~1,600-2,100-token system prompt and
    tools; the others see a stub of it (its first token and last ``stub_tokens``) at the
    real positions. Attention over the whole prefix is most of the cost of a step on
    CPU; the model still learns to read past it from the full batches."""
    stub_tokens: int = 48
    syntax_weight: float = 0.3
    """Loss weight of a call's punctuation and spaces (its names, ids, digits and enum
    words weigh 1): the guided-decoding grammar fixes them at serving time, so a low
    weight spends the model's capacity on its decisions."""
    context_weight: float = 0.0
    """Weight of the auxiliary loss on predicting each next token of the job's own prompt
    (task, earlier calls, tool results; not the shared system prompt): reading practice
    from every token, where the call loss teaches from a few per step. 0: calls only."""
    init_from: str | None = None
    """Continue from an exported model (a second stage with a fresh schedule and other
    batches): its tokenizer must be the one the data rebuilds."""
    hidden_size: int = 192
    intermediate_size: int = 576
    layers: int = 4
    heads: int = 6
    vocab_size: int = 4096
    threads: int = 2
    deepen_to: int | None = None
    """With ``init_from``: train a deeper sibling of that model (``model.deepened``),
    the model ladder's larger rung; it starts computing what the small one does."""
    widen_by: int = 1
    """With ``init_from``: repeat every hidden unit, head and MLP unit this many times
    (``model.widened``) before deepening; the model still computes what it did."""
    widen_noise: float = 0.01
    """Noise that lets a widened model's repeated units drift apart (``widened``'s
    ``noise``); 0 keeps them copies for ever."""
    checkpoint_every: int = 0
    """Export the model to ``<out>/checkpoint`` every this many steps (0: only at the
    end), so a long run on a shared host that is stopped still leaves a usable model."""


@dataclass
class Encoded:
    profile: str
    job: Any  # model.PackedJob
    size: int


def tokenizer_corpus(prefixes: dict[str, str], transcripts: list[Transcript]
                     ) -> Iterator[str]:
    """What the tokenizer learns merges from: the prompts as the engine sees them."""
    for _ in range(len(transcripts) // 20 + 1):
        yield from prefixes.values()
    for t in transcripts:
        yield t.trunk
        for s in t.steps:
            yield s["tail"]
            yield s["target"]


def encode(tok: Any, prefixes: dict[str, str], transcripts: list[Transcript],
           verify: int = 50, syntax_weight: float = 0.3, context_targets: bool = False
           ) -> tuple[dict[str, list[int]], list[Encoded]]:
    """Token ids of each profile's prefix and each job packed as a tree. The first
    ``verify`` jobs are checked: pieces tokenised apart equal each whole prompt."""
    from warmloop.infra.demo_model.model import pack_job

    def ids(text: str) -> list[int]:
        return list(tok(text, add_special_tokens=False)["input_ids"])

    prefix_ids = {p: ids(text) for p, text in prefixes.items()}
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    decisive = [any(ch.isalnum() for ch in piece.replace("Ġ", "")) for piece in pieces]

    def weight_of(target: list[int], i: int) -> float:
        # Punctuation and spaces of a call are fixed by the guided-decoding grammar;
        # names, ids, digits and enum words are the model's decisions.
        return 1.0 if decisive[target[i]] else syntax_weight

    out = []
    for n, t in enumerate(transcripts):
        enc = tok(t.trunk, add_special_tokens=False, return_offsets_mapping=True)
        trunk, offsets = list(enc["input_ids"]), enc["offset_mapping"]
        branches = []
        for s in t.steps:
            at = next((i for i, (a, _b) in enumerate(offsets) if a >= s["at"]), len(trunk))
            tail, target = ids(s["tail"]), ids(s["target"])
            if n < verify:
                whole = ids(prefixes[t.profile] + t.trunk[:s["at"]] + s["tail"] + s["target"])
                if whole != prefix_ids[t.profile] + trunk[:at] + tail + target:
                    raise AssertionError(f"{t.case_id}: pieces tokenise differently")
            branches.append((at, tail, target))
        job = pack_job(trunk, branches, weight_of, context_targets=context_targets)
        out.append(Encoded(t.profile, job, len(job.ids)))
    return prefix_ids, out


def train(data_dir: Path, out_dir: Path, cfg: TrainConfig,
          log: Callable[[str], None] = print) -> dict[str, Any]:
    """Train, export to ``out_dir``; returns the figures PROVENANCE.json records."""
    import torch

    from warmloop.infra.demo_model.data import dataset_sha256
    from warmloop.infra.demo_model.model import (
        DemoLlama,
        ModelConfig,
        batches,
        cosine_lr,
        deepened,
        param_count,
        train_step,
        widened,
    )
    from warmloop.infra.demo_model.tokenizer import build_tokenizer
    from warmloop.infra.stack import native_bf16

    started = time.time()
    # bfloat16 autocast only where the CPU computes it natively: elsewhere PyTorch
    # emulates it and each step is tens of times slower than in float32.
    bf16 = native_bf16()
    torch.manual_seed(cfg.seed)
    torch.set_num_threads(cfg.threads)
    torch.use_deterministic_algorithms(True)
    prefixes: dict[str, str] = json.loads((data_dir / "prefixes.json").read_text())
    transcripts = list(read_transcripts(data_dir / "train.jsonl"))
    tok = build_tokenizer(tokenizer_corpus(prefixes, transcripts), vocab_size=cfg.vocab_size)
    prefix_ids, jobs = encode(tok, prefixes, transcripts, syntax_weight=cfg.syntax_weight,
                              context_targets=cfg.context_weight > 0)
    log(f"tokenizer: {len(tok)} tokens; prefixes "
        + ", ".join(f"{p} {len(v)}" for p, v in prefix_ids.items())
        + f"; {len(jobs)} jobs, {sum(j.size for j in jobs):,} job tokens "
        f"({time.time() - started:.0f}s)")
    mcfg = ModelConfig(vocab_size=len(tok), hidden_size=cfg.hidden_size,
                       intermediate_size=cfg.intermediate_size,
                       num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads)
    model = DemoLlama(mcfg)
    if cfg.init_from:
        model = load_exported(Path(cfg.init_from), tok)
        mcfg = model.cfg
        log(f"continuing from {cfg.init_from}")
        if cfg.widen_by > 1:
            model = widened(model, cfg.widen_by, noise=cfg.widen_noise,
                            generator=torch.Generator().manual_seed(cfg.seed))
            mcfg = model.cfg
            log(f"widened {cfg.widen_by}x to hidden {mcfg.hidden_size} "
                f"(repeated units, noise {cfg.widen_noise})")
        if cfg.deepen_to:
            model = deepened(model, cfg.deepen_to)
            mcfg = model.cfg
            log(f"deepened to {cfg.deepen_to} layers (new layers start as identities)")
    log(f"model: {param_count(model):,} parameters")
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": cfg.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=cfg.lr, betas=(0.9, 0.98), eps=1e-8)
    rng = random.Random(cfg.seed if not cfg.init_from else f"{cfg.seed}-{cfg.init_from}")
    prefix_t = {p: torch.tensor(v) for p, v in prefix_ids.items()}
    queue: list[list[Encoded]] = []
    epoch = 0
    pad = int(tok.pad_token_id)
    window: list[dict[str, float]] = []
    for step in range(cfg.steps):
        if not queue:
            queue = batches(jobs, cfg.batch_tokens, rng)
            epoch += 1
        group = queue.pop()
        lr = cosine_lr(step, cfg.steps, cfg.lr, cfg.warmup)
        for g in opt.param_groups:
            g["lr"] = lr
        full = prefix_t[group[0].profile]
        p = full.shape[0]
        if rng.random() < cfg.full_prefix_share:
            pre, pre_pos = full, torch.arange(p)
        else:
            keep = torch.cat([torch.tensor([0]), torch.arange(p - cfg.stub_tokens, p)])
            pre, pre_pos = full[keep], keep
        stats = train_step(model, opt, pre, pre_pos, [e.job for e in group], pad,
                           position_offset=p, context_weight=cfg.context_weight, bf16=bf16)
        window.append(stats)
        if (step + 1) % 10 == 0 or step + 1 == cfg.steps:
            n = len(window)
            log(f"step {step + 1}/{cfg.steps} epoch {epoch} lr {lr:.2e} "
                f"loss {sum(s['loss'] for s in window) / n:.4f} "
                f"token acc {sum(s['token_acc'] for s in window) / n:.4f} "
                f"max nll {max(s['nll_max'] for s in window):.2f} "
                + (f"context loss {sum(s.get('context_loss', 0.0) for s in window) / n:.3f} "
                   if cfg.context_weight > 0 else "")
                + f"({time.time() - started:.0f}s)")
            window = []
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0 \
                and step + 1 < cfg.steps:
            export(model, tok, out_dir / "checkpoint")
            (out_dir / "checkpoint" / "PROVENANCE.json").write_text(json.dumps(
                {"checkpoint_of": str(out_dir), "steps": step + 1,
                 "model_config": asdict(mcfg), "train_config": asdict(cfg)}, indent=1) + "\n")
            log(f"checkpoint at step {step + 1}: {out_dir / 'checkpoint'}")
    wall = time.time() - started
    export(model, tok, out_dir)
    provenance = {
        "data_sha256": dataset_sha256(data_dir),
        "seed": cfg.seed, "steps": cfg.steps, "epochs_started": epoch,
        "train_config": asdict(cfg), "model_config": asdict(mcfg),
        "parameters": param_count(model),
        "train_jobs": len(jobs), "train_steps_examples": sum(len(t.steps) for t in transcripts),
        "wall_time_s": round(wall, 1),
        "torch": torch.__version__,
        "autocast": "bfloat16" if bf16 else "off (no native bfloat16 on this CPU)",
    }
    return provenance


def load_exported(model_dir: Path, tok: Any) -> Any:
    """A ``DemoLlama`` with the weights of an exported artifact (bfloat16 -> float32)."""
    from safetensors.torch import load_file
    from transformers import AutoTokenizer

    from warmloop.infra.demo_model.model import DemoLlama, ModelConfig

    theirs = AutoTokenizer.from_pretrained(model_dir)
    if theirs.get_vocab() != tok.get_vocab():
        raise ValueError(f"{model_dir} has another tokenizer than this data builds")
    prov = json.loads((model_dir / "PROVENANCE.json").read_text())
    model = DemoLlama(ModelConfig(**prov["model_config"]))
    weights = {k: v.float() for k, v in load_file(model_dir / "model.safetensors").items()
               if k != "lm_head.weight"}
    model.load_state_dict(weights)
    return model


def export(model: Any, tok: Any, out_dir: Path) -> None:
    """Save as a Hugging Face Llama in bfloat16 (what the engines serve with
    ``--dtype bfloat16``): config, safetensors, tokenizer, generation config."""
    import torch
    from transformers import GenerationConfig, LlamaForCausalLM

    if out_dir.exists():
        shutil.rmtree(out_dir)
    out_dir.mkdir(parents=True)
    hf_cfg = model.cfg.to_hf(bos=tok.bos_token_id, eos=tok.eos_token_id, pad=tok.pad_token_id)
    hf = LlamaForCausalLM(hf_cfg)
    missing, unexpected = hf.load_state_dict(model.hf_state_dict(), strict=False)
    if unexpected or [m for m in missing if "rotary" not in m]:
        raise AssertionError(f"state dict mismatch: {missing} {unexpected}")
    hf = hf.to(dtype=torch.bfloat16)  # type: ignore[call-arg]
    hf.save_pretrained(out_dir, safe_serialization=True)
    tok.save_pretrained(out_dir)
    GenerationConfig(bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
                     pad_token_id=tok.pad_token_id).save_pretrained(out_dir)  # type: ignore[call-arg]
