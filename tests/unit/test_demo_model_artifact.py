"""The shipped demo models (the CPU recipe's and the GPU-trained one): present, small,
loadable as vLLM loads them, and traceable to the data and seed that made them
(PROVENANCE.json)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest

from warmloop.infra.demo_model import ARTIFACT_DIR, GPU_ARTIFACT_DIR

MAX_BYTES = 25 * 1024 * 1024


@pytest.fixture(params=[ARTIFACT_DIR, GPU_ARTIFACT_DIR], ids=["cpu", "gpu"])
def artifact(request: pytest.FixtureRequest) -> Path:
    path: Path = request.param
    if not (path / "config.json").exists():
        pytest.skip(f"no demo model artifact at {path} (make model)")
    return path


def test_artifact_is_complete_and_small(artifact: Path) -> None:
    names = {p.name for p in artifact.iterdir()}
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
            "generation_config.json", "PROVENANCE.json"} <= names
    assert sum(p.stat().st_size for p in artifact.iterdir()) <= MAX_BYTES


def test_config_and_tokenizer_load_as_vllm_loads_them(artifact: Path) -> None:
    from transformers import AutoConfig, AutoTokenizer

    from warmloop.infra.tiny_model import CHAT_TEMPLATE, TOOL_TOKENS

    config = AutoConfig.from_pretrained(artifact)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.max_position_embeddings >= 32768  # the stack's --max-model-len
    tok = AutoTokenizer.from_pretrained(artifact)
    assert tok.chat_template == CHAT_TEMPLATE  # prompts render as with the tiny model
    assert tok.eos_token == "<|end|>" and config.eos_token_id == tok.eos_token_id
    vocab = tok.get_vocab()
    assert all(t in vocab for t in TOOL_TOKENS)  # vLLM's hermes parser looks them up
    assert len(tok) <= config.vocab_size


def test_provenance_names_data_seed_and_command(artifact: Path) -> None:
    prov = json.loads((artifact / "PROVENANCE.json").read_text())
    for key in ("data_sha256", "seed", "steps", "wall_time_s", "command", "rebuild",
                "train_config", "data"):
        assert key in prov, key
    assert len(prov["data_sha256"]) == 64


def test_provenance_heldout_hash_matches_regenerated_cases(artifact: Path) -> None:
    """Regenerating every transcript takes minutes (``make model``); the held-out cases
    take a second, and come from the same seeded generator."""
    from warmloop.infra.demo_model import data as D

    prov = json.loads((artifact / "PROVENANCE.json").read_text())
    d = prov["data"]
    held = D.cases("heldout", d["n_heldout_tickets"], d["n_heldout_invoices"], d["seed"])
    digest = hashlib.sha256(D.cases_jsonl(held).encode()).hexdigest()
    assert digest == d["heldout_sha256"]


def test_the_demo_names_the_served_models_size_from_its_provenance(tmp_path: Path) -> None:
    from warmloop.workers.demo import _parameters
    from warmloop.workers.settings import Settings

    for model in ("demo", "demo-gpu"):
        settings = Settings(engine_model=model)
        prov = json.loads((settings.resolved_model_path / "PROVENANCE.json").read_text())
        want = f"{prov['parameters'] / 1e6:.1f}M parameters"
        assert _parameters(settings) == want
    # a model directory without provenance still gets a sentence, not an error
    assert _parameters(Settings(model_path=tmp_path)) == "a few million parameters"
