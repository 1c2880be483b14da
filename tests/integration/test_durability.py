"""Durability on the real stack: a killed agent worker, continue-as-new mid-job, a
long job's history, metrics and the report, all against real vLLM engines."""

from __future__ import annotations

import asyncio
import json
import signal
import urllib.request
import uuid

import pytest
from temporalio.client import Client

from tests.integration.cli import warmloop
from tests.polling import eventually
from warmloop.activities.tools import EffectLedger
from warmloop.infra.stack import Stack
from warmloop.workers.approvals import dev_approver
from warmloop.workers.clients import build_redis
from warmloop.workers.demo import bundled_tickets, stand_in_approver
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.contracts import AGENT_TASK_QUEUE, JobInput, JobState
from warmloop.workflows.profiles import get_profile

pytestmark = pytest.mark.integration
TRIAGE = get_profile("ticket-triage")
# Tools that neither end the job nor wait for a human: a job offered only these runs
# until its step cap.
UNGATED = [t.name for t in TRIAGE.tools
           if not t.finishes_job and all(r.tool != t.name for r in TRIAGE.approvals)]
UNCAPPED = {t.name: 10_000 for t in TRIAGE.tools}


async def test_killed_agent_worker_job_finishes_with_no_side_effect_applied_twice(
    client: Client, stack: Stack, settings: Settings
) -> None:
    # Only side-effect tools are offered, so nearly every step writes to the world.
    job = JobInput(profile="ticket-triage", task=bundled_tickets()[1],
                   tools=["draft_reply", "set_priority"],
                   limits=JobLimits(max_steps=10, max_tool_calls=UNCAPPED))
    handle = await client.start_workflow(AgentJob.run, job, id=f"kill-{uuid.uuid4().hex[:8]}",
                                         task_queue=AGENT_TASK_QUEUE)
    # urgent priorities wait for a human: play the approver from the start, as the demo
    # does (it rides out the worker's restart)
    done = asyncio.Event()
    bot = dev_approver(settings)
    approver = asyncio.create_task(stand_in_approver(client, bot, [handle], done))
    try:
        async def progressed() -> bool:
            return (await handle.query(AgentJob.status)).step >= 3

        await eventually(progressed, attempts=1200, interval_s=0.1)
        killed = stack.stop_part("agent-worker", signal.SIGKILL)
        assert killed is not None
        await asyncio.to_thread(stack.up)  # restarts the missing agent worker
        res = await asyncio.wait_for(handle.result(), timeout=300)
    finally:
        done.set()
        await approver

    assert res.state == JobState.LOOP_CAP and len(res.steps) == 10
    ledger = EffectLedger(build_redis(settings))
    effects = await ledger.effects(res.job_id)
    ran = [s.step for s in res.steps if s.valid and s.tool in ("draft_reply", "set_priority")
           and not any(a.approval.step == s.step and a.outcome != "approved"
                       for a in res.approvals)]
    # draft_reply may answer "no article" (no effect); every effect belongs to a step
    # that ran the tool, and no step has two
    assert set(effects) <= set(ran)
    counts = await ledger.counts(res.job_id)
    assert counts.get("applied", 0) == len(effects)


async def test_forced_continue_as_new_keeps_the_prefix_warm(client: Client) -> None:
    job = JobInput(profile="ticket-triage", task=bundled_tickets()[2], tools=UNGATED,
                   continue_as_new_after_steps=3,
                   limits=JobLimits(max_steps=6, max_tool_calls=UNCAPPED))
    res = await client.execute_workflow(AgentJob.run, job, id=f"can-{uuid.uuid4().hex[:8]}",
                                        task_queue=AGENT_TASK_QUEUE)
    assert res.runs == 2 and len(res.steps) == 6
    after_boundary = res.steps[3]
    assert after_boundary.route_reason == "sticky"
    assert after_boundary.cached_tokens > 0
    assert all(s.cached_tokens > 0 for s in res.steps[1:])


async def test_a_200_step_job_keeps_its_history_under_2_mb(client: Client) -> None:
    """A 200-step job takes ~5 minutes on these CPU engines, so this one runs 48 real
    steps and reads the history's growth per step event by event: it must stay flat (a
    step that re-sent the transcript would grow with the step) and, extended to 200
    steps, stay under Temporal's 2 MB. tests/workflow's 200-step job runs the whole
    length with fake activities."""
    steps, whole = 48, 200
    job = JobInput(profile="ticket-triage", task=bundled_tickets()[3], tools=UNGATED,
                   limits=JobLimits(max_steps=steps, max_tool_calls=UNCAPPED))
    wid = f"long-{uuid.uuid4().hex[:8]}"
    res = await client.execute_workflow(AgentJob.run, job, id=wid, task_queue=AGENT_TASK_QUEUE)
    assert len(res.steps) == steps and res.runs == 1, res.reason
    handle = client.get_workflow_handle(wid)
    desc = await handle.describe()
    size = desc.raw_description.workflow_execution_info.history_size_bytes
    # the history's encoded size when each model step's activity completed
    history = await handle.fetch_history()
    generate = {e.event_id for e in history.events
                if e.HasField("activity_task_scheduled_event_attributes")
                and e.activity_task_scheduled_event_attributes.activity_type.name == "generate"}
    at_step: list[int] = []
    total = 0
    for e in history.events:
        total += e.ByteSize()
        if e.HasField("activity_task_completed_event_attributes") and \
                e.activity_task_completed_event_attributes.scheduled_event_id in generate:
            at_step.append(total)
    assert len(at_step) >= steps, len(at_step)  # a step's retries complete no extra ask
    q = steps // 4
    second_quarter = (at_step[2 * q - 1] - at_step[q - 1]) / q
    last_quarter = (at_step[4 * q - 1] - at_step[3 * q - 1]) / q
    per_step = (at_step[-1] - at_step[q - 1]) / (len(at_step) - q)
    projected = size + (whole - steps) * per_step
    print(f"{steps}-step job: history {size:,} bytes, "
          f"{desc.raw_description.workflow_execution_info.history_length} events, "
          f"{per_step:,.0f} bytes a step (quarters 2 and 4: {second_quarter:,.0f}, "
          f"{last_quarter:,.0f}), {projected:,.0f} bytes projected at {whole} steps; "
          f"{res.usage.prompt_tokens:,} prompt tokens of which {res.usage.cached_tokens:,} "
          "cached")
    assert last_quarter < 1.5 * second_quarter, (second_quarter, last_quarter)
    assert 0 < projected < 2 * 1024 * 1024
    assert res.cache_hit_share > 0.8


def test_report_and_metrics_show_real_usage(stack: Stack, settings: Settings) -> None:
    # one profile: a column per profile of every job the suite ran would fold the
    # labels even at 200 columns
    out = warmloop("report", "--since", "1h", "--profile", "ticket-triage")
    assert out.returncode == 0, out.stderr
    assert "cost per task p50 / p95" in out.stdout and "prompt tokens from cache" in out.stdout
    assert "ticket-triage" in out.stdout
    # where the steps' time went, stage by stage, from the steps' own timings
    assert "where each step's time went" in out.stdout, out.stdout
    assert "Temporal schedule-to-start" in out.stdout and "decode" in out.stdout
    body = urllib.request.urlopen(
        f"http://127.0.0.1:{settings.agent_metrics_port}/metrics", timeout=5).read().decode()
    samples = {line.split("{")[0]: line for line in body.splitlines()
               if line.startswith("warmloop_") and not line.startswith("#")}
    assert "warmloop_cached_tokens" in samples or "warmloop_cached_tokens_total" in samples
    cached = [float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
              if line.startswith("warmloop_cached_tokens")]
    assert sum(cached) > 0
    json.dumps(samples)  # all plain text
