"""The hedging benchmark's agent, loaded as a warmloop plugin
(``WARMLOOP_PLUGINS=bench.plugin,bench.hedge_plugin``): a read-only HTTP tool
(``lookup``, whose latency has a heavy tail) and a side-effect one (``note``, never
hedged), both served by the benchmark or test itself under the base URL in
``WARMLOOP_HEDGE_TOOL_URL``, read when the plugin loads."""

from __future__ import annotations

import functools
import os

from bench.synthetic_profiles import Case, CloseArgs, EscalateArgs, LookupArgs
from warmloop.workflows.budgets import JobLimits, OutputBudgets
from warmloop.workflows.profiles.base import HttpRunner, Profile, ToolSpec

URL_ENV = "WARMLOOP_HEDGE_TOOL_URL"
PROFILE_NAME = "synthetic-hedge"
SYSTEM_PROMPT = (
    "You are the records agent. Look records up one at a time, one tool call per reply, "
    "and read each result before the next call. Never answer in prose.\n")


@functools.cache
def hedge_profile(base_url: str) -> Profile:
    """One object per URL, so a process loading the plugin twice registers it once."""
    return Profile(
        name=PROFILE_NAME, system_prompt=SYSTEM_PROMPT, task_id_field="case_id",
        task_model=Case,
        tools=(
            ToolSpec("lookup", "Look a record up by key.", LookupArgs, read_only=True,
                     timeout_s=30.0, pause_median_s=0.1, pause_p90_s=0.3,
                     runner=HttpRunner(url=f"{base_url}/lookup")),
            ToolSpec("note", "Note a concern on the case.", EscalateArgs, side_effect=True,
                     timeout_s=30.0, pause_median_s=0.1, pause_p90_s=0.3,
                     runner=HttpRunner(url=f"{base_url}/note")),
            ToolSpec("close", "Close the case with an outcome.", CloseArgs, finishes_job=True),
        ),
        limits=JobLimits(max_steps=40, max_tool_calls={"lookup": 200}),
        # the random tiny model may pad guided JSON until max_tokens: room for repairs
        budgets=OutputBudgets(plan=64, execute=64, reflect=64),
        max_invalid_calls=40,
    )


def PROFILES() -> list[Profile]:  # noqa: N802 (a plugin attribute, called at load)
    return [hedge_profile(os.environ.get(URL_ENV, "http://127.0.0.1:9560"))]
