"""Per-engine model and price: routing by the profile's model and, for a job with a cost
cap, by a declared price; unknown cost on unpriced engines; replay of the old pricing."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Iterator

import pytest
from rich.console import Console
from temporalio.client import Client
from temporalio.testing import WorkflowEnvironment

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import TICKET, always, run_job, workers
from tests.workflow.test_replay import _replayer
from warmloop.workers.report import report_table, summarize
from warmloop.workers.settings import EMBEDDED_ENGINE_PRICE
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput, JobResult, JobState
from warmloop.workflows.pricing import EnginePrice
from warmloop.workflows.profiles import REGISTRY, get_profile

SEARCH = reply("search_kb", '{"topic": "crash"}')
CAPPED = JobLimits(max_steps=3, max_cost_usd=1.0)
API = EnginePrice(input_usd_per_mtok=3.0, cached_input_usd_per_mtok=0.3, output_usd_per_mtok=15.0)
QWEN_PROFILE = "ticket-triage-qwen"


@pytest.fixture
def qwen_profile() -> Iterator[str]:
    """ticket-triage, but its steps need model "qwen"."""
    REGISTRY.add(dataclasses.replace(get_profile("ticket-triage"), name=QWEN_PROFILE,
                                     model="qwen"), source="test")
    try:
        yield QWEN_PROFILE
    finally:
        REGISTRY.remove(QWEN_PROFILE)


async def run_profile(client: Client, profile: str, **kw: object) -> JobResult:
    job = JobInput(profile=profile, task=TICKET, **kw)  # type: ignore[arg-type]
    return await client.execute_workflow(AgentJob.run, job, id=f"job-{uuid.uuid4().hex[:8]}",
                                         task_queue=AGENT_TASK_QUEUE)


async def test_a_capped_job_on_an_unpriced_fleet_ends_with_the_reason_at_its_first_step(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(SEARCH), engines=["fake0", "fake1"], prices={})
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, limits=CAPPED)
    assert res.state == JobState.INVALID_INPUT
    assert "job has max_cost_usd but no engine declares a price" in res.reason
    assert 'add "price" to WARMLOOP_ENGINES' in res.reason
    # refused at once: one routing attempt, no retries, no step ran
    assert len(fakes.routes) == 1 and fakes.routes[0].require_price
    assert not fakes.generate_requests and not res.steps


async def test_a_capped_job_runs_only_on_priced_engines_and_is_charged_their_price(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(SEARCH), engines=["fake0", "fake1", "fake2"],
                           prices={"fake2": API})
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, limits=CAPPED)
    assert res.state == JobState.LOOP_CAP
    assert fakes.served_by == ["fake2"] * 3
    assert all(r.require_price for r in fakes.routes)
    # the per-token price: 104 uncached, 896 cached input, 20 output tokens per step
    step = (104 * 3.0 + 896 * 0.3 + 20 * 15.0) / 1e6
    assert [s.cost_usd for s in res.steps] == pytest.approx([step] * 3)
    assert res.usage.cost_usd == pytest.approx(3 * step)
    assert res.usage.cost_unknown_steps == 0


async def test_an_uncapped_job_does_not_need_a_price(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(SEARCH), prices={})
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=3)
    assert res.state == JobState.LOOP_CAP and len(res.steps) == 3
    assert not any(r.require_price for r in fakes.routes)
    # cost unknown, not a made-up figure
    assert [s.cost_usd for s in res.steps] == [None, None, None]
    assert res.usage.cost_unknown_steps == 3 and res.usage.cost_usd == 0.0
    assert summarize([res]).cost_unknown_jobs == 1
    console = Console(record=True, width=200)
    console.print(report_table([res], title="t"))
    rows = {line.split("│")[1].strip(): line.split("│")[2].strip()
            for line in console.export_text().splitlines() if line.count("│") == 3}
    assert rows["cost per task p50 / p95"] == "unknown (1 of 1 jobs unpriced)"
    assert rows["cost per accepted outcome"] == "unknown"


async def test_a_capped_job_pinned_to_an_unpriced_engine_stops_after_one_step(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(SEARCH), prices={})
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, limits=JobLimits(max_steps=5, max_cost_usd=1.0),
                            engine_id="fake0")
    assert res.state == JobState.INVALID_INPUT
    assert "cost cap of $1 cannot be enforced" in res.reason
    assert len(res.steps) == 1 and res.usage.cost_unknown_steps == 1


async def test_a_profile_that_names_a_model_is_routed_only_to_engines_serving_it(
    time_skipping_env: WorkflowEnvironment, qwen_profile: str,
) -> None:
    fakes = FakeActivities(always(SEARCH), engines=["fake0", "fake1", "fake2"],
                           models={"fake1": "qwen"})
    async with workers(time_skipping_env, fakes) as client:
        res = await run_profile(client, qwen_profile, max_steps=3)
    assert res.state == JobState.LOOP_CAP
    assert fakes.served_by == ["fake1"] * 3
    assert {r.model for r in fakes.routes} == {"qwen"}
    # the default profile takes any engine
    async with workers(time_skipping_env, fakes) as client:
        await run_job(client, max_steps=1)
    assert fakes.routes[-1].model is None


async def test_no_engine_serving_the_profiles_model_ends_the_job_with_the_reason(
    time_skipping_env: WorkflowEnvironment, qwen_profile: str,
) -> None:
    fakes = FakeActivities(always(SEARCH), engines=["fake0", "fake1"])
    async with workers(time_skipping_env, fakes) as client:
        res = await run_profile(client, qwen_profile, max_steps=3)
    assert res.state == JobState.INVALID_INPUT
    assert "no engine serves model qwen (engines serve: tiny)" in res.reason
    assert len(fakes.routes) == 1 and not fakes.generate_requests


async def test_a_capped_job_with_a_model_needs_a_priced_engine_of_that_model(
    time_skipping_env: WorkflowEnvironment, qwen_profile: str,
) -> None:
    # fake0 is priced but serves another model; fake1 serves qwen without a price
    fakes = FakeActivities(always(SEARCH), engines=["fake0", "fake1"],
                           models={"fake1": "qwen"}, prices={"fake0": EMBEDDED_ENGINE_PRICE})
    async with workers(time_skipping_env, fakes) as client:
        res = await run_profile(client, qwen_profile, limits=CAPPED)
    assert res.state == JobState.INVALID_INPUT
    assert "no engine serving model qwen declares a price" in res.reason


async def test_a_fresh_history_with_an_unpriced_engine_replays(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(SEARCH), prices={})
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=2)
        history = await client.get_workflow_handle(res.job_id).fetch_history()
    assert res.usage.cost_unknown_steps == 2
    await _replayer().replay_workflow(history)
