"""The engine calibration: interpolation, validation and the presets' citations."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from warmloop.workflows.calibration import (
    CPU_TINY,
    PRESETS,
    DecodePoint,
    EngineCalibration,
    PrefillPoint,
    preset,
)


def calibration(**changes: object) -> EngineCalibration:
    base: dict[str, object] = dict(
        model="m", hardware="h", source="measured e0 2026-12-01",
        prefill=(PrefillPoint(prompt_tokens=100, tokens_per_s=1_000),
                 PrefillPoint(prompt_tokens=10_000, tokens_per_s=3_000)),
        decode=(DecodePoint(batch_size=1, step_s=0.01), DecodePoint(batch_size=11, step_s=0.02)),
        kv_pool_blocks=100, block_size=16, kv_bytes_per_token=1024, gpu_hour_usd=2.0)
    base.update(changes)
    return EngineCalibration.model_validate(base)


def test_prefill_interpolates_in_log_length_and_is_flat_outside() -> None:
    c = calibration()
    assert c.prefill_tokens_per_s(10) == 1_000
    assert c.prefill_tokens_per_s(1_000) == pytest.approx(2_000)  # half-way in log
    assert c.prefill_tokens_per_s(1_000_000) == 3_000
    assert c.prefill_seconds(1_000, cached_tokens=0) == pytest.approx(0.5)
    assert c.prefill_seconds(1_000, cached_tokens=600) == pytest.approx(0.2)
    assert c.prefill_seconds(1_000, cached_tokens=1_000) == 0.0


def test_decode_interpolates_and_extrapolates_the_last_slope() -> None:
    c = calibration()
    assert c.decode_step_seconds(1) == 0.01
    assert c.decode_step_seconds(6) == pytest.approx(0.015)
    assert c.decode_step_seconds(21) == pytest.approx(0.03)
    assert c.decode_tokens_per_s(11) == pytest.approx(550)
    with pytest.raises(ValueError, match="batch must be >= 1"):
        c.decode_step_seconds(0)


@pytest.mark.parametrize(("changes", "message"), [
    ({"prefill": (PrefillPoint(prompt_tokens=10, tokens_per_s=1),
                  PrefillPoint(prompt_tokens=10, tokens_per_s=2))}, "strictly increasing"),
    ({"decode": (DecodePoint(batch_size=1, step_s=0.02),
                 DecodePoint(batch_size=2, step_s=0.01))}, "must not fall"),
    ({"kv_pool_blocks": 0}, "greater than 0"),
    ({"max_batched_tokens": 8}, "at least one block"),
    ({"surprise": 1}, "Extra inputs"),
])
def test_invalid_calibrations_say_what_to_change(changes: dict[str, object],
                                                 message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        calibration(**changes)


def test_policies_read_the_calibration() -> None:
    c = calibration()
    assert c.hold_config().prefill_tokens_per_s == c.nominal_prefill_tokens_per_s
    assert c.hold_config().gpu_usd_per_hour == 2.0
    assert c.routing_config().prefill_tokens_per_s == c.nominal_prefill_tokens_per_s
    price = c.engine_price()
    assert price.gpu_usd_per_hour == 2.0
    costs = c.hold_costs(prefix_tokens=800, kv_usage=0.5, latency_usd_per_s=0.0)
    assert costs.kv_capacity_tokens == 1_600
    assert c.with_kv_pool_bytes(16 * 1024 * 10).kv_pool_blocks == 10
    assert EngineCalibration.model_validate_json(c.model_dump_json()) == c


def test_presets_cite_their_sources() -> None:
    assert {"h100-llama-3.1-8b-bf16", "a100-80gb-llama-3.1-8b-bf16", "l4-llama-3.1-8b-bf16",
            "cpu-tiny"} <= set(PRESETS)
    for name, c in PRESETS.items():
        assert "preset" in c.source or "PLATFORM" in c.source, name
        assert c.kv_pool_tokens > 0
    assert "docs.nvidia.com" in PRESETS["h100-llama-3.1-8b-bf16"].source
    assert CPU_TINY.block_size == 128 and CPU_TINY.kv_bytes_per_token == 2_048
    with pytest.raises(ValueError, match="known: "):
        preset("tpu")


def test_a_gpu_engines_batch_lane_is_capped_by_its_calibration_not_the_cpu_default() -> None:
    """K's ceiling: the preset's batch_k_max unless the operator sets k_max; the CPU
    engines keep AdmissionConfig's 16. The worker and the simulator apply it alike."""
    from warmloop.activities.admission import BatchAdmission
    from warmloop.sim.core import Clock
    from warmloop.sim.fleet import POLICIES, Fleet
    from warmloop.workflows.lanes import AdmissionConfig

    h100 = preset("h100-llama-3.1-8b-bf16")
    assert h100.batch_k_max == h100.max_batch // 4
    assert h100.admission_config(AdmissionConfig()).k_max == 64
    assert h100.admission_config(AdmissionConfig(k_max=8)).k_max == 8
    assert h100.admission_config(AdmissionConfig(k_start=100, k_max=200)).k_max == 200
    assert preset("cpu-tiny").admission_config(AdmissionConfig()).k_max == 16
    assert preset("l4-llama-3.1-8b-bf16").admission_config(
        AdmissionConfig(k_start=32)).k_start == 16

    worker = BatchAdmission(AdmissionConfig())
    worker.calibrate(h100)
    assert worker.config.k_max == 64
    explicit = BatchAdmission(AdmissionConfig(k_max=8))
    explicit.calibrate(h100)
    assert explicit.config.k_max == 8

    fleet = Fleet(Clock(), [h100, preset("cpu-tiny")], POLICIES["warmloop"])
    assert [a.cfg.k_max for a in fleet.admission.values()] == [64, 16]
