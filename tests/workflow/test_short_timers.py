"""Sub-second timers on the embedded stack's Temporal server fire when due.

Temporal's timer queue reads no timer due sooner than now + ``history.
timerProcessorMaxTimeShift`` (1 s by default), so a shorter timer fires ~1 s after it
was set. An agent job's recorded pauses, a tool's 0.5 s retry backoff and the route's
Redis waits are all such timers: with the default, every one of them cost a second
(bench-routing: 0.55 s a pause beyond the scripted one, 3.7 s of an 8 s job).
``TEMPORAL_DEV_TUNING`` lowers the shift; these tests fail when it is lost."""

from __future__ import annotations

import time
import uuid
from datetime import timedelta

from temporalio import activity, workflow
from temporalio.common import RetryPolicy
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import UnsandboxedWorkflowRunner, Worker

from warmloop.infra.stack import TEMPORAL_DEV_TUNING, Stack
from warmloop.workers.settings import Settings

SHORT_S = 0.1
FLOOR_S = 1.0
"""What a short timer takes with the server's default shift."""

_attempts: list[float] = []


@activity.defn
async def fail_once() -> None:
    _attempts.append(time.monotonic())
    if len(_attempts) == 1:
        raise RuntimeError("the first attempt fails")


@workflow.defn(sandboxed=False)
class ShortTimers:
    @workflow.run
    async def run(self) -> float:
        before = workflow.now()
        await workflow.sleep(SHORT_S)
        slept = (workflow.now() - before).total_seconds()
        await workflow.execute_activity(
            fail_once, start_to_close_timeout=timedelta(seconds=10),
            retry_policy=RetryPolicy(initial_interval=timedelta(seconds=SHORT_S),
                                     maximum_attempts=2))
        return slept


async def test_a_short_sleep_and_a_short_retry_backoff_fire_when_due(
        dev_server_env: WorkflowEnvironment) -> None:
    _attempts.clear()
    queue = f"short-timers-{uuid.uuid4().hex[:8]}"
    async with Worker(dev_server_env.client, task_queue=queue, workflows=[ShortTimers],
                      activities=[fail_once], workflow_runner=UnsandboxedWorkflowRunner()):
        slept = await dev_server_env.client.execute_workflow(
            ShortTimers.run, id=f"short-timers-{uuid.uuid4()}", task_queue=queue)
    assert len(_attempts) == 2
    backoff = _attempts[1] - _attempts[0]
    # Measured on the server's clock; with the default shift both are >= FLOOR_S.
    assert SHORT_S <= slept < FLOOR_S / 2, f"a {SHORT_S} s sleep took {slept:.3f} s"
    assert SHORT_S <= backoff < FLOOR_S / 2, f"a {SHORT_S} s retry backoff took {backoff:.3f} s"


def test_the_stacks_temporal_server_runs_with_the_tuning() -> None:
    temporal = next(p for p in Stack(Settings()).infra_parts() if p.name == "temporal")
    assert " ".join(TEMPORAL_DEV_TUNING) in " ".join(temporal.argv)
    assert 'history.timerProcessorMaxTimeShift="10ms"' in TEMPORAL_DEV_TUNING
    # the timer queue's reads: 20 a second by default queue up under a few dozen pauses
    assert "history.timerProcessorMaxPollRPS=1000" in TEMPORAL_DEV_TUNING
