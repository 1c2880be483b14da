"""Context hygiene on the real stack: a long scripted job's big tool outputs are archived
to S3 at a continue-as-new point, the engine's prompt shrinks by them (its own usage
says so), and each summary's key holds the whole output; a short job is left alone."""

from __future__ import annotations

import asyncio
import json
import random
import uuid

import pytest
from temporalio.client import Client

from bench.synthetic_profiles import LOOKUP_KEYS, WORDS
from warmloop.infra.stack import Stack
from warmloop.workers.clients import build_s3
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    FunctionCall,
    JobInput,
    JobResult,
    JobState,
    ReplayScript,
    ReplayStep,
    ToolCall,
)
from warmloop.workflows.hygiene import archive_key, is_summary

pytestmark = pytest.mark.integration


def script(steps: int, seed: str) -> ReplayScript:
    rng = random.Random(seed)
    out = []
    for i in range(1, steps + 1):
        key = rng.choice(LOOKUP_KEYS)
        text = " ".join(rng.choice(WORDS) for _ in range(450))
        out.append(ReplayStep(
            call=ToolCall(id=f"call-{i}", function=FunctionCall(
                name="lookup", arguments=json.dumps({"key": key}))),
            result=f"record {key} (page {i}): {text}", output_tokens=4,
            pause_kind="" if i == steps else "tool:lookup"))
    return ReplayScript(steps=out)


async def run(client: Client, steps: int, max_steps: int, tag: str) -> tuple[JobInput, JobResult]:
    job = JobInput(profile="synthetic-support", task={"case_id": "S0042", "text": "hygiene"},
                   max_steps=max_steps, tools=["lookup"], hold_policy="never",
                   context_hygiene="cost_model", replay=script(steps, tag))
    res = await client.execute_workflow(AgentJob.run, job, id=f"hyg-{tag}-{uuid.uuid4().hex[:6]}",
                                        task_queue=AGENT_TASK_QUEUE)
    return job, res


async def test_a_long_job_archives_its_big_outputs_and_its_prompt_shrinks(
    stack: Stack, client: Client, settings: Settings,
) -> None:
    job, res = await run(client, steps=20, max_steps=40, tag="long")
    assert res.state == JobState.FINISHED and len(res.steps) == 20
    assert res.runs >= 2
    summaries = [json.loads(m.content)["archived_tool_output"]
                 for m in res.transcript if m.role == "tool" and is_summary(m.content)]
    assert len(summaries) >= 5
    s3 = build_s3(settings)
    assert job.replay is not None
    for s in summaries:  # the whole output is where the summary says
        body = await asyncio.to_thread(s3.get_object, Bucket=settings.s3_bucket,
                                       Key=archive_key(res.job_id, s["ref"]))
        assert body["Body"].read().decode() == job.replay.steps[s["step"] - 1].result
    # the engine's own usage: the step after the compaction point read fewer tokens
    sizes = [st.prompt_tokens for st in res.steps]
    drops = [(a, b) for a, b in zip(sizes, sizes[1:], strict=False) if b < a]
    assert drops and all(b < 0.8 * a for a, b in drops)


async def test_a_short_job_is_not_compacted(stack: Stack, client: Client) -> None:
    _, res = await run(client, steps=6, max_steps=8, tag="short")
    assert res.state == JobState.FINISHED and res.runs == 1
    assert not any(is_summary(m.content) for m in res.transcript)
    sizes = [st.prompt_tokens for st in res.steps]
    assert sizes == sorted(sizes)
