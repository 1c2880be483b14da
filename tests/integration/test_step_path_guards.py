"""Guards for the properties the headline figures rest on, on the real stack: each
fails when the property breaks, so a regression shows in `make test`, not first in a
benchmark run (bench-routing's hit rate, bench-pauses' touch cost).

- a sticky step after a short pause finds its whole previous prompt cached;
- a new job of a warm profile lands where the profile's prefix is;
- a step moves engines only for a named reason;
- a step after a short pause takes the route its previous step's worker chose;
- every step carries its time breakdown, and the stages add up to the step;
- an engine's model worker sleeps between steps instead of spinning on a core.
(A touch computing at most a couple of tokens is guarded in test_holds.py.)"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from pathlib import Path

import httpx
import pytest
import redis.asyncio as aioredis
from temporalio.client import Client

from warmloop.activities.registry import EngineRegistry
from warmloop.infra.stack import Stack, engine_compute_pids
from warmloop.workers.engine_metrics import reset_caches
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput, JobResult, JobState

pytestmark = pytest.mark.integration

TEXT = "a synthetic case for the step path guards, long enough to fill a block or two"



async def _block_size(redis: aioredis.Redis, settings: Settings) -> int:
    return max(e.block_size for e in await EngineRegistry(
        redis, ttl_s=settings.engine_ttl_s).live())


async def _job(client: Client, profile: str, n: int, *, steps: int) -> JobResult:
    return await client.execute_workflow(
        AgentJob.run,
        JobInput(profile=profile, task={"case_id": f"S9{n:03d}", "text": TEXT},
                 max_steps=steps, tools=["lookup"], hold_policy="never"),
        id=f"guard-{profile}-{uuid.uuid4().hex[:6]}", task_queue=AGENT_TASK_QUEUE)


async def _routes_in_workflow(client: Client, job_id: str) -> int:
    """How many steps the workflow routed itself (route_step local activities)."""
    history = await client.get_workflow_handle(job_id).fetch_history()
    return sum(1 for e in history.events
               if e.HasField("marker_recorded_event_attributes")
               and e.marker_recorded_event_attributes.marker_name == "core_local_activity"
               and b'"activity_type":"route_step"'
               in e.marker_recorded_event_attributes.details["data"].payloads[0].data)


async def test_a_sticky_step_after_a_short_pause_finds_its_whole_previous_prompt_cached(
    client: Client, settings: Settings, redis: aioredis.Redis,
) -> None:
    block = await _block_size(redis, settings)
    res = await _job(client, "synthetic-support", 1, steps=5)
    assert res.state in (JobState.LOOP_CAP, JobState.INVALID_OUTPUT, JobState.FINISHED), \
        res.reason
    sticky = 0
    for prev, step in zip(res.steps, res.steps[1:], strict=False):
        if step.engine_id != prev.engine_id:
            # moving is allowed only for a named reason: a warmer or a less loaded engine
            assert step.route_reason in ("prefix", "least_loaded"), step
            continue
        assert step.route_reason == "sticky", step
        sticky += 1
        # The previous prompt's full blocks, less the one its volatile tail (the budget
        # line, rewritten each step) may have reached, must all come from the cache:
        # the lookup's pause (well under a second) gives the idle engine no reason to
        # evict them.
        keepable = max(0, (prev.prompt_tokens // block - 1) * block)
        assert step.cached_tokens >= keepable, (prev, step)
    assert sticky >= 2, res.steps
    # the workflow routed its first step; each later one took the route its previous
    # step's worker chose as that step ended (no routing round trip of its own), unless
    # a step's output ended the job or broke (then the next step routes itself)
    assert 1 <= await _routes_in_workflow(client, res.job_id) < len(res.steps), res.steps


async def test_a_new_job_of_a_warm_profile_lands_where_its_prefix_is(
    client: Client, settings: Settings, redis: aioredis.Redis,
) -> None:
    urls = [e.url.rstrip("/") for e in settings.engine_endpoints]
    ids = [e.id for e in settings.engine_endpoints]
    async with httpx.AsyncClient(timeout=30.0) as http:
        await reset_caches(http, urls, redis, ids)
    first = await _job(client, "synthetic-legal", 2, steps=2)
    warm = first.steps[-1].engine_id
    second = await _job(client, "synthetic-legal", 3, steps=2)
    step = second.steps[0]
    # the only engine holding the profile's system prompt and tools is `warm`
    assert step.engine_id == warm, (warm, step)
    assert step.route_reason == "prefix", step
    assert step.predicted_cached_tokens and step.predicted_cached_tokens >= 1024, step
    assert step.cached_tokens >= 1024, step


async def test_every_step_carries_its_time_breakdown(client: Client) -> None:
    res = await _job(client, "synthetic-billing", 4, steps=3)
    for s in res.steps:
        t = s.timing
        assert t is not None, s
        assert t.ttft_ms == pytest.approx(s.ttft_ms)
        # the worker's stages from pickup to the last token fit inside the step's
        # latency plus what preceded the request; the workflow-side ones were measured
        assert t.ttft_ms + t.decode_ms == pytest.approx(s.latency_ms, rel=0.01, abs=1.0)
        assert t.routing_ms > 0 and t.return_ms >= 0, t
        assert t.prompt_ms > 0, t
        assert t.overhead_ms < 60_000, t
        # what the engine saw as dispatch (scheduled -> request sent) is the sum of the
        # stages before the request, to within clock rounding
        before = t.schedule_to_start_ms + t.worker_pickup_ms + t.prompt_ms + t.admission_ms
        assert before == pytest.approx(s.dispatch_ms, abs=2.0), (t, s.dispatch_ms)


def _cpu_s(pid: int) -> float:
    """CPU time (user + system) a process has used, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _model_workers(stack: Stack, settings: Settings) -> list[int]:
    workers = []
    for e in settings.engine_endpoints:
        pid = stack._pid(f"engine-{e.id}")
        assert pid is not None, e.id
        workers += [p for p in engine_compute_pids(pid)
                    if Path(f"/proc/{p}/comm").read_text().startswith("VLLM::Worker")]
    return workers


async def test_an_engines_model_worker_sleeps_between_steps(
    client: Client, stack: Stack, settings: Settings,
) -> None:
    """vLLM's worker busy-waits a whole second after each step; the stack's engines cut
    that short (infra/vllm_cpu_server.py), or two engines in use would keep both of this
    machine's cores spinning and the control plane waiting behind them."""
    workers = _model_workers(stack, settings)
    assert len(workers) == len(settings.engine_endpoints), workers
    await _job(client, "synthetic-support", 7, steps=2)  # both just served, or one did
    before, t0 = [_cpu_s(p) for p in workers], time.monotonic()
    await asyncio.sleep(3.0)  # the window measured, not a wait for something
    window = time.monotonic() - t0
    used = [_cpu_s(p) - b for p, b in zip(workers, before, strict=True)]
    # a spinning worker uses its core for the whole second after its last step
    assert all(u < 0.15 * window for u in used), (used, window)

