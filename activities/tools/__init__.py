"""Tools the agents call, run as the ``run_tool`` activity on the agent task queue."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from warmloop.activities.pauses import PauseStats, tool_kind
from warmloop.activities.tools.base import EffectLedger, ToolOutcome, Toolset
from warmloop.activities.tools.ticket_triage import TicketTriageTools
from warmloop.workflows.contracts import ToolRequest, ToolResult
from warmloop.workflows.profiles import get_profile

log = structlog.get_logger(__name__)


class ToolActivities:
    """Runs tools; large outputs go to S3 whole, the transcript keeps a cut preview."""

    def __init__(self, toolsets: list[Toolset], ledger: EffectLedger, *, s3: Any,
                 bucket: str, pauses: PauseStats | None = None) -> None:
        self._pauses = pauses
        self._toolsets = {t.profile: t for t in toolsets}
        self._ledger = ledger
        self._s3 = s3
        self._bucket = bucket

    @activity.defn(name="run_tool")
    async def run_tool(self, req: ToolRequest) -> ToolResult:
        toolset = self._toolsets.get(req.profile)
        if toolset is None:
            raise ApplicationError(f"no toolset for profile {req.profile!r}",
                                   type="UnknownProfile", non_retryable=True)
        profile = get_profile(req.profile)
        with structlog.contextvars.bound_contextvars(job_id=req.job_id, step=req.step):
            started = time.monotonic()
            outcome = await toolset.arun(req)
            if self._pauses is not None:
                await self._pauses.record(req.profile, tool_kind(req.name),
                                          time.monotonic() - started)
            result = outcome.result
            if outcome.effect is not None and profile.tool(req.name).side_effect:
                fresh = await self._ledger.apply_once(req.job_id, req.step, req.name,
                                                      outcome.effect)
                if not fresh:
                    log.info("effect_deduplicated", tool=req.name)
            limit = profile.max_tool_output_chars
            if len(result.output) > limit:
                key = f"tool-outputs/{req.job_id}/{req.step}.txt"
                await asyncio.to_thread(self._s3.put_object, Bucket=self._bucket, Key=key,
                                        Body=result.output.encode())
                cut = len(result.output) - limit
                result = ToolResult(
                    ok=result.ok, output_key=key,
                    output=result.output[:limit] + f"\n[cut: {cut} more characters]",
                )
            log.info("tool_ran", tool=req.name, ok=result.ok)
        return result


__all__ = ["EffectLedger", "TicketTriageTools", "ToolActivities", "ToolOutcome", "Toolset"]
