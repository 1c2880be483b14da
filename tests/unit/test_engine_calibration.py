"""What reads an engine's calibration: pricing of its steps, the hold decision, the
routing score and batch admission's starting K, and how the inference worker finds it
(Redis, else the file, else the engine's preset)."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis

from tests.unit.test_holds import StubPauses, StubRedis
from warmloop.activities.admission import BatchAdmission
from warmloop.activities.holds import MAX_LOADED_SLOWDOWN, HoldManager
from warmloop.activities.registry import EngineHeartbeat, calibrated_prefill_rate
from warmloop.workers.calibrate import (
    CalibrationError,
    CalibrationSource,
    prefill_points,
    read_calibration,
    store_calibration,
    write_calibration_file,
)
from warmloop.workers.settings import EMBEDDED_ENGINE_PRICE, EngineEndpoint, Settings
from warmloop.workflows.calibration import CALIBRATION_KEY, PrefillPoint, preset
from warmloop.workflows.holding import HoldConfig, HoldCosts
from warmloop.workflows.lanes import AdmissionConfig, calibrated_k_start
from warmloop.workflows.routing import EngineCandidate, choose_engine

TINY = preset("cpu-tiny")
SLOW = TINY.model_copy(update={
    "source": "measured e0 (a slow engine)",
    "prefill": (PrefillPoint(prompt_tokens=256, tokens_per_s=2_000),
                PrefillPoint(prompt_tokens=2_048, tokens_per_s=4_000))})


def heartbeat(calibration: object = None, **kw: object) -> EngineHeartbeat:
    return EngineHeartbeat.model_validate({
        "engine_id": "e0", "task_queue": "engine.e0", "model": "tiny", "url": "u",
        "healthy": True, "at": 0, "kv_usage": 0.3, "kv_capacity_tokens": 16_384,
        "block_size": 128, "calibration": calibration, **kw})


# ---- settings and pricing -----------------------------------------------------------------


def test_embedded_engines_declare_no_price_and_are_priced_by_their_preset() -> None:
    s = Settings()
    assert all(e.price is None for e in s.engine_endpoints)
    assert all(s.engine_calibration_base(e) == TINY for e in s.engine_endpoints)
    assert TINY.engine_price() == EMBEDDED_ENGINE_PRICE
    # a measured engine's price follows its measured rate
    assert SLOW.engine_price().pricing.input_per_m > TINY.engine_price().pricing.input_per_m


def test_an_engine_declaring_a_self_hosted_price_is_described_by_it() -> None:
    """A GPU engine that declares its price but names no preset must not be held,
    routed and admitted by the default preset's tiny CPU model: its base calibration
    takes the declared prefill and decode throughput and GPU hour (the preset's bend
    with prompt length kept), so what the policies read is what its steps are billed
    at. A measured calibration replaces it, as it replaces any preset."""
    from warmloop.workflows.pricing import EnginePrice

    price = EnginePrice(gpu_usd_per_hour=3.5, prefill_tokens_per_s=60_000,
                        decode_tokens_per_s=2_500, cached_fraction=0.05)
    gpu = EngineEndpoint(id="g0", url="http://g0:8000", price=price)
    base = Settings().engine_calibration_base(gpu)
    assert base.nominal_prefill_tokens_per_s == pytest.approx(60_000)
    assert base.decode_tokens_per_s() == pytest.approx(2_500)
    assert base.gpu_hour_usd == 3.5 and base.cached_fraction == 0.05
    assert "declares" in base.source
    declared = base.engine_price()  # the price it would bill at without its own
    assert (declared.gpu_usd_per_hour, declared.cached_fraction) == (3.5, 0.05)
    assert declared.prefill_tokens_per_s == pytest.approx(60_000)
    assert declared.decode_tokens_per_s == pytest.approx(2_500)
    # the bend with length is the preset's
    ratio = TINY.prefill_tokens_per_s(256) / TINY.prefill_tokens_per_s(8_192)
    assert base.prefill_tokens_per_s(256) / base.prefill_tokens_per_s(8_192) == \
        pytest.approx(ratio)
    # the hold model prices a re-prefill at the declared rate, the GPU at its hour
    costs = hold_manager(heartbeat(base.model_dump())).costs(2_048, interactive=True)
    assert isinstance(costs, HoldCosts)
    assert costs.prefill_s_per_token == pytest.approx(1 / 60_000)
    assert costs.gpu_usd_per_s == pytest.approx(3.5 / 3600)
    # a named preset takes the declared numbers too; a per-token price says no speed
    named = EngineEndpoint(id="g1", url="http://g1:8000", price=price,
                           calibration="h100-llama-3.1-8b-bf16")
    assert Settings().engine_calibration_base(named).nominal_prefill_tokens_per_s == \
        pytest.approx(60_000)
    api = EngineEndpoint(id="a0", url="http://a0:8000", price=EnginePrice(
        input_usd_per_mtok=0.2, cached_input_usd_per_mtok=0.02, output_usd_per_mtok=0.6))
    assert Settings().engine_calibration_base(api) == TINY


def test_an_unknown_preset_is_refused_with_the_known_ones() -> None:
    with pytest.raises(ValueError, match="known: .*cpu-tiny"):
        Settings(engine_calibration="h200-imaginary")
    with pytest.raises(ValueError, match="unknown calibration preset"):
        EngineEndpoint(id="g0", url="http://g0:8000", calibration="tpu")
    e = EngineEndpoint(id="g0", url="http://g0:8000", calibration="h100-llama-3.1-8b-bf16")
    assert "H100" in Settings().engine_calibration_base(e).hardware


def test_a_heartbeat_carries_its_calibration_through_json() -> None:
    hb = heartbeat(SLOW.model_dump())
    again = EngineHeartbeat.model_validate_json(hb.model_dump_json())
    assert again.calibration == SLOW
    # heartbeats from workers before calibrations still parse
    old = json.loads(hb.model_dump_json())
    del old["calibration"]
    assert EngineHeartbeat.model_validate(old).calibration is None


# ---- the hold decision --------------------------------------------------------------------


def hold_manager(hb: EngineHeartbeat) -> HoldManager:
    return HoldManager(engine_id="e0", base_url="http://engine", model="tiny",
                       http=httpx.AsyncClient(), redis=StubRedis(),  # type: ignore[arg-type]
                       pauses=StubPauses(1.0, 2.0),  # type: ignore[arg-type]
                       engine_info=lambda: hb, config=HoldConfig())


def test_the_hold_decision_prices_re_prefill_at_the_engines_measured_rate() -> None:
    flat = hold_manager(heartbeat()).costs(2_048, interactive=True)
    slow = hold_manager(heartbeat(SLOW.model_dump())).costs(2_048, interactive=True)
    assert isinstance(flat, HoldCosts) and isinstance(slow, HoldCosts)
    assert flat.prefill_s_per_token == pytest.approx(1 / HoldConfig().prefill_tokens_per_s)
    assert slow.prefill_s_per_token == pytest.approx(1 / 4_000)
    assert slow.gpu_usd_per_s == pytest.approx(SLOW.gpu_hour_usd / 3600)
    # re-prefill on the slow engine costs more: what a hold saves is worth more there
    assert slow.prefill_s_per_token > 4 * flat.prefill_s_per_token


def test_a_busy_engine_prices_re_prefill_at_the_rate_its_steps_show() -> None:
    """Calibrated alone at 27k tokens/s (cpu-tiny at 2,048), the engine's steps now take
    50 us more per uncached token: the hold model prices re-prefill at that."""
    def priced_after(lengths: list[int], fixed_s: float, per_token_s: float) -> HoldCosts:
        """The price after 40 steps of TTFT = ``fixed_s`` + ``per_token_s`` a token."""
        hm = hold_manager(heartbeat(TINY.model_dump()))
        for i in range(40):
            tokens = lengths[i % len(lengths)]
            hm.observe_step(uncached_tokens=tokens, ttft_s=fixed_s + per_token_s * tokens)
        costs = hm.costs(2_048, interactive=True)
        assert isinstance(costs, HoldCosts)
        return costs

    idle = hold_manager(heartbeat(TINY.model_dump())).costs(2_048, interactive=True)
    assert isinstance(idle, HoldCosts)
    assert idle.prefill_s_per_token == pytest.approx(TINY.prefill_s_per_token(2_048))
    # whatever the order of lengths
    busy = priced_after([100, 1_600, 400, 900], 0.040, 50e-6)
    assert busy.prefill_s_per_token == pytest.approx(50e-6)
    # never cheaper than alone: steps faster than the calibration keep its rate
    kept = priced_after([100, 1_600], 0.010, 1e-6)
    assert kept.prefill_s_per_token == pytest.approx(idle.prefill_s_per_token)
    # nor more than MAX_LOADED_SLOWDOWN times it, whatever a queue did to the slope
    capped = priced_after([100, 1_600], 0.040, 2e-3)
    assert capped.prefill_s_per_token == pytest.approx(
        MAX_LOADED_SLOWDOWN * idle.prefill_s_per_token)


# ---- the routing score --------------------------------------------------------------------


def test_the_routing_score_weighs_cached_tokens_at_each_engines_rate() -> None:
    def route(rate: float | None) -> str:
        warm = EngineCandidate(engine_id="e0", expected_cached_tokens=1_000, running=2,
                               prefill_tokens_per_s=rate)
        cold = EngineCandidate(engine_id="e1")
        return choose_engine([warm, cold], job_id="j").engine_id

    assert route(None) == "e0"  # 1,000 tokens at 20k/s save 50 ms > 2 requests' 20 ms
    assert route(100_000) == "e1"  # at 100k/s they save 10 ms < 20 ms: the idle engine
    assert route(4_000) == "e0"
    assert calibrated_prefill_rate(heartbeat(SLOW.model_dump()), 2_048) == pytest.approx(4_000)
    assert calibrated_prefill_rate(heartbeat(), 2_048) is None


# ---- batch admission's starting K ---------------------------------------------------------


def test_k_starts_where_the_calibration_meets_the_ttft_target() -> None:
    config = AdmissionConfig(interactive_ttft_target_ms=1000, k_start_from_calibration=True)
    assert calibrated_k_start(lambda k: 0.1 * k, config) == 10
    assert calibrated_k_start(lambda k: 5.0, config) == 1  # never below one
    assert calibrated_k_start(lambda k: 0.0, config) == config.k_max

    a = BatchAdmission(config)
    a.calibrate(SLOW)
    ref = SLOW.reference_prompt_tokens
    expected = calibrated_k_start(
        lambda k: SLOW.step_overhead_s + (k + 1) * SLOW.prefill_seconds(ref)
        + SLOW.decode_step_seconds(k + 1), config)
    assert a.limit == expected != config.k_start
    # off by default
    b = BatchAdmission(AdmissionConfig())
    b.calibrate(SLOW)
    assert b.limit == AdmissionConfig().k_start


async def test_k_is_not_reset_once_interactive_steps_are_measured() -> None:
    a = BatchAdmission(AdmissionConfig(k_start_from_calibration=True, k_start=3))
    await a.observe_interactive(200.0)
    a.calibrate(TINY)
    assert a.limit == 3


# ---- where the worker finds it ------------------------------------------------------------


class Clock:
    t = 0.0

    def __call__(self) -> float:
        return self.t


async def test_the_worker_takes_a_published_calibration_at_its_next_refresh(
        redis: aioredis.Redis, tmp_path: Path) -> None:
    clock = Clock()
    source = CalibrationSource(redis, "e0", preset_calibration=TINY,
                               file=tmp_path / "e0.json", refresh_s=30, clock=clock)
    assert await source.refresh() == TINY  # nothing measured: the preset
    await store_calibration(redis, "e0", SLOW)
    assert await source.refresh() == TINY  # not before the refresh interval
    clock.t = 31
    assert await source.refresh() == SLOW
    assert await read_calibration(redis, "e0") == SLOW


async def test_garbage_in_redis_keeps_the_last_calibration(
        redis: aioredis.Redis, tmp_path: Path) -> None:
    file = tmp_path / "e0.json"
    write_calibration_file(file, SLOW)
    clock = Clock()
    source = CalibrationSource(redis, "e0", preset_calibration=TINY, file=file, clock=clock)
    assert source.current == SLOW  # the file, before Redis answers
    await redis.set(CALIBRATION_KEY.format(engine_id="e0"), b'{"model": "tiny", "prefill"')
    assert await source.refresh() == SLOW
    assert await read_calibration(redis, "e0") is None


async def test_a_redis_that_is_away_keeps_the_last_calibration(tmp_path: Path) -> None:
    dead = aioredis.Redis.from_url("redis://127.0.0.1:1/0", socket_connect_timeout=0.2)
    source = CalibrationSource(dead, "e0", preset_calibration=TINY)
    assert await source.refresh() == TINY
    await dead.aclose()


# ---- the measurement's fit ------------------------------------------------------------------


def test_prefill_points_fit_the_overhead_and_keep_the_bend_with_length() -> None:
    # 20 ms overhead; 20k tokens/s at 128, 25k at 1,024, 20k at 2,048
    ttft = {16: 0.0208, 128: 0.0264, 1024: 0.06096, 2048: 0.1224}
    overhead, points = prefill_points(ttft)
    assert 0.005 < overhead < 0.03
    rates = {p.prompt_tokens: p.tokens_per_s for p in points}
    assert list(rates) == [128, 1024, 2048]  # the 16-token request is the overhead probe
    assert rates[1024] > rates[2048]


def test_a_noisy_short_point_cannot_claim_an_absurd_rate() -> None:
    # the 512-token request happened to come back as fast as the overhead probe
    ttft = {16: 0.045, 128: 0.03, 512: 0.046, 1024: 0.08, 2048: 0.13}
    overhead, points = prefill_points(ttft)
    line_rate = (2048 - 128) / (0.13 - 0.03)
    assert all(p.tokens_per_s <= 2.5 * line_rate for p in points)


def test_a_busy_engine_is_refused_rather_than_measured() -> None:
    with pytest.raises(CalibrationError, match="too busy"):
        prefill_points({16: 0.2, 128: 0.1, 1024: 0.05})
