"""Replay: AgentJob's code must reproduce the commands of recorded histories.

A change that breaks determinism (reordered activities, a new timer, a non-pure
call) fails here. Recorded histories live in histories/; after an intended,
versioned change, re-record with WARMLOOP_RECORD_HISTORIES=1.
"""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

import pytest
from temporalio.client import WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Replayer

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import run_job, workers
from workflows.agent_job import AgentJob
from workflows.contracts import GenerateRequest, GenerateResult

HISTORIES = Path(__file__).parent / "histories"


def _script(req: GenerateRequest) -> GenerateResult:
    # valid call, invalid call (repair path), tool call, finish
    return {
        1: reply("lookup_customer", '{"customer_id": "C100"}'),
        2: reply("search_kb", '{"topic": "nope"}'),
        3: reply("search_kb", '{"topic": "crash"}'),
    }.get(req.step, reply("finish", '{"resolution": "resolved", "priority": "high"}'))


def _replayer() -> Replayer:
    return Replayer(workflows=[AgentJob], data_converter=pydantic_data_converter)


async def test_a_fresh_history_replays(time_skipping_env: WorkflowEnvironment) -> None:
    fakes = FakeActivities(_script)
    async with workers(time_skipping_env, fakes) as client:
        res = await run_job(client, max_steps=6)
        history = await client.get_workflow_handle(res.job_id).fetch_history()
    assert len(res.steps) == 4
    await _replayer().replay_workflow(history)
    if os.environ.get("WARMLOOP_RECORD_HISTORIES"):
        HISTORIES.mkdir(exist_ok=True)
        (HISTORIES / "agent_job_finish_with_repair.json").write_text(history.to_json())


@pytest.mark.parametrize("path", sorted(HISTORIES.glob("*.json")), ids=lambda p: p.stem)
async def test_recorded_histories_replay(path: Path) -> None:
    history = WorkflowHistory.from_json("recorded", await asyncio.to_thread(path.read_text))
    await _replayer().replay_workflow(history)


def test_there_are_recorded_histories() -> None:
    assert list(HISTORIES.glob("*.json")), "record one with WARMLOOP_RECORD_HISTORIES=1"
