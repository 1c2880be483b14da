"""A tenant's job on the time-skipping server: it runs as ``<tenant>/<job id>``, passes
its tenant to every step, route and prewarm, is refused when its id is not its
tenant's, and waits out a spent hour on a durable timer (or ends QUOTA_EXHAUSTED when
that would pass its wall cap). A default-tenant job's history is as before."""

from __future__ import annotations

import os
import uuid
from pathlib import Path

from temporalio import activity
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import TICKET, workers
from warmloop.workers.temporal_plugin import sandbox_runner
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    GenerateRequest,
    GenerateResult,
    JobInput,
    JobResult,
    JobState,
    RouteRequest,
)
from warmloop.workflows.routing import RouteDecision
from warmloop.workflows.tenants import TENANT_QUOTA_EXCEEDED

HISTORIES = Path(__file__).parent / "histories"


def _script(req: GenerateRequest) -> GenerateResult:
    if req.step < 3:
        return reply("search_kb", '{"topic": "crash"}')
    return reply("finish", '{"resolution": "resolved", "priority": "high"}')


async def _run(client: Client, wid: str, **kw: object) -> JobResult:
    job = JobInput(profile="ticket-triage", task=TICKET, **kw)  # type: ignore[arg-type]
    return await client.execute_workflow(AgentJob.run, job, id=wid,
                                         task_queue=AGENT_TASK_QUEUE)


def _tag() -> str:
    return uuid.uuid4().hex[:8]


async def test_a_tenants_job_runs_as_its_namespaced_id_and_passes_its_tenant_on(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(_script)
    wid = f"acme/t-{_tag()}"
    async with workers(time_skipping_env, fakes) as client:
        res = await _run(client, wid, tenant="acme")
    assert res.state == JobState.FINISHED, res.reason
    assert res.job_id == wid
    assert [r.tenant for r in fakes.generate_requests] == ["acme"] * 3
    assert {r.job_id for r in fakes.generate_requests} == {wid}
    assert [r.tenant for r in fakes.routes] == ["acme"] * 3
    assert fakes.stored[0].job_id == wid  # its S3 keys follow from the namespaced id


async def test_a_job_whose_id_is_not_its_tenants_is_refused(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(_script)
    t = _tag()
    cases = [  # (tenant, workflow id)
        ("acme", f"globex/x-{t}"),  # another tenant's namespace
        ("acme", f"x-{t}"),  # a bare id: the default tenant's
        ("default", f"acme/y-{t}"),  # a default job inside a tenant's namespace
        ("default", f"default/z-{t}"),  # the default tenant has no prefix
        ("Bad!", f"Bad!/w-{t}"),
        ("acme", f"acme/a/b-{t}"),
    ]
    async with workers(time_skipping_env, fakes) as client:
        for tenant, wid in cases:
            res = await _run(client, wid, tenant=tenant)
            assert res.state == JobState.INVALID_INPUT, (tenant, wid, res.reason)
            assert "invalid job input" in res.reason
    assert fakes.generate_requests == []  # refused before any step


async def test_a_default_tenant_job_records_no_tenant_marker(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(_script)
    async with workers(time_skipping_env, fakes) as client:
        res = await _run(client, f"plain-{_tag()}")
        history = await client.get_workflow_handle(res.job_id).fetch_history()
    assert res.state == JobState.FINISHED
    markers = [e for e in history.events
               if e.event_type == EventType.EVENT_TYPE_MARKER_RECORDED]
    assert markers == [] or all(b"tenant" not in e.SerializeToString() for e in markers)
    assert all(r.tenant == "default" for r in fakes.generate_requests)


class QuotaFakes(FakeActivities):
    """route_step refuses the job's step ``refuse_at`` for a spent hour, the first ``times``
    times it is asked (the route the step before's worker takes for it included)."""

    def __init__(self, refuse_at: int, times: int, retry_after_s: float) -> None:
        super().__init__(_script)
        self.refuse_at, self.times, self.retry_after_s = refuse_at, times, retry_after_s
        self.refused = 0

    @activity.defn(name="route_step")
    async def route_step(self, req: RouteRequest) -> RouteDecision:
        if req.step == self.refuse_at and self.refused < self.times:
            self.refused += 1
            self.routes.append(req)
            raise ApplicationError(
                f"tenant {req.tenant} has used 1,000 of its 1,000 tokens per hour "
                "(tokens_per_hour quota)", {"retry_after_s": self.retry_after_s},
                type=TENANT_QUOTA_EXCEEDED, non_retryable=True)
        return await super().route_step(req)


async def test_a_spent_hour_makes_the_next_step_wait_on_a_timer_then_go_on(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = QuotaFakes(refuse_at=2, times=2, retry_after_s=1800)
    wid = "acme/quota-replay"  # recorded: the tenant's patch depends on the id
    async with workers(time_skipping_env, fakes) as client:
        res = await _run(client, wid, tenant="acme",
                         limits=JobLimits(max_steps=8, max_wall_time_s=7200))
        history = await client.get_workflow_handle(wid).fetch_history()
    assert res.state == JobState.FINISHED, res.reason
    # refused by step 1's worker (its route for step 2) and again at the step, which waits
    assert [r.mark_in_flight for r in fakes.routes if r.step == 2] == [False, True, True]
    assert fakes.refused == 2 and len(res.steps) == 3
    timers = [e.timer_started_event_attributes.start_to_fire_timeout.ToSeconds()
              for e in history.events if e.event_type == EventType.EVENT_TYPE_TIMER_STARTED]
    assert timers == [1800]
    # a tenant's history (the "tenants" patch marker and the quota timer) replays
    await Replayer(workflows=[AgentJob], data_converter=pydantic_data_converter,
                   workflow_runner=sandbox_runner()).replay_workflow(history)
    if os.environ.get("WARMLOOP_RECORD_HISTORIES"):
        (HISTORIES / "agent_job_tenant_quota_wait.json").write_text(history.to_json())


async def test_a_spent_hour_past_the_wall_cap_ends_the_job_quota_exhausted(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = QuotaFakes(refuse_at=2, times=99, retry_after_s=1800)
    wid = f"acme/qx-{_tag()}"
    async with workers(time_skipping_env, fakes) as client:
        res = await _run(client, wid, tenant="acme",
                         limits=JobLimits(max_steps=8, max_wall_time_s=600))
    assert res.state == JobState.QUOTA_EXHAUSTED, res.reason
    assert "tokens_per_hour" in res.reason and "wall" in res.reason
    assert len(res.steps) == 1 and len(res.transcript) == 2  # step 1's call and result kept
    assert fakes.stored and fakes.stored[-1].job_id == wid
    assert fakes.generate_requests[-1].step == 1  # step 2 never reached an engine


async def test_a_job_without_a_wall_cap_waits_for_the_hour(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = QuotaFakes(refuse_at=1, times=2, retry_after_s=3000)
    async with workers(time_skipping_env, fakes) as client:
        res = await _run(client, f"acme/qw-{_tag()}", tenant="acme")
    assert res.state == JobState.FINISHED, res.reason
    assert fakes.refused == 2
