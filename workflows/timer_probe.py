"""``TimerProbe``: how late the Temporal server fires a short timer.

Every tool pause, activity retry backoff and route wait of a job is a Temporal timer.
With the server's default ``history.timerProcessorMaxTimeShift`` (1 s) a timer shorter
than a second fires about a second after it was set, and with the default
``history.timerProcessorMaxPollRPS`` (20) timers queue up when a few dozen jobs pause
at once: on bench-routing's jobs that was 0.60 s a pause, half a job's time. Both are
settings of the server, not of warmloop, so a team's own cluster may lack them; the
agent worker runs this probe at start and warns when a timer fires late
(``warmloop.workers.timer_check``), and ``warmloop doctor`` reports it.

The probe sleeps ``sleep_s`` and reads the workflow clock before and after (each
reading is the start of a workflow task), so its own figure counts the worker's time on
the first task and the dispatch of the second besides the timer's lateness; the check
reads the lateness off the history's timer events instead (the server's clock) and keeps
the probe's figure for when the history cannot be read.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field
from temporalio import workflow


class TimerProbeInput(BaseModel):
    """What to time."""

    model_config = ConfigDict(extra="forbid")

    sleep_s: float = Field(default=0.2, gt=0, le=10)
    """The timer to set, in seconds: under a second, where the default time shift bites."""


class TimerProbeResult(BaseModel):
    """What the timer took, between the workflow tasks around it (why: a late timer is
    invisible in any one job and costs every pause of every job)."""

    model_config = ConfigDict(extra="ignore")  # a newer probe may add fields

    sleep_s: float
    """The timer set."""
    slept_s: float
    """From the timer's workflow task to the task it woke (>= ``sleep_s``)."""

    @property
    def late_s(self) -> float:
        """How much later than due the timer fired, with the worker's and the task
        dispatch's time around it."""
        return max(0.0, self.slept_s - self.sleep_s)


@workflow.defn
class TimerProbe:
    @workflow.run
    async def run(self, probe: TimerProbeInput) -> TimerProbeResult:
        before = workflow.time()
        await workflow.sleep(probe.sleep_s)
        return TimerProbeResult(sleep_s=probe.sleep_s, slept_s=workflow.time() - before)
