"""Build the tiny local model the embedded stack serves (no model hub is reachable).

A 2-layer Llama with random weights and a byte-level BPE tokenizer trained on
generated text. Its decisions are arbitrary; its KV cache, prefix caching and
guided decoding are real, which is what warmloop's orchestration is tested on.
KV size: 2 layers x (K+V) x 256 hidden x 2 bytes = 2,048 bytes per token.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

# Bumped whenever the recipe changes, so a cached build is rebuilt.
RECIPE_VERSION = "6"

SPECIAL_TOKENS = [
    "<s>",
    "</s>",
    "<pad>",
    "<|system|>",
    "<|user|>",
    "<|assistant|>",
    "<|tool|>",
    "<|end|>",
]
# Hermes-style tool call markers: vLLM's `hermes` parser looks them up in the vocabulary.
TOOL_TOKENS = ["<tool_call>", "</tool_call>"]

# Renders tools (canonical JSON, in the order given) inside the system block, so the
# whole stable prefix (system prompt + tool schemas) comes first and is byte-identical
# across steps and jobs of a profile.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages %}"
    "{% if m['role'] == 'system' %}"
    "{{ '<|system|>\\n' + m['content'] }}"
    "{% if tools %}{{ '\\n# Tools' }}"
    "{% for t in tools %}{{ '\\n' + (t | tojson) }}{% endfor %}{% endif %}"
    "{{ '<|end|>\\n' }}"
    "{% elif m['role'] == 'user' %}{{ '<|user|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|assistant|>\\n' }}"
    "{% if m['content'] %}{{ m['content'] }}{% endif %}"
    "{% if m['tool_calls'] is defined and m['tool_calls'] %}"
    "{% for c in m['tool_calls'] %}{{ '<tool_call>' }}"
    "{% set a = c['function']['arguments'] %}"
    "{{ '{\"name\": \"' + c['function']['name'] + '\", \"arguments\": ' }}"
    "{{ a if a is string else (a | tojson) }}{{ '}</tool_call>' }}{% endfor %}"
    "{% endif %}{{ '<|end|>\\n' }}"
    "{% elif m['role'] == 'tool' %}{{ '<|tool|>\\n' + m['content'] + '<|end|>\\n' }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>\\n' }}{% endif %}"
)

_WORDS = [
    "customer",
    "ticket",
    "priority",
    "refund",
    "invoice",
    "order",
    "account",
    "billing",
    "shipping",
    "password",
    "login",
    "error",
    "crash",
    "slow",
    "reply",
    "draft",
    "knowledge",
    "article",
    "search",
    "lookup",
    "finish",
    "resolve",
    "escalate",
    "urgent",
    "high",
    "normal",
    "low",
    "vip",
    "plan",
    "enterprise",
    "starter",
    "pro",
    "payment",
    "purchase",
    "line",
    "amount",
    "discrepancy",
    "approve",
    "reject",
    "the",
    "a",
    "an",
    "to",
    "of",
    "and",
    "in",
    "for",
    "on",
    "with",
    "is",
    "are",
    "was",
    "be",
    "this",
    "that",
    "please",
    "help",
    "thanks",
    "hello",
    "we",
    "you",
    "your",
    "our",
    "it",
    "not",
    "can",
    "cannot",
    "will",
    "should",
    "must",
    "step",
    "remaining",
    "budget",
    "tool",
    "call",
    "name",
    "arguments",
    "json",
    "id",
    "subject",
    "body",
    "status",
    "open",
    "closed",
]


def _corpus(seed: int = 7) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(6000):
        n = rng.randint(4, 18)
        words = [rng.choice(_WORDS) for _ in range(n)]
        if rng.random() < 0.3:
            words.append(f"C{rng.randint(100, 999)}")
        if rng.random() < 0.3:
            words.append(json.dumps({rng.choice(_WORDS): rng.choice(_WORDS)}))
        lines.append(" ".join(words))
    # Give the tokenizer JSON and digits to learn.
    lines += [json.dumps({"name": w, "arguments": {"id": i}}) for i, w in enumerate(_WORDS)]
    lines += ["".join(rng.choice("0123456789abcdef") for _ in range(32)) for _ in range(200)]
    # The profiles' own prompts and tool schemas, so the stable prefix tokenizes like a
    # real model's would (about 4 characters a token, not 2): the bundled ones and
    # those of the plugins this process loads (WARMLOOP_PLUGINS; the benchmarks' own).
    from warmloop.workers.plugins import load_plugins
    from warmloop.workflows.profiles import REGISTRY

    load_plugins()
    for profile in (r.profile for r in REGISTRY.registered()):
        text = (
            profile.system_prompt + "\n" + "\n".join(json.dumps(t) for t in profile.tool_schemas())
        )
        lines += text.splitlines() * 20
    return lines


def model_is_built(path: Path) -> bool:
    marker = path / "warmloop_recipe.txt"
    return marker.exists() and marker.read_text().strip() == RECIPE_VERSION


def build_tiny_model(path: Path, *, seed: int = 0, vocab_size: int = 4096) -> Path:
    """Build (or reuse) the tiny model at ``path``; returns the path.

    Heavy imports (torch, transformers, tokenizers) happen here only, so the rest of
    warmloop never needs them.
    """
    if model_is_built(path):
        return path
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    path.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="<|end|>",
        pad_token="<pad>",
        unk_token=None,
    )
    fast.add_tokens(TOOL_TOKENS)
    fast.chat_template = CHAT_TEMPLATE
    fast.model_max_length = 32768
    fast.save_pretrained(path)

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32768,
        bos_token_id=fast.bos_token_id,
        eos_token_id=fast.eos_token_id,
        pad_token_id=fast.pad_token_id,
        tie_word_embeddings=True,
    )
    model = LlamaForCausalLM(config).to(dtype=torch.bfloat16)  # type: ignore[arg-type,call-arg]
    model.save_pretrained(path, safe_serialization=True)
    (path / "warmloop_recipe.txt").write_text(RECIPE_VERSION + "\n")
    return path


if __name__ == "__main__":
    import sys

    out = Path(sys.argv[1] if len(sys.argv) > 1 else ".warmloop/models/tiny-llama")
    print(build_tiny_model(out))
