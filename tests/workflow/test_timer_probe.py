"""The timer probe tells a tuned Temporal server from one with the default time shift.

A server that fires sub-second timers a second late slows every pause of every job and
says nothing; the agent worker's start-up probe (``workers.timer_check``) must say it,
and must not say it of a tuned server. Both are real dev servers: the session's tuned
one (``dev_server_env``) and one started here with the defaults."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.conftest import _bin
from tests.workflow.test_replay import _record, _replayer
from warmloop.workers import timer_check
from warmloop.workers.temporal_plugin import sandbox_runner
from warmloop.workers.timer_check import (
    TIMER_SETTINGS_HINT,
    check_timers,
    warn_if_timers_late,
)
from warmloop.workflows.timer_probe import TimerProbe


@pytest.fixture(scope="module")
async def untuned_env() -> AsyncIterator[WorkflowEnvironment]:
    """A dev server with Temporal's default timer settings (what a team's own cluster
    has until someone sets them)."""
    env = await WorkflowEnvironment.start_local(
        dev_server_existing_path=_bin("temporal"), data_converter=pydantic_data_converter,
        dev_server_log_level="error")
    try:
        yield env
    finally:
        await env.shutdown()


def _queue() -> str:
    return f"timer-probe-{uuid.uuid4().hex[:8]}"


class _Log:
    """The module's logger, recorded (structlog's ``capture_logs`` sees nothing once the
    suite has configured a level filter or cached loggers)."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []

    def info(self, event: str, **kw: Any) -> None:
        self.events.append({"event": event, "log_level": "info", **kw})

    def warning(self, event: str, **kw: Any) -> None:
        self.events.append({"event": event, "log_level": "warning", **kw})


@pytest.fixture
def logs(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    recorder = _Log()
    monkeypatch.setattr(timer_check, "log", recorder)
    return recorder.events


async def test_a_tuned_server_passes(dev_server_env: WorkflowEnvironment,
                                     logs: list[dict[str, Any]]) -> None:
    queue = _queue()
    async with Worker(dev_server_env.client, task_queue=queue, workflows=[TimerProbe],
                      workflow_runner=sandbox_runner()):
        check = await warn_if_timers_late(dev_server_env.client, task_queue=queue)
    assert check.error is None and check.late_s is not None
    assert not check.late, f"a tuned server fired a 0.2 s timer {check.late_s:.3f} s late"
    assert [e["event"] for e in logs] == ["temporal_timers_ok"]


async def test_the_default_time_shift_is_reported_with_the_settings_to_change(
        untuned_env: WorkflowEnvironment, logs: list[dict[str, Any]]) -> None:
    queue = _queue()
    async with Worker(untuned_env.client, task_queue=queue, workflows=[TimerProbe],
                      workflow_runner=sandbox_runner()):
        check = await warn_if_timers_late(untuned_env.client, task_queue=queue)
    assert check.late and check.late_s is not None
    # the default shift: a 0.2 s timer fires at about 1 s
    assert 0.5 <= check.late_s < 3.0
    (warning,) = [e for e in logs if e["log_level"] == "warning"]
    assert warning["event"] == "temporal_timers_late"
    assert warning["hint"] == TIMER_SETTINGS_HINT
    assert "history.timerProcessorMaxTimeShift" in TIMER_SETTINGS_HINT


async def test_no_worker_on_the_queue_is_an_error_not_a_verdict(
        dev_server_env: WorkflowEnvironment) -> None:
    check = await check_timers(dev_server_env.client, task_queue=_queue(), timeout_s=1.0)
    assert check.late_s is None and not check.late
    assert check.error is not None and "timed out" in check.error.lower()


async def test_the_probe_replays(dev_server_env: WorkflowEnvironment) -> None:
    queue = _queue()
    async with Worker(dev_server_env.client, task_queue=queue, workflows=[TimerProbe],
                      workflow_runner=sandbox_runner()):
        check = await check_timers(dev_server_env.client, task_queue=queue)
    assert check.error is None
    history = await dev_server_env.client.get_workflow_handle(
        check.workflow_id).fetch_history()
    await _replayer().replay_workflow(history)
    _record("timer_probe.json", history)
