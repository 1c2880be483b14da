"""The network: a Llama (RMSNorm, rotary positions, SwiGLU, tied embeddings) written out
in plain torch with Hugging Face's parameter names, so the trained weights load into
``LlamaForCausalLM`` and vLLM unchanged, and packed batches for training on CPU.

Why not ``LlamaForCausalLM`` itself for training: two things make CPU training ~10x
cheaper and need control over attention.

- Every job of a profile starts with the same ~1,500-2,000-token prefix (system prompt
  and tools). A batch computes it once and every job attends to its keys and values.
- A job's steps share their history: step k's prompt is step k-1's plus one call and
  its result, then a new budget tail. A job is packed as one *tree*: the trunk (task and
  transcript) once, and each step's tail and target as a branch that sees the trunk up
  to where the step branches off, at the positions it has in the real prompt.

``hf_logits_match`` checks the two implementations agree.
"""

from __future__ import annotations

import math
import random
from dataclasses import asdict, dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ModelConfig:
    vocab_size: int
    hidden_size: int = 256
    intermediate_size: int = 768
    num_hidden_layers: int = 4
    num_attention_heads: int = 8
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    def to_hf(self, *, bos: int, eos: int, pad: int) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(**{k: v for k, v in asdict(self).items()},
                           num_key_value_heads=self.num_attention_heads,
                           max_position_embeddings=32768, tie_word_embeddings=True,
                           bos_token_id=bos, eos_token_id=eos, pad_token_id=pad,
                           hidden_act="silu", attention_bias=False, mlp_bias=False)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = x.dtype
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.to(dtype)


def rope(cfg: ModelConfig, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin for ``positions`` (any shape), as Hugging Face's default rotary."""
    d = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.float32,
                                                 device=positions.device) / d))
    freqs = positions.float().unsqueeze(-1) * inv
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return (x * cos + rotated * sin).to(x.dtype)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.cfg = cfg
        self.q_proj = nn.Linear(h, h, bias=False)
        self.k_proj = nn.Linear(h, h, bias=False)
        self.v_proj = nn.Linear(h, h, bias=False)
        self.o_proj = nn.Linear(h, h, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                mask: torch.Tensor | None, past: tuple[torch.Tensor, torch.Tensor] | None
                ) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor]]:
        b, n, _ = x.shape
        nh, hd = self.cfg.num_attention_heads, self.cfg.head_dim
        q = self.q_proj(x).view(b, n, nh, hd).transpose(1, 2)
        k = self.k_proj(x).view(b, n, nh, hd).transpose(1, 2)
        v = self.v_proj(x).view(b, n, nh, hd).transpose(1, 2)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # [b, 1, n, hd]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        own = (k, v)
        if past is not None:
            pk, pv = past
            k = torch.cat([pk.expand(b, -1, -1, -1), k], dim=2)
            v = torch.cat([pv.expand(b, -1, -1, -1), v], dim=2)
        if mask is None:
            out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        else:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o_proj(out.transpose(1, 2).reshape(b, n, nh * hd)), own


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.up_proj = nn.Linear(cfg.hidden_size, cfg.intermediate_size, bias=False)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class Body(nn.Module):
    """``model.*`` of ``LlamaForCausalLM``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([Layer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class DemoLlama(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = Body(cfg)
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        if isinstance(m, nn.Linear | nn.Embedding):
            nn.init.normal_(m.weight, std=0.02)

    def hidden(self, ids: torch.Tensor, positions: torch.Tensor, mask: torch.Tensor | None,
               past: list[tuple[torch.Tensor, torch.Tensor]] | None = None
               ) -> tuple[torch.Tensor, list[tuple[torch.Tensor, torch.Tensor]]]:
        """Final hidden states of ``ids`` [b, n], and each layer's keys and values.
        ``mask`` [b, 1, n, p + n] (True: may attend), or None for plain causal without
        ``past``; ``past``: per layer [1, heads, p, head_dim] shared by the batch."""
        x = self.model.embed_tokens(ids)
        cos, sin = rope(self.cfg, positions)
        kvs = []
        for i, layer in enumerate(self.model.layers):
            assert isinstance(layer, Layer)
            a, kv = layer.self_attn(layer.input_layernorm(x), cos, sin, mask,
                                    None if past is None else past[i])
            x = x + a
            x = x + layer.mlp(layer.post_attention_layernorm(x))
            kvs.append(kv)
        return self.model.norm(x), kvs

    def logits(self, h: torch.Tensor) -> torch.Tensor:
        return h @ self.model.embed_tokens.weight.T

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        sd = {k: v.detach().clone() for k, v in self.state_dict().items()}
        sd["lm_head.weight"] = sd["model.embed_tokens.weight"]
        return sd


def deepened(model: DemoLlama, layers: int) -> DemoLlama:
    """A deeper sibling that computes exactly what ``model`` does: its layers keep their
    weights, spread evenly, and each new layer starts with zero output projections
    (``o_proj``, ``down_proj``), so it adds nothing to the residual stream until
    training moves it. The model ladder's larger model starts as good as the small one
    and costs more per token; training then has to earn the difference."""
    old = list(model.model.layers)
    if layers < len(old):
        raise ValueError(f"deepen to {layers} layers: the model already has {len(old)}")
    cfg = ModelConfig(**{**asdict(model.cfg), "num_hidden_layers": layers})
    big = DemoLlama(cfg)
    big.model.embed_tokens.load_state_dict(model.model.embed_tokens.state_dict())
    big.model.norm.load_state_dict(model.model.norm.state_dict())
    # old layer i goes to slot round(i * layers / len(old)); the others are new
    keep = {round(i * layers / len(old)): layer for i, layer in enumerate(old)}
    for slot, layer in enumerate(big.model.layers):
        assert isinstance(layer, Layer)
        if slot in keep:
            layer.load_state_dict(keep[slot].state_dict())
        else:
            nn.init.zeros_(layer.self_attn.o_proj.weight)
            nn.init.zeros_(layer.mlp.down_proj.weight)
    return big


def widened(model: DemoLlama, factor: int = 2, noise: float = 0.0,
            generator: torch.Generator | None = None) -> DemoLlama:
    """A ``factor`` times wider sibling that computes what ``model`` does (Net2WiderNet
    for this Llama): every hidden unit, attention head and MLP unit is repeated
    ``factor`` times; the embedding is scaled by ``1 / factor`` so the residual stream
    is ``[x/f, ..., x/f]``, whose RMS norm (with ``eps / f**2``) is ``x``'s; a
    projection that reads repeated units divides its weights by ``factor``, and one that
    writes the residual stream by ``factor`` once more. The tied output head then gives
    the same logits.

    Hazard: repeated units get identical gradients and stay copies for ever, so a
    widened model that is to learn more than the narrow one needs ``noise`` (the std
    of Gaussian noise added to every weight matrix, relative to the matrix's std)."""
    if factor < 1:
        raise ValueError(f"widen by {factor}: the factor must be at least 1")
    c = model.cfg
    cfg = ModelConfig(**{**asdict(c), "hidden_size": c.hidden_size * factor,
                         "intermediate_size": c.intermediate_size * factor,
                         "num_attention_heads": c.num_attention_heads * factor,
                         # RMS of the stream is 1/f of the narrow one's: eps scales too
                         "rms_norm_eps": c.rms_norm_eps / factor ** 2})
    wide = DemoLlama(cfg)
    f = float(factor)

    def reads(w: torch.Tensor) -> torch.Tensor:
        """[out, in] -> [out * f, in * f]: outputs repeated, inputs read from copies."""
        return w.repeat(factor, factor) / f

    def jitter(w: torch.Tensor) -> torch.Tensor:
        if noise <= 0:
            return w
        return w + torch.randn(w.shape, generator=generator) * (noise * float(w.std()))

    old_layers, new_layers = list(model.model.layers), list(wide.model.layers)
    with torch.no_grad():
        wide.model.embed_tokens.weight.copy_(
            jitter(model.model.embed_tokens.weight.repeat(1, factor) / f))
        wide.model.norm.weight.copy_(model.model.norm.weight.repeat(factor))
        for old, new in zip(old_layers, new_layers, strict=True):
            assert isinstance(old, Layer) and isinstance(new, Layer)
            new.input_layernorm.weight.copy_(old.input_layernorm.weight.repeat(factor))
            new.post_attention_layernorm.weight.copy_(
                old.post_attention_layernorm.weight.repeat(factor))
            for name in ("q_proj", "k_proj", "v_proj"):
                getattr(new.self_attn, name).weight.copy_(
                    jitter(reads(getattr(old.self_attn, name).weight)))
            # writes the residual stream, which carries x / f in each copy
            new.self_attn.o_proj.weight.copy_(jitter(reads(old.self_attn.o_proj.weight) / f))
            new.mlp.gate_proj.weight.copy_(jitter(reads(old.mlp.gate_proj.weight)))
            new.mlp.up_proj.weight.copy_(jitter(reads(old.mlp.up_proj.weight)))
            new.mlp.down_proj.weight.copy_(jitter(reads(old.mlp.down_proj.weight) / f))
    return wide


# ---- packing ----------------------------------------------------------------------------


@dataclass
class PackedJob:
    """One job as a tree: trunk tokens, then each step's branch (tail + target)."""

    ids: list[int]
    positions: list[int]
    parent: list[int]
    """Per token: how many trunk tokens it sees (the trunk: all before it, causally)."""
    branch: list[int]
    """Per token: -1 on the trunk, else the index of its branch."""
    targets: list[int]
    """Per token: the next token to predict from it, or -1 (no loss)."""
    weights: list[float]
    """Per token: the weight of its target in the call loss (0: not a call token)."""
    context: list[bool] | None = None
    """Per token: its target is the next prompt token (the auxiliary context loss)."""


def pack_job(trunk: list[int], branches: list[tuple[int, list[int], list[int]]],
             weight_of: Any = None, *, context_targets: bool = False) -> PackedJob:
    """``branches``: (trunk tokens the step sees, tail ids, target ids). With
    ``context_targets`` each trunk token also predicts the next trunk token (the task,
    earlier calls and tool results), for ``packed_loss``'s context term."""
    ids, pos, parent, branch, targets, weights, context = [], [], [], [], [], [], []
    for i, t in enumerate(trunk):
        ids.append(t)
        pos.append(i)
        parent.append(i + 1)
        branch.append(-1)
        lm = context_targets and i + 1 < len(trunk)
        targets.append(trunk[i + 1] if lm else -1)
        weights.append(0.0)
        context.append(lm)
    for bi, (at, tail, target) in enumerate(branches):
        seq = tail + target
        for j, t in enumerate(seq):
            ids.append(t)
            pos.append(at + j)
            parent.append(at)
            branch.append(bi)
            nxt = j + 1 - len(tail)  # index into target of the token this one predicts
            context.append(False)
            if 0 <= nxt < len(target):
                targets.append(target[nxt])
                weights.append(1.0 if weight_of is None else weight_of(target, nxt))
            else:
                targets.append(-1)
                weights.append(0.0)
    return PackedJob(ids, pos, parent, branch, targets, weights,
                     context if context_targets else None)


class Sized(Protocol):
    """A packed job as ``batches`` sees it (``train.Encoded``; the GPU bench's jobs)."""

    @property
    def profile(self) -> Any: ...
    @property
    def size(self) -> int: ...


_Sized = TypeVar("_Sized", bound=Sized)


def batches(jobs: list[_Sized], budget: int, rng: random.Random) -> list[list[_Sized]]:
    """Jobs of one profile per batch, similar lengths together, ``budget`` tokens each."""
    out = []
    for profile in sorted({j.profile for j in jobs}):
        mine = [j for j in jobs if j.profile == profile]
        rng.shuffle(mine)
        # sort within windows of 64 jobs: little padding, still shuffled across windows
        for w in range(0, len(mine), 64):
            window = sorted(mine[w:w + 64], key=lambda j: j.size)
            cur: list[_Sized] = []
            for j in window:
                if cur and (len(cur) + 1) * max(j.size, cur[-1].size) > budget:
                    out.append(cur)
                    cur = []
                cur.append(j)
            if cur:
                out.append(cur)
    rng.shuffle(out)
    return out


PACKED_FIELDS = ("ids", "positions", "parent", "branch", "targets", "weights")
"""The per-token fields of a ``PackedJob`` a batch is built from (and ``context``)."""


def batch_tensors(jobs: list[PackedJob], prefix_len: int, pad_id: int,
                  position_offset: int | None = None) -> dict[str, torch.Tensor]:
    """Tensors for a batch of packed jobs after a shared prefix of ``prefix_len`` tokens
    whose last one sits at position ``position_offset - 1`` (default: ``prefix_len``),
    on the host: ``FlatJobs`` over these jobs alone (one tree-mask rule for the CPU
    trainer and the GPU bench)."""
    fields: dict[str, Any] = {f: [x for j in jobs for x in getattr(j, f)]
                              for f in PACKED_FIELDS}
    if any(j.context is not None for j in jobs):
        fields["context"] = [x for j in jobs
                             for x in (j.context if j.context is not None
                                       else [False] * len(j.ids))]
    flat = FlatJobs(fields, [len(j.ids) for j in jobs], torch.device("cpu"))
    return flat.batch(list(range(len(jobs))), prefix_len, pad_id, position_offset)


def packed_loss(model: DemoLlama, prefix_ids: torch.Tensor, prefix_positions: torch.Tensor,
                batch: dict[str, torch.Tensor], context_weight: float = 0.0
                ) -> tuple[torch.Tensor, dict[str, float]]:
    """Weighted cross-entropy on the call targets of a batch that shares ``prefix_ids``
    (at ``prefix_positions``: the whole prefix, or a stub of it at its real positions),
    plus ``context_weight`` times the mean cross-entropy of the context targets (the
    next prompt token, where ``pack_job`` set them): a from-scratch model learns to read
    the task and tool results from every token of them, not only from the calls."""
    _, past = model.hidden(prefix_ids.unsqueeze(0), prefix_positions.unsqueeze(0), None)
    h, _ = model.hidden(batch["ids"], batch["positions"], batch["mask"], past)
    ctx_sel = batch["context"]
    sel = (batch["targets"] >= 0) & ~ctx_sel
    logits = model.logits(h[sel]).float()
    tgt = batch["targets"][sel]
    w = batch["weights"][sel]
    ce = F.cross_entropy(logits, tgt, reduction="none")
    loss = (ce * w).sum() / w.sum().clamp_min(1e-6)
    stats = {}
    if context_weight > 0 and bool(ctx_sel.any()):
        ctx_ce = F.cross_entropy(model.logits(h[ctx_sel]).float(), batch["targets"][ctx_sel])
        loss = loss + context_weight * ctx_ce
        stats["context_loss"] = float(ctx_ce.detach())
    with torch.no_grad():
        correct = (logits.argmax(-1) == tgt).float()
    return loss, {"loss": float(loss.detach()), "tokens": float(sel.sum()),
                  "token_acc": float(correct.mean()), "nll_max": float(ce.detach().max()), **stats}


class FlatJobs:
    """Packed jobs as flat tensors on one device, whose batches are gathered there.

    Why: building each batch's tree mask job by job on the host cost 146 ms a step for
    12,000 tokens, more than a GPU's step itself; here a batch is a few gathers and one
    broadcast comparison on the device (the GPU bench keeps every job there;
    ``batch_tensors`` makes one of a batch's jobs on the host)."""

    def __init__(self, fields: dict[str, Any], lengths: Any, device: torch.device) -> None:
        """``fields``: ``PACKED_FIELDS`` of every job, concatenated (arrays or tensors),
        and optionally ``context``; ``lengths``: each job's token count, in order."""
        def flat(name: str, dtype: torch.dtype) -> torch.Tensor:
            return torch.as_tensor(fields[name]).to(device=device, dtype=dtype)

        self.ids = flat("ids", torch.long)
        self.positions = flat("positions", torch.long)
        self.parent = flat("parent", torch.long)
        self.branch = flat("branch", torch.long)
        self.targets = flat("targets", torch.long)
        self.weights = flat("weights", torch.float32)
        self.context = flat("context", torch.bool) if "context" in fields else None
        self.lengths = [int(n) for n in lengths]
        ends = torch.cumsum(torch.as_tensor(self.lengths, dtype=torch.long), 0)
        self.starts = (ends - torch.as_tensor(self.lengths, dtype=torch.long)).to(device)
        self.device = device

    def batch(self, rows: list[int], prefix_len: int, pad_id: int,
              position_offset: int | None = None) -> dict[str, torch.Tensor]:
        """The batch of the jobs at ``rows``, after a shared prefix of ``prefix_len``
        tokens whose last one sits at position ``position_offset - 1`` (default:
        ``prefix_len``): ids, positions, the tree mask [b, 1, n, prefix_len + n],
        targets, weights and context, padded to the longest job."""
        offset = prefix_len if position_offset is None else position_offset
        dev = self.device
        n = max(self.lengths[r] for r in rows)
        b = len(rows)
        lengths = torch.as_tensor([self.lengths[r] for r in rows], device=dev)
        ar = torch.arange(n, device=dev)
        valid = ar.unsqueeze(0) < lengths.unsqueeze(1)
        at = torch.where(valid, self.starts[torch.as_tensor(rows, device=dev)]
                         .unsqueeze(1) + ar.unsqueeze(0), 0)
        ids = torch.where(valid, self.ids[at], pad_id)
        pos = torch.where(valid, self.positions[at], 0) + offset
        targets = torch.where(valid, self.targets[at], -1)
        weights = torch.where(valid, self.weights[at], 0.0)
        parent = torch.where(valid, self.parent[at], 0)
        branch = torch.where(valid, self.branch[at], -2)  # -2: padding, on no branch
        # [b, query, key], as batch_tensors: trunk keys before the query's parent point,
        # and its own branch's keys up to itself
        sees_trunk = ((branch == -1).unsqueeze(1)
                      & (ar.view(1, 1, n) < parent.unsqueeze(2)))
        own = ((branch.unsqueeze(1) == branch.unsqueeze(2)) & (branch.unsqueeze(2) >= 0)
               & (ar.view(1, 1, n) <= ar.view(1, n, 1)))
        mask = torch.cat([torch.ones((b, n, prefix_len), dtype=torch.bool, device=dev),
                          sees_trunk | own], dim=2).unsqueeze(1)
        context = (torch.where(valid, self.context[at], False) if self.context is not None
                   else torch.zeros((b, n), dtype=torch.bool, device=dev))
        return {"ids": ids, "positions": pos, "mask": mask, "targets": targets,
                "weights": weights, "context": context}


def optimizer_step(model: DemoLlama, opt: torch.optim.Optimizer, prefix_ids: torch.Tensor,
                   prefix_positions: torch.Tensor, batch: dict[str, torch.Tensor], *,
                   context_weight: float = 0.0, bf16: bool = False) -> dict[str, float]:
    """One optimizer step on a batch already on the prefix's device: ``packed_loss``
    (bfloat16 autocast when ``bf16``), gradients clipped to 1."""
    dev = prefix_ids.device
    with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=bf16):
        loss, stats = packed_loss(model, prefix_ids, prefix_positions, batch, context_weight)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    opt.step()
    return stats


def train_step(model: DemoLlama, opt: torch.optim.Optimizer, prefix_ids: torch.Tensor,
               prefix_positions: torch.Tensor, jobs: list[PackedJob], pad_id: int, *,
               position_offset: int, context_weight: float = 0.0,
               bf16: bool = False) -> dict[str, float]:
    """``optimizer_step`` on a batch of packed jobs built on the host (``batch_tensors``)
    and moved to the prefix's device: the CPU trainer's step."""
    dev = prefix_ids.device
    bt = batch_tensors(jobs, prefix_ids.shape[0], pad_id, position_offset=position_offset)
    bt = {k: v.to(dev, non_blocking=True) for k, v in bt.items()}
    return optimizer_step(model, opt, prefix_ids, prefix_positions, bt,
                          context_weight=context_weight, bf16=bf16)


def hf_logits_match(model: DemoLlama, hf_dir: str, ids: list[int], atol: float = 2e-3
                    ) -> float:
    """Largest difference between this model's logits and the exported HF model's."""
    from transformers import LlamaForCausalLM

    hf = LlamaForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    hf.eval()
    x = torch.tensor([ids])
    with torch.no_grad():
        ours = model.logits(model.hidden(x, torch.arange(len(ids)).unsqueeze(0), None)[0])
        theirs = hf(x).logits
    return float((ours - theirs).abs().max())


def param_count(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def cosine_lr(step: int, total: int, peak: float, warmup: int, floor: float = 0.1) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, total - warmup)
    return peak * (floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * min(1.0, t))))
