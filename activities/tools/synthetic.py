"""Tools of the synthetic benchmark profiles: seeded output and seeded pauses.

A lookup's answer and its duration depend only on (case, step), so a workload replays
the same tool results under every routing policy (the job ids differ per run). The
pause stands for a tool's real latency (an API call, a database query) and is what a
paused job's prefix must survive.
"""

from __future__ import annotations

import asyncio
import math
import random

from activities.tools.base import ToolOutcome, Toolset
from workflows.contracts import ToolRequest, ToolResult
from workflows.profiles.synthetic import WORDS


class SyntheticTools(Toolset):
    def __init__(self, profile: str, *, pause_median_s: float = 0.4,
                 pause_sigma: float = 0.6, pause_max_s: float = 3.0) -> None:
        self.profile = profile
        self._median = pause_median_s
        self._sigma = pause_sigma
        self._max = pause_max_s

    def _rng(self, req: ToolRequest) -> random.Random:
        return random.Random(f"{req.profile}/{req.task_id}/{req.step}/{req.name}")

    def pause_s(self, req: ToolRequest) -> float:
        rng = self._rng(req)
        return min(self._max, self._median * math.exp(self._sigma * rng.gauss(0.0, 1.0)))

    def run(self, req: ToolRequest) -> ToolOutcome:
        if req.name == "close":
            return ToolOutcome(ToolResult(ok=True, output="closed"))
        rng = self._rng(req)
        rng.random()  # the first draw is the pause's
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 70)))
        return ToolOutcome(ToolResult(ok=True, output=f"record {req.arguments['key']}: {words}"))

    async def arun(self, req: ToolRequest) -> ToolOutcome:
        await asyncio.sleep(self.pause_s(req))
        return self.run(req)
