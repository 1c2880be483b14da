"""Transcripts past Temporal's 2 MB payload limit, on a real dev server (the test server
does not enforce the limit). Before, such a job's result, carry or resend exceeded it:
the workflow task failed and retried forever and the job hung in RUNNING."""

from __future__ import annotations

import asyncio

from temporalio import activity
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import always, run_job, workers
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.contracts import (
    INLINE_TRANSCRIPT_BYTES,
    GenerateRequest,
    GenerateResult,
    JobState,
    ToolResult,
)

LOOKUP = reply("lookup_customer", '{"customer_id": "C100"}')
BIG = 120_000  # characters a tool answer: 22 of them make a 2.6 MB transcript
LIMITS = JobLimits(max_steps=22, max_tool_calls={"lookup_customer": 99})


def big_answers(r: object) -> ToolResult:
    return ToolResult(ok=True, output=f"{r.step:03d}" + "x" * BIG)  # type: ignore[attr-defined]


async def test_a_transcript_past_2mb_ends_with_its_key_not_inline(
    dev_server_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(LOOKUP), tool_output=big_answers)
    async with workers(dev_server_env, fakes) as client:
        res = await asyncio.wait_for(run_job(client, limits=LIMITS), timeout=180)
    assert res.state == JobState.LOOP_CAP
    assert res.transcript == [] and res.transcript_messages == 44
    assert res.transcript_key
    whole = fakes.stored[-1].transcript
    assert len(whole) == 44 and whole[-1].content == "022" + "x" * BIG
    # the whole went through S3 in chunks, none as big as the limit
    assert fakes.chunks_stored


async def test_continue_as_new_carries_a_big_transcript_through_s3(
    dev_server_env: WorkflowEnvironment,
) -> None:
    fakes = FakeActivities(always(LOOKUP), tool_output=big_answers)
    async with workers(dev_server_env, fakes) as client:
        res = await asyncio.wait_for(
            run_job(client, limits=LIMITS, continue_as_new_after_steps=8), timeout=180)
    assert res.state == JobState.LOOP_CAP and res.runs == 3
    assert [s.step for s in res.steps] == list(range(1, 23))
    assert fakes.loads  # later runs read the transcript back in chunks
    prompts = fakes.prompts
    for before, after in zip(prompts, prompts[1:], strict=False):
        assert after[: len(before) - 1] == before[:-1]  # byte-identical across runs


class ForgetfulStore(FakeActivities):
    """The message store loses the job's messages once, when they are past the inline
    size: the resend must restore them in chunks rather than in one request."""

    lost = False

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        held = self.transcripts.get(req.job_id, [])
        if (not self.lost and req.base_len > 0
                and sum(len(m.model_dump_json()) for m in held) > INLINE_TRANSCRIPT_BYTES):
            self.lost = True
            self.transcripts[req.job_id] = []
        if len(self.transcripts.get(req.job_id, [])) < req.base_len:
            raise ApplicationError("messages lost", type="TranscriptGap", non_retryable=True)
        return await super().generate(req)


async def test_a_lost_store_is_restored_in_chunks_when_the_transcript_is_big(
    dev_server_env: WorkflowEnvironment,
) -> None:
    fakes = ForgetfulStore(always(LOOKUP), tool_output=big_answers)
    async with workers(dev_server_env, fakes) as client:
        res = await asyncio.wait_for(run_job(client, limits=LIMITS), timeout=180)
    assert fakes.lost
    assert res.state == JobState.LOOP_CAP and len(res.steps) == 22
    assert all(s.engine_id == "fake0" for s in res.steps)  # restored, not failed over
    assert len(fakes.stored[-1].transcript) == 44
