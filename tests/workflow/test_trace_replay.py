"""A replayed job (`warmloop replay`) on the time-skipping server: the real AgentJob,
scripted engines. Whatever the engine generates, the transcript gets the recorded
calls and results; the recorded pauses are workflow timers; the job ends FINISHED.

The module runs on a test server of its own: its hour-long pauses skip a clock that no
other module's still-waiting workflow shares (such a workflow, woken by the skip, waits
on its gone worker's sticky queue, and the server stops skipping time until it is
picked up, which it never is)."""

from __future__ import annotations

import json
import shutil
import sys
import uuid
from collections.abc import AsyncIterator, Mapping
from pathlib import Path

import pytest
from temporalio import activity
from temporalio.client import Client, WorkflowHistory
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.testing import WorkflowEnvironment

from tests.workflow.fakes import FakeActivities, Script, reply
from tests.workflow.test_agent_job import TICKET, workers
from warmloop.infra.stack import register_search_attributes
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    GenerateRequest,
    GenerateResult,
    JobInput,
    JobResult,
    JobState,
)
from warmloop.workflows.profiles import Profile, get_profile
from warmloop.workflows.prompt import assemble_prompt, prompt_hash
from warmloop.workflows.trace import (
    inline_prompts,
    parse_trace,
    replay_script,
    trace_profile,
)

FINISH = {"resolution": "escalated", "priority": "urgent"}
TRIAGE_LINE = {
    "profile": "ticket-triage", "task": TICKET,
    "steps": [
        {"call": {"name": "lookup_customer", "arguments": {"customer_id": "C100"}},
         "result": '{"plan": "enterprise", "vip": true}', "pause_s": 30, "output_tokens": 21},
        {"call": {"name": "set_priority", "arguments": {"priority": "urgent"}},
         "result": "priority set to urgent", "pause_s": 3600, "output_tokens": 12},
        {"call": {"name": "finish", "arguments": FINISH}, "output_tokens": 17},
    ],
}
KINDS = ["tool:lookup_customer", "approval:urgent_priority", ""]
SYSTEM = "You reconcile supplier statements against the ledger. " * 40
INLINE_LINE = {
    "system_prompt": SYSTEM, "task": "Statement S-77 from ACME, March",
    "steps": [
        {"call": {"name": "fetch_statement", "arguments": {"id": "S-77"}},
         "result": "12 lines, total 4,210.00", "pause_s": 2.5, "output_tokens": 30},
        {"call": {"name": "done", "arguments": {"ok": True}}, "output_tokens": 9},
    ],
}


@pytest.fixture(scope="module")
async def env() -> AsyncIterator[WorkflowEnvironment]:
    server = shutil.which("temporal-test-server", path=str(Path(sys.executable).parent))
    assert server, "temporal-test-server not installed (warmloop[dev])"
    e = await WorkflowEnvironment.start_time_skipping(test_server_existing_path=server,
                                                      data_converter=pydantic_data_converter)
    await register_search_attributes(e.client)
    try:
        yield e
    finally:
        await e.shutdown()


class ReplayFakes(FakeActivities):
    """The fake engines, plus inline prompts resolved as the inference worker does, and
    each step's prompt hash as the worker computes it."""

    def __init__(self, script: Script, inline: dict[str, Profile] | None = None) -> None:
        super().__init__(script)
        self.inline = inline or {}

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        profile = self.inline.get(req.profile)
        if profile is None:
            result = await FakeActivities.generate(self, req)
            profile = get_profile(req.profile)
        else:
            held = self.transcripts.get(req.job_id, [])
            self.transcripts[req.job_id] = held[: req.base_len] + req.new_messages
            self.prompts.append(assemble_prompt(profile, profile.validate_task(req.task),
                                                self.transcripts[req.job_id], tail=req.tail))
            self.generate_requests.append(req)
            result = self.script(req)
        messages = [m.to_openai() for m in self.prompts[-1]]
        return result.model_copy(update={
            "prompt_hash": prompt_hash(messages, profile.tool_schemas(req.tools))})


def triage_job(line: Mapping[str, object] = TRIAGE_LINE, *,
               pauses: tuple[float, float] | None = None, **kw: object) -> JobInput:
    """The ticket-triage line as a replayed job (``pauses``: other recorded pauses)."""
    [(_, job)] = parse_trace([json.dumps(line)])
    if pauses is not None:
        for recorded, pause in zip(job.steps, pauses, strict=False):
            recorded.pause_s = pause
    return JobInput(profile="ticket-triage", task=job.task_object,
                    limits={"max_steps": len(job.steps)},  # type: ignore[arg-type]
                    replay=replay_script(job, KINDS), **kw)  # type: ignore[arg-type]


async def run(client: Client, job: JobInput) -> tuple[JobResult, WorkflowHistory]:
    handle = await client.start_workflow(AgentJob.run, job, id=f"replay-{uuid.uuid4().hex[:8]}",
                                         task_queue=AGENT_TASK_QUEUE)
    res = await handle.result()
    return res, await handle.fetch_history()


def timers_s(history: WorkflowHistory) -> list[float]:
    return [e.timer_started_event_attributes.start_to_fire_timeout.ToTimedelta().total_seconds()
            for e in history.events if e.HasField("timer_started_event_attributes")]


async def test_a_replayed_job_appends_the_recorded_calls_whatever_the_engine_says(
    env: WorkflowEnvironment,
) -> None:
    # the engine answers with a different (valid) tool every time, never finish
    fakes = ReplayFakes(lambda req: reply("search_kb", '{"topic": "crash"}'))
    async with workers(env, fakes) as client:
        res, history = await run(client, triage_job())
    assert res.state == JobState.FINISHED and res.final == FINISH
    assert "replayed 3 recorded steps" in res.reason
    recorded = [(m.role, m.tool_calls[0].function.name if m.tool_calls else m.content)
                for m in res.transcript]
    assert recorded == [
        ("assistant", "lookup_customer"), ("tool", '{"plan": "enterprise", "vip": true}'),
        ("assistant", "set_priority"), ("tool", "priority set to urgent"),
        ("assistant", "finish"), ("tool", ""),
    ]
    assert json.loads(res.transcript[0].tool_calls[0].function.arguments) == {  # type: ignore[index]
        "customer_id": "C100"}
    # no tool ran, no human was asked: the recorded results and pauses stand in for them,
    # and the pauses teach the hold model as a live tool's and reviewer's would
    assert not fakes.tool_requests and not res.approvals
    assert [(p.kind, p.seconds) for p in fakes.pauses] == [
        ("tool:lookup_customer", 30.0), ("approval:urgent_priority", 3600.0)]
    # each step asked for the recorded length and told the worker what the job waits on
    assert [r.max_tokens for r in fakes.generate_requests] == [21, 12, 17]
    assert [r.pause_kind for r in fakes.generate_requests] == KINDS
    # the recorded pauses, as workflow timers between the steps
    assert timers_s(history) == [30.0, 3600.0]
    assert [s.tool for s in res.steps] == ["lookup_customer", "set_priority", "finish"]
    assert all(s.valid and s.prompt_hash for s in res.steps)
    assert res.usage.tool_calls == {"lookup_customer": 1, "set_priority": 1, "finish": 1}


async def test_prompts_are_the_same_whatever_the_engine_generates(
    env: WorkflowEnvironment,
) -> None:
    runs = []
    for script in (lambda req: reply("finish", json.dumps(FINISH)),
                   lambda req: reply(None, content="rambling prose, no call at all")):
        fakes = ReplayFakes(script)
        async with workers(env, fakes) as client:
            res, _ = await run(client, triage_job())
        assert res.state == JobState.FINISHED
        runs.append((fakes.prompts, [s.prompt_hash for s in res.steps]))
    (prompts_a, hashes_a), (prompts_b, hashes_b) = runs
    assert prompts_a == prompts_b and hashes_a == hashes_b
    assert len(set(hashes_a)) == 3  # every step's prompt differs from the last
    for before, after in zip(prompts_a, prompts_a[1:], strict=False):
        assert after[: len(before) - 1] == before[:-1]  # append-only, as a live job


async def test_an_inline_prompt_stays_out_of_history(
    env: WorkflowEnvironment,
) -> None:
    [(n, line)] = parse_trace([json.dumps(INLINE_LINE)])
    prompt = inline_prompts([(n, line)])[n]
    name = prompt.name
    fakes = ReplayFakes(lambda req: reply("whatever", "{}"), inline={
        name: trace_profile(name, prompt)})
    job = JobInput(profile=name, task=line.task_object, limits={"max_steps": 2},  # type: ignore[arg-type]
                   replay=replay_script(line, ["tool:fetch_statement", ""]))
    async with workers(env, fakes) as client:
        res, history = await run(client, job)
    assert res.state == JobState.FINISHED and res.final == {"ok": True}
    assert res.profile == name and name.startswith("trace:")
    # the worker assembled the inline prompt; the workflow only ever named it
    assert fakes.prompts[0][0].content == SYSTEM
    assert SYSTEM[:200] not in history.to_json()
    assert timers_s(history) == [2.5]


async def test_a_replay_survives_continue_as_new_and_respects_the_step_cap(
    env: WorkflowEnvironment,
) -> None:
    fakes = ReplayFakes(lambda req: reply("search_kb", '{"topic": "crash"}'))
    async with workers(env, fakes) as client:
        res, _ = await run(client, triage_job(continue_as_new_after_steps=1))
        capped, _ = await run(client, triage_job().model_copy(update={"max_steps": 2}))
    assert res.state == JobState.FINISHED and res.runs == 3
    assert [m.role for m in res.transcript] == ["assistant", "tool"] * 3
    assert capped.state == JobState.LOOP_CAP and len(capped.steps) == 2
