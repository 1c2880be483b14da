"""``TimerProbe``: how late the Temporal server fires a short timer.

Every tool pause, activity retry backoff and route wait of a job is a Temporal timer.
With the server's default ``history.timerProcessorMaxTimeShift`` (1 s) a timer shorter
than a second fires about a second after it was set, and with the default
``history.timerProcessorMaxPollRPS`` (20) timers queue up when a few dozen jobs pause
at once: on bench-routing's jobs that was 0.60 s a pause, half a job's time. Both are
settings of the server, not of warmloop, so a team's own cluster may lack them; the
agent worker runs this probe at start and warns when a timer fires late
(``warmloop.workers.timer_check``), and ``warmloop doctor`` reports it.

The probe sleeps ``sleep_s`` and reads the workflow clock before and after: the second
reading is the start of the workflow task the timer woke, so the difference less the
sleep is the timer's lateness plus the task's dispatch (a few milliseconds on a
healthy server).
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
    """What the timer took, on the server's clock (why: a late timer is invisible in
    any one job and costs every pause of every job)."""

    model_config = ConfigDict(extra="forbid")

    sleep_s: float
    """The timer set."""
    slept_s: float
    """From the timer's workflow task to the task it woke (>= ``sleep_s``)."""

    @property
    def late_s(self) -> float:
        """How much later than due the timer fired (with the next task's dispatch)."""
        return max(0.0, self.slept_s - self.sleep_s)


@workflow.defn
class TimerProbe:
    @workflow.run
    async def run(self, probe: TimerProbeInput) -> TimerProbeResult:
        before = workflow.time()
        await workflow.sleep(probe.sleep_s)
        return TimerProbeResult(sleep_s=probe.sleep_s, slept_s=workflow.time() - before)
