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

from bench.synthetic_pauses import SyntheticPauses
from bench.synthetic_profiles import WORDS
from warmloop import ToolOutcome, ToolRequest, ToolResult, Toolset


class SyntheticTools(Toolset):
    def __init__(self, profile: str, pauses: SyntheticPauses | None = None) -> None:
        self.profile = profile
        self._p = pauses or SyntheticPauses()

    def _rng(self, req: ToolRequest) -> random.Random:
        return random.Random(f"{req.profile}/{req.task_id}/{req.step}/{req.name}")

    def pause_s(self, req: ToolRequest) -> float:
        p, rng = self._p, self._rng(req)
        pause = p.median_s * math.exp(p.sigma * rng.gauss(0.0, 1.0))
        if rng.random() < p.long_share:
            pause = rng.uniform(p.long_min_s, p.long_max_s)
        return min(p.max_s, pause)

    def run(self, req: ToolRequest) -> ToolOutcome:
        if req.name == "close":
            return ToolOutcome(ToolResult(ok=True, output="closed"))
        if req.name == "escalate":
            return ToolOutcome(ToolResult(ok=True, output="a reviewer approved the escalation"))
        rng = self._rng(req)
        rng.random(), rng.random(), rng.random()  # the pause's draws
        words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(40, 70)))
        return ToolOutcome(ToolResult(ok=True, output=f"record {req.arguments['key']}: {words}"))

    async def arun(self, req: ToolRequest) -> ToolOutcome:
        await asyncio.sleep(self.pause_s(req))
        return self.run(req)
