"""Per-engine model and price: the price declaration, step costs priced by the engine's
worker, the heartbeat, the routing filter and the client-side check."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Any

import httpx
import pytest
from pydantic import ValidationError
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment
from typer.testing import CliRunner

from tests.routing_stubs import EmptyDirectory
from warmloop.activities.inference import InferenceActivities
from warmloop.activities.registry import EngineHeartbeat
from warmloop.activities.routing import RoutingActivities
from warmloop.activities.transcripts import TranscriptStore
from warmloop.infra.stack import settings_env
from warmloop.workers.cli import app
from warmloop.workers.inference_worker import _ttl_cache, probe_engine
from warmloop.workers.jobs import InvalidJobError, JobClient, UnservableJobError
from warmloop.workers.settings import EMBEDDED_ENGINE_PRICE, EngineEndpoint, Settings
from warmloop.workflows.budgets import JobLimits, Usage, check_before_step
from warmloop.workflows.calibration import preset
from warmloop.workflows.contracts import GenerateRequest, GenerateResult, RouteRequest
from warmloop.workflows.pricing import PRICES, EnginePrice, Pricing
from warmloop.workflows.profiles import REGISTRY, get_profile
from warmloop.workflows.routing import (
    NO_ENGINE_FOR_MODEL,
    NO_PRICED_ENGINE,
    EngineOffer,
    UnservableStepError,
    eligible_engines,
)

API = {"input_usd_per_mtok": 3.0, "cached_input_usd_per_mtok": 0.3, "output_usd_per_mtok": 15.0}
GPU = {"gpu_usd_per_hour": 2.0, "prefill_tokens_per_s": 10_000, "decode_tokens_per_s": 1_000}
STEP = {"prompt_tokens": 1000, "cached_tokens": 896, "completion_tokens": 20}

# ---- the price declaration ---------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({}, "give either a self-hosted price (gpu_usd_per_hour, prefill_tokens_per_s, "
             "decode_tokens_per_s) or a per-token price"),
        ({**GPU, **API}, "not both (got gpu_usd_per_hour and input_usd_per_mtok)"),
        ({"gpu_usd_per_hour": 2.0, "prefill_tokens_per_s": 10_000},
         "a self-hosted price needs gpu_usd_per_hour, prefill_tokens_per_s, "
         "decode_tokens_per_s; missing: decode_tokens_per_s"),
        ({"input_usd_per_mtok": 3.0, "output_usd_per_mtok": 15.0},
         "missing: cached_input_usd_per_mtok"),
        ({**API, "cached_fraction": 0.2}, "cached_fraction belongs to a self-hosted price"),
        ({**GPU, "gpu_usd_per_hour": 0}, "greater than 0"),
        ({**GPU, "gpu_usd_per_hour": 5_000}, "less than or equal to 1000"),
        ({**API, "output_usd_per_mtok": -1}, "greater than or equal to 0"),
        ({**GPU, "cached_fraction": 1.5}, "less than or equal to 1"),
        ({**API, "input_usd_per_mtk": 3.0}, "Extra inputs are not permitted"),
    ],
)
def test_a_price_is_one_kind_complete_and_bounded(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as e:
        EnginePrice.model_validate(fields)
    assert message in str(e.value)


def test_a_self_hosted_price_is_gpu_time_per_token() -> None:
    p = EnginePrice.model_validate(GPU)
    assert p.kind == "self_hosted"
    # $2/h = $0.000556/s; 10k prefill tokens/s -> $0.0556/M; 1k decode tokens/s -> $0.556/M
    assert p.pricing.input_per_m == pytest.approx(2 / 3600 / 10_000 * 1e6)
    assert p.pricing.cached_input_per_m == pytest.approx(p.pricing.input_per_m / 10)
    assert p.pricing.output_per_m == pytest.approx(2 / 3600 / 1_000 * 1e6)
    want = (104 * p.pricing.input_per_m + 896 * p.pricing.input_per_m / 10
            + 20 * p.pricing.output_per_m) / 1e6
    assert p.cost(**STEP) == pytest.approx(want)
    free_hits = EnginePrice.model_validate({**GPU, "cached_fraction": 0})
    assert free_hits.cost(**{**STEP, "completion_tokens": 0}) == pytest.approx(
        104 * p.pricing.input_per_m / 1e6)


def test_a_per_token_price_is_the_list_price() -> None:
    p = EnginePrice.model_validate(API)
    assert p.kind == "per_token"
    assert p.cost(**STEP) == pytest.approx((104 * 3.0 + 896 * 0.3 + 20 * 15.0) / 1e6)
    assert p.pricing == Pricing(input_per_m=3.0, cached_input_per_m=0.3, output_per_m=15.0)


def test_the_embedded_engines_are_priced_by_their_calibration() -> None:
    # they declare no price: their worker prices each step by the engine's calibration
    # (the cpu-tiny preset until `warmloop calibrate` measures it); the old per-model
    # table stays, for replaying histories recorded before engines declared prices
    assert all(e.price is None for e in Settings().engine_endpoints)
    assert preset("cpu-tiny").engine_price() == EMBEDDED_ENGINE_PRICE
    assert PRICES["tiny"] == Pricing.self_hosted(gpu_usd_per_hour=0.80,
                                                 prefill_tokens_per_s=20_000,
                                                 decode_tokens_per_s=130)


# ---- engines in settings -----------------------------------------------------------------


def test_engines_declare_a_price_in_warmloop_engines(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARMLOOP_ENGINES", json.dumps([
        {"id": "gpu0", "url": "http://gpu0:8000", "model": "qwen", "price": GPU},
        {"id": "gpu1", "url": "http://gpu1:8000", "model": "qwen"},
    ]))
    s = Settings()
    assert s.engine("gpu0").price == EnginePrice.model_validate(GPU)
    assert s.engine("gpu1").price is None
    # child processes get the same engines (warmloop dev up passes settings by env)
    monkeypatch.setenv("WARMLOOP_ENGINES", settings_env(s)["WARMLOOP_ENGINES"])
    assert Settings().engines == s.engines


def test_the_old_ttl_cache_price_fields_become_its_per_token_price() -> None:
    e = EngineEndpoint.model_validate({"id": "api", "url": "https://api", "kind": "ttl_cache",
                                       "input_usd_per_mtok": 2.5, "output_usd_per_mtok": 10})
    # the fields not given keep the defaults they had
    assert e.price == EnginePrice(input_usd_per_mtok=2.5, cached_input_usd_per_mtok=0.3,
                                  output_usd_per_mtok=10)
    ttl = _ttl_cache(e)
    assert ttl is not None and (ttl.input_usd_per_mtok, ttl.cached_input_usd_per_mtok,
                                ttl.output_usd_per_mtok) == (2.5, 0.3, 10)
    assert _ttl_cache(EngineEndpoint(id="v", url="http://v")) is None


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kind": "ttl_cache"}, "a ttl_cache engine is billed per token"),
        ({"kind": "ttl_cache", "price": GPU}, "a ttl_cache engine is billed per token"),
        ({"input_usd_per_mtok": 1.0, "price": API}, "give the price once"),
        ({"price": {"gpu_usd_per_hour": 2.0}}, "missing: prefill_tokens_per_s"),
    ],
)
def test_engine_price_errors_say_what_to_change(fields: dict[str, Any], message: str) -> None:
    with pytest.raises(ValidationError) as e:
        EngineEndpoint.model_validate({"id": "x", "url": "http://x", **fields})
    assert message in str(e.value)


# ---- the worker prices its steps -----------------------------------------------------------


def _sse(*chunks: dict[str, Any]) -> bytes:
    return "".join(f"data: {json.dumps(c)}\n\n" for c in chunks).encode() + b"data: [DONE]\n\n"


def _engine(request: httpx.Request) -> httpx.Response:
    if request.url.path == "/health":
        return httpx.Response(200)
    if request.url.path == "/metrics":
        return httpx.Response(200, text="vllm:num_requests_running 2\n")
    call = {"index": 0, "id": "c1", "function": {"name": "search_kb",
                                                 "arguments": '{"topic": "crash"}'}}
    return httpx.Response(200, content=_sse(
        {"choices": [{"delta": {"role": "assistant"}}]},
        {"choices": [{"delta": {"tool_calls": [call]}, "finish_reason": "tool_calls"}]},
        {"choices": [], "usage": {"prompt_tokens": 1000, "completion_tokens": 20,
                                  "prompt_tokens_details": {"cached_tokens": 896}}}))


async def _generate(price: EnginePrice | None) -> GenerateResult:
    async with httpx.AsyncClient(transport=httpx.MockTransport(_engine)) as http:
        acts = InferenceActivities(engine_id="e0", base_url="http://e0", model="tiny", http=http,
                                   transcripts=TranscriptStore(object(), "b"), price=price)
        req = GenerateRequest(job_id="j", step=1, profile="ticket-triage",
                              task={"ticket_id": "T1001", "customer_id": "C100",
                                    "subject": "crash", "body": "it crashes"},
                              base_len=0, tail="Step 1 of 8.", max_tokens=64)
        return await ActivityEnvironment().run(acts.generate, req)


async def test_the_inference_worker_prices_each_step_at_its_engines_price() -> None:
    priced = await _generate(EnginePrice.model_validate(API))
    assert (priced.prompt_tokens, priced.cached_tokens, priced.completion_tokens) == (1000, 896,
                                                                                     20)
    assert priced.cost_usd == pytest.approx((104 * 3.0 + 896 * 0.3 + 20 * 15.0) / 1e6)
    assert (await _generate(None)).cost_usd is None  # no price: unknown, never a guess


async def test_the_heartbeat_carries_the_model_and_whether_a_price_is_declared() -> None:
    async with httpx.AsyncClient(transport=httpx.MockTransport(_engine)) as http:
        priced = await probe_engine(http, EngineEndpoint(id="g", url="http://g", model="qwen",
                                                         price=EnginePrice.model_validate(GPU)))
        unpriced = await probe_engine(http, EngineEndpoint(id="h", url="http://h", model="qwen"))
    assert priced.healthy and priced.running == 2
    assert (priced.model, priced.priced, unpriced.priced) == ("qwen", True, False)
    assert priced.offer() == EngineOffer(engine_id="g", model="qwen", priced=True)
    # a heartbeat from a worker that predates prices reads as unpriced
    old = priced.model_dump(exclude={"priced"})
    assert EngineHeartbeat.model_validate(old).priced is False


# ---- routing by model and price -------------------------------------------------------------

FLEET = [EngineOffer(engine_id="a", model="tiny", priced=True),
         EngineOffer(engine_id="b", model="tiny"),
         EngineOffer(engine_id="c", model="qwen", priced=True),
         EngineOffer(engine_id="d", model="qwen")]


def test_eligible_engines_serve_the_model_and_for_a_capped_job_declare_a_price() -> None:
    assert eligible_engines(FLEET, model=None, require_price=False) == ["a", "b", "c", "d"]
    assert eligible_engines(FLEET, model="qwen", require_price=False) == ["c", "d"]
    assert eligible_engines(FLEET, model=None, require_price=True) == ["a", "c"]
    assert eligible_engines(FLEET, model="tiny", require_price=True) == ["a"]
    assert eligible_engines([], model="qwen", require_price=True) == []  # an outage


def test_unservable_jobs_are_named_with_what_to_change() -> None:
    with pytest.raises(UnservableStepError) as e:
        eligible_engines(FLEET, model="llama", require_price=False)
    assert e.value.error_type == NO_ENGINE_FOR_MODEL
    assert str(e.value).startswith("no engine serves model llama (engines serve: qwen, tiny)")
    with pytest.raises(UnservableStepError) as e:
        eligible_engines(FLEET[1:2] + FLEET[3:], model="qwen", require_price=True)
    assert e.value.error_type == NO_PRICED_ENGINE
    assert str(e.value) == ('job has max_cost_usd but no engine serving model qwen declares a '
                            'price; add "price" to WARMLOOP_ENGINES')


class StubRegistry:
    def __init__(self, offers: list[EngineOffer]) -> None:
        self.hbs = [EngineHeartbeat(engine_id=o.engine_id, task_queue=f"engine.{o.engine_id}",
                                    model=o.model, url="u", healthy=True, priced=o.priced,
                                    at=0.0) for o in offers]
        self.routed: list[str] = []

    async def live(self) -> list[EngineHeartbeat]:
        return self.hbs

    async def in_flight_steps(self, ids: list[str]) -> dict[str, list[str]]:
        return {e: [] for e in ids}

    async def gateways(self) -> list[str]:
        return []

    async def step_routed(self, engine_id: str, key: str) -> None:
        self.routed.append(engine_id)


async def _route(req: RouteRequest, offers: list[EngineOffer] = FLEET) -> str:
    acts = RoutingActivities(StubRegistry(offers), object(),  # type: ignore[arg-type]
                             directory=EmptyDirectory())  # type: ignore[arg-type]
    return (await ActivityEnvironment().run(acts.route_step, req)).engine_id


async def test_route_step_considers_only_engines_that_can_serve_the_job() -> None:
    base = RouteRequest(job_id="j", step=1, profile="ticket-triage")
    assert await _route(base.model_copy(update={"model": "qwen", "require_price": True})) == "c"
    assert await _route(base.model_copy(update={"model": "tiny", "require_price": True})) == "a"
    assert await _route(base.model_copy(update={"model": "qwen", "exclude": ["c"]})) == "d"
    # every qwen engine busy failing this step: an outage, retried, not "no engine serves"
    with pytest.raises(ApplicationError) as e:
        await _route(base.model_copy(update={"model": "qwen", "exclude": ["c", "d"]}))
    assert e.value.type == "NoLiveEngine" and not e.value.non_retryable


@pytest.mark.parametrize(
    ("update", "error_type"),
    [({"model": "llama"}, NO_ENGINE_FOR_MODEL),
     ({"model": "qwen", "require_price": True}, NO_PRICED_ENGINE)],
)
async def test_route_step_refuses_an_unservable_job_without_retries(
    update: dict[str, Any], error_type: str
) -> None:
    unpriced = [o.model_copy(update={"priced": False}) for o in FLEET]
    with pytest.raises(ApplicationError) as e:
        await _route(RouteRequest(job_id="j", step=1, profile="p", **update), unpriced)
    assert e.value.type == error_type and e.value.non_retryable


# ---- caps and the client-side check ---------------------------------------------------------


def test_a_cost_cap_cannot_be_enforced_on_steps_of_unknown_cost() -> None:
    capped = JobLimits(max_steps=8, max_cost_usd=1.0)
    unknown = Usage(steps=1, cost_unknown_steps=1)
    hit = check_before_step(capped, unknown, 0.0)
    assert hit is not None and hit.state == "INVALID_INPUT"
    assert "cost cap of $1 cannot be enforced" in hit.reason
    assert check_before_step(JobLimits(max_steps=8), unknown, 0.0) is None
    assert check_before_step(capped, Usage(steps=1, cost_usd=0.5), 0.0) is None


runner = CliRunner()
TICKET = {"ticket_id": "T1001", "customer_id": "C100", "subject": "crash", "body": "it crashes"}


@pytest.fixture
def no_stack(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    # nothing listens on port 1: Temporal and Redis are unreachable, configured engines count
    monkeypatch.setenv("WARMLOOP_TEMPORAL_ADDRESS", "127.0.0.1:1")
    monkeypatch.setenv("WARMLOOP_REDIS_URL", "redis://127.0.0.1:1/0")
    path = tmp_path / "ticket.json"
    path.write_text(json.dumps(TICKET))
    return path


def test_submit_refuses_a_capped_job_when_no_engine_declares_a_price(
    no_stack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WARMLOOP_ENGINES", json.dumps(
        [{"id": "gpu0", "url": "http://gpu0:8000", "model": "qwen"}]))
    result = runner.invoke(app, ["submit", "ticket-triage", "--input", str(no_stack),
                                 "--max-cost-usd", "0.5"])
    assert result.exit_code == 1
    assert ("error: job has max_cost_usd but no engine declares a price; add \"price\" to "
            "WARMLOOP_ENGINES") in " ".join(result.output.split())
    assert "cannot reach Temporal" not in result.output and "Traceback" not in result.output


def test_submit_refuses_a_job_whose_model_no_engine_serves(
    no_stack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WARMLOOP_ENGINES", json.dumps(
        [{"id": "gpu0", "url": "http://gpu0:8000", "model": "tiny", "price": GPU}]))
    REGISTRY.add(dataclasses.replace(get_profile("ticket-triage"), name="triage-qwen",
                                     model="qwen"), source="test")
    try:
        result = runner.invoke(app, ["submit", "triage-qwen", "--input", str(no_stack)])
    finally:
        REGISTRY.remove("triage-qwen")
    assert result.exit_code == 1
    assert "error: no engine serves model qwen (engines serve: tiny)" in " ".join(
        result.output.split())
    assert "cannot reach Temporal" not in result.output


class _Started:
    """Stands in for Temporal's client: records the workflows ``JobClient`` starts."""

    def __init__(self) -> None:
        self.ids: list[str] = []

    async def start_workflow(self, *args: Any, id: str, **kw: Any) -> None:  # noqa: A002
        self.ids.append(id)


async def test_job_client_refuses_what_no_engine_can_serve_as_submit_does(
    no_stack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WARMLOOP_ENGINES", json.dumps(
        [{"id": "gpu0", "url": "http://gpu0:8000", "model": "tiny"}]))
    temporal = _Started()
    jobs = JobClient(temporal, fleet=Settings())  # type: ignore[arg-type]
    capped = JobLimits(max_cost_usd=0.5)
    with pytest.raises(UnservableJobError, match="no engine declares a price"):
        await jobs.submit("ticket-triage", TICKET, limits=capped)
    REGISTRY.add(dataclasses.replace(get_profile("ticket-triage"), name="triage-qwen",
                                     model="qwen"), source="test")
    try:
        with pytest.raises(InvalidJobError, match=r"no engine serves model qwen"):
            await jobs.submit("triage-qwen", TICKET)
    finally:
        REGISTRY.remove("triage-qwen")
    assert temporal.ids == []  # nothing started
    # an uncapped job on the same fleet starts; without fleet settings nothing is checked
    assert await jobs.submit("ticket-triage", TICKET, job_id="a") == "a"
    unchecked = JobClient(temporal)  # type: ignore[arg-type]
    assert await unchecked.submit("ticket-triage", TICKET, job_id="b", limits=capped) == "b"
    assert temporal.ids == ["a", "b"]


def test_batch_run_refuses_a_profile_no_engine_serves_before_starting(
    no_stack: Path, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("WARMLOOP_ENGINES", json.dumps(
        [{"id": "gpu0", "url": "http://gpu0:8000", "model": "tiny", "price": GPU}]))
    records = tmp_path / "tickets.jsonl"
    records.write_text(json.dumps(TICKET) + "\n")
    REGISTRY.add(dataclasses.replace(get_profile("ticket-triage"), name="triage-qwen",
                                     model="qwen"), source="test")
    try:
        result = runner.invoke(app, ["batch", "run", str(records), "--profile", "triage-qwen"])
    finally:
        REGISTRY.remove("triage-qwen")
    assert result.exit_code == 1
    assert "error: no engine serves model qwen (engines serve: tiny)" in " ".join(
        result.output.split())
    # it never reached Temporal (unreachable here): the fleet check came first
    assert "cannot reach Temporal" not in result.output and "Traceback" not in result.output
    served = runner.invoke(app, ["batch", "run", str(records), "--profile", "ticket-triage"])
    assert served.exit_code == 1 and "cannot reach Temporal" in served.output


def test_submit_lets_a_capped_job_through_to_a_priced_fleet(
    no_stack: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("WARMLOOP_ENGINES", json.dumps(
        [{"id": "gpu0", "url": "http://gpu0:8000", "model": "qwen", "price": GPU}]))
    result = runner.invoke(app, ["submit", "ticket-triage", "--input", str(no_stack),
                                 "--max-cost-usd", "0.5"])
    # the fleet check passed: it went on to Temporal, which is not running here
    assert result.exit_code == 1 and "cannot reach Temporal" in result.output
