"""bench/gpu_calibrate.py: the GPU measurement behind the H200 preset, run here on a CPU
with a tiny model (the device that ran it for real is lent only now and then)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from warmloop.workflows.calibration import EngineCalibration, preset

torch = pytest.importorskip("torch")

REPO = Path(__file__).resolve().parents[2]
MEASURED = REPO / "bench" / "measured" / "h200_llama_8b_compiled.json"


def test_tiny_run_writes_a_calibration_the_policies_accept(tmp_path: Path) -> None:
    from bench import gpu_calibrate

    out = tmp_path / "tiny.json"
    assert gpu_calibrate.main(["--tiny", "--out", str(out), "--prompt-lengths", "64", "256",
                               "--batches", "1", "4", "--decode-context", "64",
                               "--repeats", "2"]) == 0
    result = json.loads(out.read_text())
    cal = EngineCalibration.model_validate(result["calibration"])
    assert [p.prompt_tokens for p in cal.prefill] == [64, 256]
    assert [d.batch_size for d in cal.decode] == [1, 4]
    # Measured, not made up: every figure is the raw timing turned into a rate.
    for raw, point in zip(result["prefill_raw"], cal.prefill, strict=True):
        assert point.tokens_per_s == pytest.approx(raw["prompt_tokens"] / raw["seconds"],
                                                   rel=1e-3)
    assert cal.kv_bytes_per_token == gpu_calibrate.TINY.kv_bytes_per_token(4)
    assert cal.source.startswith("measured ")


def test_decode_steps_are_made_monotone_without_losing_the_raw_figures(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A noisy larger batch that timed faster must not break the schema's rule (a step
    never gets faster with more sequences); the raw timing stays in the file."""
    from bench import gpu_calibrate

    times = iter([0.004, 0.003])  # batch 1, then batch 2 timed faster
    real_timed = gpu_calibrate.timed

    def fake_timed(fn, device, *, warmup: int, repeats: int) -> float:
        if repeats >= 10:  # decode (prefill uses fewer repeats)
            fn()
            return next(times)
        return real_timed(fn, device, warmup=warmup, repeats=repeats)

    monkeypatch.setattr(gpu_calibrate, "timed", fake_timed)
    out = tmp_path / "noisy.json"
    gpu_calibrate.main(["--tiny", "--out", str(out), "--prompt-lengths", "64",
                        "--batches", "1", "2", "--decode-context", "32", "--repeats", "2"])
    result = json.loads(out.read_text())
    assert [d["step_s"] for d in result["decode_raw"]] == [0.004, 0.003]
    assert [d["step_s"] for d in result["calibration"]["decode"]] == [0.004, 0.004]
    EngineCalibration.model_validate(result["calibration"])


def test_the_h200_preset_is_the_measured_file() -> None:
    """The preset quotes bench/measured/h200_llama_8b_compiled.json: neither may drift."""
    measured = EngineCalibration.model_validate(json.loads(MEASURED.read_text())["calibration"])
    h200 = preset("h200-llama-3.1-8b-bf16")
    assert h200.prefill == measured.prefill
    assert h200.decode == measured.decode
    assert (h200.kv_pool_blocks, h200.block_size, h200.kv_bytes_per_token) == (
        measured.kv_pool_blocks, measured.block_size, measured.kv_bytes_per_token)
    assert h200.measured_at == measured.measured_at


def test_the_simulators_step_model_is_compared_with_every_measured_warm_prefill(
        capsys: pytest.CaptureFixture[str]) -> None:
    from bench import gpu_calibrate

    cached = REPO / "bench" / "measured" / "h200_cached_prefill.json"
    rows = gpu_calibrate.compare_sim(cached, "h200-llama-3.1-8b-bf16")
    measured = json.loads(cached.read_text())["cached_prefill_raw"]
    assert [(r["cached"], r["new"]) for r in rows] == [
        (m["cached_tokens"], m["new_tokens"]) for m in measured]
    cal = preset("h200-llama-3.1-8b-bf16")
    # A warm agent step (hundreds of new tokens on thousands cached) is where the
    # simulator's figures come from: its step model must stay near the measurement.
    for r in rows:
        assert r["simulated_s"] >= cal.decode_step_seconds(1)
        if r["new"] >= 256 and 0 < r["cached"] <= 8_192:
            assert 0.8 <= r["simulated_s"] / r["measured_s"] <= 1.25, r
    assert "| 2,048 | 256 |" in capsys.readouterr().out
