"""The model ladder on the real stack (its own: port offset 95, one engine serving
"small" and one serving "large"): a step runs on the small model's engine first, real
vLLM logprobs decide whether it is asked again of the large model's engine, escalated
asks are recorded with their reason, the kept call is the large model's, and the large
engine gets the job's prefix once (later escalations of the job find it cached)."""

from __future__ import annotations

import uuid
from pathlib import Path

import pytest
from rich.console import Console

from bench.common import bench_settings, bench_stack
from bench.synthetic_profiles import LADDER_MODELS
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput, JobResult

pytestmark = pytest.mark.integration

STATE = Path(".warmloop/bench-ladder-test").resolve()


async def test_steps_start_on_the_small_pool_and_escalate_to_a_warm_large_engine() -> None:
    state = STATE
    settings = bench_settings(
        "ladder-test", engines=2, kv_cache_bytes=64 * 1024 * 1024,
        engine_models=list(LADDER_MODELS),
        model_paths={"large": state / "models" / "tiny-llama"})
    # the large pool serves the same (random) weights as the small one, from its dir
    assert settings.engine_model_path(settings.engine_endpoints[1]) == \
        settings.state_dir.resolve() / "models" / "tiny-llama"
    async with bench_stack(settings, Console(stderr=True), keep=False) as fleet:
        pools = {e.id: e.model for e in settings.engine_endpoints}
        # lookup only (no close): the job runs to its step cap, one ask pair a step
        job = JobInput(profile="synthetic-laddered", max_steps=6, hold_policy="never",
                       tools=["lookup"],
                       task={"case_id": "S4242", "text": "a case for the model ladder test"})
        res: JobResult = await fleet.client.execute_workflow(
            AgentJob.run, job, id=f"ladder-{uuid.uuid4().hex[:6]}",
            task_queue=AGENT_TASK_QUEUE)
    steps = res.steps
    assert steps, res.reason
    # every ask ran in the pool of the model it names
    assert all(pools[s.engine_id] == s.model for s in steps), \
        [(s.engine_id, s.model) for s in steps]
    escalated = [s for s in steps if s.escalated]
    kept = [s for s in steps if not s.escalated]
    # the random-weight model is never sure of a call: every small ask goes up
    assert escalated and all(s.model == "small" for s in escalated)
    assert {s.escalated for s in escalated} <= {"low_confidence", "invalid", "hard_tool"}
    assert all(s.model == "large" for s in kept)
    # an escalated ask and the large model's answer to the same prompt alternate
    assert [s.model for s in steps[:2]] == ["small", "large"]
    # the large engine gets the job's prefix once: its later asks find it cached
    large = [s for s in steps if s.model == "large"]
    assert len(large) >= 2, [(s.model, s.escalated) for s in steps]
    assert all(s.cached_tokens > 0 for s in large[1:]), [s.cached_tokens for s in large]
    # the report's figures come from the steps
    assert res.usage.steps == len(steps)
