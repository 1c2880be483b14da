"""Is the Temporal server firing short timers when due? (``workflows.timer_probe``)

The agent worker asks once at start and logs ``temporal_timers_late`` with the settings
to change when the answer is no; ``warmloop doctor`` asks and prints it. Neither stops
anything: a late timer slows every paused job but loses none.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from datetime import timedelta

import structlog
from temporalio.api.enums.v1 import EventType
from temporalio.client import Client, WorkflowFailureError
from temporalio.service import RPCError

from warmloop.workflows.contracts import AGENT_TASK_QUEUE
from warmloop.workflows.timer_probe import TimerProbe, TimerProbeInput

log = structlog.get_logger(__name__)

TIMER_SETTINGS_HINT = (
    "set the Temporal server's dynamic config history.timerProcessorMaxTimeShift to "
    '"10ms" (default 1s: a timer under a second fires about a second late) and '
    "history.timerProcessorMaxPollRPS to 1000 (default 20: timers queue when dozens of "
    "jobs pause at once); docs/cluster.md shows both for Helm, the embedded stack sets "
    "them, and on Temporal Cloud they are the service's own")


@dataclass(frozen=True, slots=True)
class TimerCheck:
    """The probe's verdict (why a dataclass: the worker logs it, ``doctor`` prints it,
    tests assert on it)."""

    sleep_s: float
    """The timer the probe set."""
    late_s: float | None
    """How much after due it fired, on the server's clock (its history's TimerStarted
    and TimerFired events); None when the probe did not finish (``error``)."""
    late_after_s: float
    """Lateness from which the server counts as untuned."""
    error: str | None = None
    """Why the probe did not finish (no agent worker polling, server away)."""
    workflow_id: str = ""
    """The probe's workflow (its history shows the timer)."""

    @property
    def late(self) -> bool:
        return self.late_s is not None and self.late_s >= self.late_after_s


async def check_timers(client: Client, *, task_queue: str = AGENT_TASK_QUEUE,
                       sleep_s: float = 0.2, late_after_s: float = 0.3,
                       timeout_s: float = 30.0) -> TimerCheck:
    """Run ``TimerProbe`` on ``task_queue`` (an agent worker must poll it) and judge it.

    ``late_after_s``: a tuned server fires within tens of milliseconds, the default
    time shift about ``1 - sleep_s`` seconds late; 0.3 s lies between with room for a
    busy host. Never raises for the probe's own failures: they come back in ``error``."""
    wf_id = f"warmloop-timer-probe-{uuid.uuid4().hex[:12]}"
    try:
        res = await client.execute_workflow(
            TimerProbe.run, TimerProbeInput(sleep_s=sleep_s), id=wf_id,
            task_queue=task_queue, execution_timeout=timedelta(seconds=timeout_s))
    except (TimeoutError, WorkflowFailureError, RPCError) as e:
        cause = getattr(e, "cause", None)
        why = f"{type(e).__name__}: {e}" + (f" ({cause})" if cause else "")
        return TimerCheck(sleep_s, None, late_after_s, error=why, workflow_id=wf_id)
    late = await _server_lateness_s(client, wf_id, sleep_s)
    return TimerCheck(sleep_s, res.late_s if late is None else late, late_after_s,
                      workflow_id=wf_id)


async def _server_lateness_s(client: Client, workflow_id: str, sleep_s: float
                             ) -> float | None:
    """The timer's lateness on the server's own clock: its TimerFired event's time less
    its TimerStarted's, less the sleep. The probe's own figure also counts the worker's
    time on the task that set the timer and the wait for the task it woke (a worker
    replaying a backlog at start would read as a late server); None when the history
    cannot be read (the probe's figure is used then)."""
    try:
        history = await client.get_workflow_handle(workflow_id).fetch_history()
    except RPCError:
        return None
    started = fired = None
    for event in history.events:
        if event.event_type == EventType.EVENT_TYPE_TIMER_STARTED:
            started = event.event_time.ToMicroseconds()
        elif event.event_type == EventType.EVENT_TYPE_TIMER_FIRED:
            fired = event.event_time.ToMicroseconds()
    if started is None or fired is None:
        return None
    return max(0.0, (fired - started) / 1e6 - sleep_s)


async def warn_if_timers_late(client: Client, *, task_queue: str = AGENT_TASK_QUEUE,
                              timeout_s: float = 60.0) -> TimerCheck:
    """``check_timers``, logged: a warning with ``TIMER_SETTINGS_HINT`` when late.

    Never raises (the agent worker runs it beside its poller, in one task group: an
    exception here would stop the worker)."""
    try:
        check = await check_timers(client, task_queue=task_queue, timeout_s=timeout_s)
    except Exception as e:  # noqa: BLE001 - advice only, whatever went wrong
        check = TimerCheck(0.0, None, 0.0, error=f"{type(e).__name__}: {e}")
    if check.late_s is None:
        log.info("timer_probe_failed", error=check.error)
    elif check.late:
        log.warning("temporal_timers_late", sleep_ms=round(check.sleep_s * 1000),
                    late_ms=round(check.late_s * 1000), hint=TIMER_SETTINGS_HINT)
    else:
        log.info("temporal_timers_ok", sleep_ms=round(check.sleep_s * 1000),
                 late_ms=round(check.late_s * 1000))
    return check
