"""`warmloop replay` on the real stack: a small trace (ticket-triage jobs and an inline
prompt) replayed twice sends the same prompts, and every step after a job's first finds
its prefix in the engine's cache (the engines' own figures)."""

from __future__ import annotations

import asyncio
import json
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import pytest
from temporalio.client import Client

from bench.make_trace import make_trace
from tests.integration.cli import warmloop
from warmloop.infra.stack import Stack
from warmloop.workflows.contracts import JobInput

pytestmark = pytest.mark.integration


def last_json(out: str) -> dict[str, Any]:
    return dict(json.loads(out.strip().splitlines()[-1]))


async def test_a_replayed_trace_sends_the_same_prompts_every_run(stack: Stack,
                                                                 tmp_path: Path) -> None:
    lines = make_trace(jobs=3, seed=3)
    kinds = {"profile" if "profile" in x else "inline" for x in lines}
    assert kinds == {"profile", "inline"}  # both kinds of line
    steps = sum(len(x["steps"]) for x in lines)
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))

    first = await asyncio.to_thread(warmloop, "replay", str(trace), "--window", "3",
                                    "--routing", "cache_aware", "--routing", "round_robin")
    assert first.returncode == 0, first.stderr
    second = await asyncio.to_thread(warmloop, "replay", str(trace), "--window", "3")
    assert second.returncode == 0, second.stderr
    configs = [c for out in (first, second) for c in last_json(out.stdout)["configs"]]

    assert [c["routing"] for c in configs] == ["cache_aware", "round_robin", "cache_aware"]
    # the same prompts, step for step, whatever the engines generated and wherever routed
    assert len({c["prompt_digest"] for c in configs}) == 1
    assert all(c["hashed_steps"] == c["steps"] == steps for c in configs)
    assert all(c["states"] == {"FINISHED": len(lines)} for c in configs)
    # from cold caches (the embedded engines allow the reset) ...
    assert all(c["caches_reset"] == "yes" for c in configs)
    # ... every later step of a job found its prefix cached, per the engines' usage
    for c in configs:
        if c["routing"] == "cache_aware":
            assert c["later_steps_cached"] == c["later_steps"] == steps - len(lines), c
        assert c["cached_tokens"] > 0 and 0 < c["hit_rate"] < 1
        assert c["prefill_tokens"] > 0 and c["prompt_tokens"] > c["prefill_tokens"]
    # the side-by-side table, one column per policy, from the engines' counters
    assert "hit rate (engine counters)" in first.stdout
    assert "cache_aware" in first.stdout and "round_robin" in first.stdout
    assert "every configuration sent the same prompts" in first.stdout


async def test_a_trace_replayed_at_its_arrivals_starts_no_job_before_it_arrived(
        stack: Stack, client: Client, tmp_path: Path) -> None:
    """``--arrivals --speed 4``: jobs recorded 4 s apart start 1 s apart, none early
    (their workflows' start times, from Temporal), a batch line in the batch lane."""
    lines = make_trace(jobs=3, seed=5)
    for i, x in enumerate(lines):
        x["arrival_s"] = 1_700_000_000.0 + 4.0 * i  # epoch seconds, as a log has them
    lines[2]["lane"] = "batch"
    lines[1]["tenant"] = "replay-t"  # runs as the tenant's job, its requests salted
    trace = tmp_path / "arrivals.jsonl"
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    since = datetime.now(UTC) - timedelta(seconds=1)
    out = await asyncio.to_thread(warmloop, "replay", str(trace), "--arrivals", "--speed", "4")
    assert out.returncode == 0, out.stderr
    summary = last_json(out.stdout)
    assert summary["window"] is None and summary["arrivals_speed"] == 4
    [config] = summary["configs"]
    assert config["states"] == {"FINISHED": len(lines)}
    assert config["start_lag_max_s"] is not None and config["start_lag_max_s"] >= 0
    assert "latest start after its arrival" in out.stdout
    query = f"WorkflowType = 'AgentJob' AND StartTime >= '{since.isoformat()}'"
    runs = sorted([wf async for wf in client.list_workflows(query)
                   if wf.id.removeprefix("replay-t/").startswith("replay-")],
                  key=lambda wf: wf.id[-4:])  # the ids end with the job's number
    assert len(runs) == len(lines)
    starts = [wf.start_time for wf in runs]
    for i, t in enumerate(starts):  # the ids number the jobs in trace order
        assert (t - starts[0]).total_seconds() >= i * 4.0 / 4 - 0.05, starts
    lanes, tenants = [], []
    for wf in runs:  # each job's input, as its workflow history has it
        history = await client.get_workflow_handle(wf.id).fetch_history()
        started = history.events[0].workflow_execution_started_event_attributes
        [job] = await client.data_converter.decode(started.input.payloads, [JobInput])
        lanes.append(job.lane)
        tenants.append(job.tenant)
    assert lanes == ["interactive", "interactive", "batch"]
    assert tenants == ["default", "replay-t", "default"]
    assert [wf.id.startswith("replay-t/") for wf in runs] == [False, True, False]
