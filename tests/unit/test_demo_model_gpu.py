"""bench/demo_model_gpu.py: pack here, train (on a CPU here, a GPU when one is lent),
export an artifact the evaluation serves."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch")


def test_pack_train_export_round_trip(tmp_path: Path) -> None:
    from bench import demo_model_gpu
    from warmloop.infra.demo_model.data import write_dataset

    data = tmp_path / "data"
    write_dataset(data, seed=0, n_tickets=4, n_invoices=2, n_heldout_tickets=1,
                  n_heldout_invoices=1, log=lambda _m: None)
    packed = tmp_path / "packed"
    demo_model_gpu.main(["pack", "--data-dir", str(data), "--dir", str(packed),
                         "--vocab-size", "600"])
    meta = json.loads((packed / "meta.json").read_text())
    assert meta["jobs"] > 0 and meta["job_tokens"] > 0
    weights = tmp_path / "weights"
    demo_model_gpu.main(["train", "--dir", str(packed), "--out", str(weights),
                         "--seconds", "2", "--batch-tokens", "4000", "--hidden", "32",
                         "--layers", "1", "--heads", "2"])
    summary = json.loads((weights / "train.json").read_text())
    assert summary["steps"] >= 1 and summary["data_sha256"] == meta["data_sha256"]
    art = tmp_path / "artifact"
    demo_model_gpu.main(["export", "--dir", str(packed), "--weights", str(weights),
                         "--out", str(art)])
    config = json.loads((art / "config.json").read_text())
    assert config["hidden_size"] == 32 and config["vocab_size"] == meta["vocab"]
    assert (art / "model.safetensors").exists() and (art / "tokenizer.json").exists()

    # half-precision weights, and a second run going on from them, export the same way
    half = tmp_path / "half"
    demo_model_gpu.main(["train", "--dir", str(packed), "--out", str(half),
                         "--seconds", "1", "--batch-tokens", "4000", "--hidden", "32",
                         "--layers", "1", "--heads", "2", "--half-weights",
                         "--init", str(weights)])
    again = json.loads((half / "train.json").read_text())
    assert again["init"]["steps"] == summary["steps"]  # it names the run it went on from
    demo_model_gpu.main(["export", "--dir", str(packed), "--weights", str(half),
                         "--out", str(tmp_path / "artifact-half")])
    assert (tmp_path / "artifact-half" / "model.safetensors").exists()
