"""Context hygiene in the workflow (time-skipping server, scripted activities): where
it compacts, what the engine's prompt then holds, and what it does when S3 is down."""

from __future__ import annotations

import dataclasses
import json
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import asynccontextmanager
from typing import Any

import pytest
from temporalio import activity
from temporalio.client import Client
from temporalio.exceptions import ApplicationError
from temporalio.testing import WorkflowEnvironment
from temporalio.worker import Worker

from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import TICKET
from warmloop.workers.temporal_plugin import sandbox_runner
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    ChatMessage,
    FunctionCall,
    GenerateRequest,
    GenerateResult,
    JobInput,
    JobResult,
    JobState,
    ReplayScript,
    ReplayStep,
    ToolCall,
    ToolRequest,
    ToolResult,
    engine_task_queue,
)
from warmloop.workflows.hygiene import ArchiveRequest, ContextHygiene, archive_key, is_summary
from warmloop.workflows.profiles import get_profile
from warmloop.workflows.profiles.registry import REGISTRY

PROFILE = "hygiene-triage"
"""ticket-triage with hygiene on (cost model, a check every 8 steps)."""
KEEPER = "hygiene-keeper"
"""The same, but lookup_customer's outputs are never archived (so a big prefix stays)."""
LIMITS = JobLimits(max_steps=40, max_tool_calls={"search_kb": 99, "lookup_customer": 99})


@pytest.fixture(autouse=True)
def profiles() -> Iterator[None]:
    base = get_profile("ticket-triage")
    REGISTRY.add(dataclasses.replace(base, name=PROFILE, hygiene=ContextHygiene()),
                 source="test")
    REGISTRY.add(dataclasses.replace(base, name=KEEPER, hygiene=ContextHygiene(
        keep_tools=("lookup_customer",), keep_recent_steps=2)), source="test")
    yield
    REGISTRY.remove(PROFILE)
    REGISTRY.remove(KEEPER)


class HygieneFakes(FakeActivities):
    """The fakes plus an S3 archive that may be down for its first ``down_calls``, and
    an inference worker that keeps its own copy of each transcript in memory, apart
    from S3, as the real one does (``TranscriptStore``): a compaction that only rewrote
    S3 would leave this copy, hence the prompt, stale."""

    def __init__(self, script: Callable[[GenerateRequest], GenerateResult], **kw: Any) -> None:
        super().__init__(script, **kw)
        self.archive: dict[str, str] = {}
        self.archive_calls = 0
        self.down_calls = 0
        self.worker_copy: dict[str, list[ChatMessage]] = {}

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        held = self.worker_copy.get(req.job_id)
        if held is not None and len(held) >= req.base_len:
            prefix = held[:req.base_len]
        else:  # not in memory: read from the store
            prefix = self.transcripts.get(req.job_id, [])[:req.base_len]
            assert len(prefix) == req.base_len, "the store lacks messages"
        self.worker_copy[req.job_id] = prefix + req.new_messages
        return await super().generate(req.model_copy(
            update={"base_len": 0, "new_messages": self.worker_copy[req.job_id]}))

    @activity.defn(name="archive_tool_outputs")
    async def archive_tool_outputs(self, req: ArchiveRequest) -> list[str]:
        self.archive_calls += 1
        if self.archive_calls <= self.down_calls:
            raise ApplicationError("S3 unreachable")
        for o in req.outputs:
            self.archive[o.key] = o.text
        return [o.key for o in req.outputs]


@asynccontextmanager
async def workers(env: WorkflowEnvironment, fakes: HygieneFakes) -> AsyncIterator[Client]:
    client = env.client
    agent = Worker(client, task_queue=AGENT_TASK_QUEUE, workflow_runner=sandbox_runner(),
                   workflows=[AgentJob],
                   activities=[fakes.route_step, fakes.pick_engine, fakes.record_pause,
                               fakes.engine_alive, fakes.run_tool, fakes.store_transcript,
                               fakes.load_transcript, fakes.archive_tool_outputs])
    engine = Worker(client, task_queue=engine_task_queue("fake0"),
                    activities=[fakes.generate, fakes.prewarm])
    async with agent, engine:
        yield client


def sized(fakes: FakeActivities, call: Callable[[GenerateRequest], GenerateResult]
          ) -> Callable[[GenerateRequest], GenerateResult]:
    """The scripted reply, with prompt tokens as a tokenizer would count the prompt the
    fake engine just assembled (4 characters a token), nearly all cached."""
    def script(req: GenerateRequest) -> GenerateResult:
        chars = sum(len(m.content) + sum(len(c.function.arguments) for c in m.tool_calls or ())
                    for m in fakes.prompts[-1])
        tokens = chars // 4
        return call(req).model_copy(update={"prompt_tokens": tokens,
                                            "cached_tokens": int(tokens * 0.9)})
    return script


SEARCH = reply("search_kb", '{"topic": "crash"}')


def big_output(r: ToolRequest) -> ToolResult:
    return ToolResult(ok=True, output=f"article {r.step:03d}: " + "kb text " * 500)


def searcher(fakes: FakeActivities) -> Callable[[GenerateRequest], GenerateResult]:
    return sized(fakes, lambda req: SEARCH)


async def run(client: Client, **kw: Any) -> JobResult:
    job = JobInput(profile=kw.pop("profile", PROFILE), task=TICKET, **kw)
    return await client.execute_workflow(AgentJob.run, job, id=f"hyg-{uuid.uuid4().hex[:8]}",
                                         task_queue=AGENT_TASK_QUEUE)


def assert_prompts_match_the_transcript(fakes: FakeActivities, res: JobResult) -> None:
    """The engine's last prompt is the workflow's transcript (before the last step's
    call and answer): the inference worker's copy followed every compaction."""
    whole = res.transcript or fakes.stored[-1].transcript  # a big one: as stored
    last = fakes.prompts[-1][2:-1]  # system, task ... tail
    assert last == whole[:len(last)]
    assert len(whole) == len(last) + 2


def summaries(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    return [json.loads(m.content)["archived_tool_output"] for m in messages
            if m.role == "tool" and is_summary(m.content)]


async def test_a_long_job_compacts_at_continue_as_new_and_archives_everything(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = HygieneFakes(lambda r: SEARCH, tool_output=big_output)
    fakes.script = searcher(fakes)
    async with workers(time_skipping_env, fakes) as client:
        res = await run(client, limits=LIMITS)
    assert res.state == JobState.LOOP_CAP and len(res.steps) == 40
    assert res.runs >= 3  # compaction points are continue-as-new points
    archived = summaries(res.transcript)
    assert len(archived) >= 20
    for s in archived:  # nothing lost: each summary's key holds the whole output
        whole = f"article {s['step']:03d}: " + "kb text " * 500
        assert fakes.archive[archive_key(res.job_id, s["ref"])] == whole
        assert s["tool"] == "search_kb" and s["ok"] is True
    assert_prompts_match_the_transcript(fakes, res)
    # the prompt shrank at the compaction points and is smaller than without hygiene
    sizes = [r.prompt_tokens for r in res.steps]
    assert any(b < a for a, b in zip(sizes, sizes[1:], strict=False))

    plain = HygieneFakes(lambda r: SEARCH, tool_output=big_output)
    plain.script = searcher(plain)
    async with workers(time_skipping_env, plain) as client:
        off = await run(client, limits=LIMITS, context_hygiene="off")
    assert off.runs == 1 and not plain.archive and not summaries(off.transcript)
    assert res.usage.prompt_tokens < 0.6 * off.usage.prompt_tokens


async def test_short_jobs_never_compact(time_skipping_env: WorkflowEnvironment) -> None:
    fakes = HygieneFakes(lambda r: SEARCH, tool_output=big_output)
    fakes.script = searcher(fakes)
    async with workers(time_skipping_env, fakes) as client:
        res = await run(client, limits=LIMITS.model_copy(update={"max_steps": 8}))
    assert res.state == JobState.LOOP_CAP and res.runs == 1
    assert fakes.archive_calls == 0 and not summaries(res.transcript)


async def test_s3_down_at_the_compaction_point_goes_on_whole_and_tries_later(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = HygieneFakes(lambda r: SEARCH, tool_output=big_output)
    fakes.script = searcher(fakes)
    fakes.down_calls = 3  # the first point's three attempts
    async with workers(time_skipping_env, fakes) as client:
        res = await run(client, limits=LIMITS.model_copy(update={"max_steps": 28}))
    assert res.state == JobState.LOOP_CAP and len(res.steps) == 28
    assert fakes.archive_calls > 3  # a later point archived
    archived = summaries(res.transcript)
    # step 8's point failed: the outputs were kept; step 16's compacted steps 1-13
    assert [s["step"] for s in archived] == list(range(1, 14))
    assert res.runs == 2
    assert_prompts_match_the_transcript(fakes, res)


async def test_every_step_compacts_in_place_without_continue_as_new(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    fakes = HygieneFakes(lambda r: SEARCH, tool_output=big_output)
    fakes.script = searcher(fakes)
    async with workers(time_skipping_env, fakes) as client:
        res = await run(client, limits=LIMITS.model_copy(update={"max_steps": 12}),
                        context_hygiene="every_step")
    assert res.runs == 1
    # before each of steps 5-12, the output of the step 4 steps back
    assert [s["step"] for s in summaries(res.transcript)] == list(range(1, 9))
    assert fakes.archive_calls == 8
    assert_prompts_match_the_transcript(fakes, res)


async def test_a_replayed_job_compacts_too(time_skipping_env: WorkflowEnvironment) -> None:
    steps = [ReplayStep(call=ToolCall(id=f"call-{i}", function=FunctionCall(
        name="search_kb", arguments='{"topic": "crash"}')),
        result=f"article {i:03d}: " + "kb text " * 500, output_tokens=4) for i in range(1, 31)]
    fakes = HygieneFakes(lambda r: reply(None), tool_output=big_output)
    fakes.script = sized(fakes, lambda req: reply(None))
    async with workers(time_skipping_env, fakes) as client:
        res = await run(client, limits=LIMITS, replay=ReplayScript(steps=steps))
    assert res.state == JobState.FINISHED and len(res.steps) == 30
    assert res.runs >= 2 and summaries(res.transcript)
    assert_prompts_match_the_transcript(fakes, res)


async def test_a_big_kept_prefix_moves_through_s3_and_the_tail_is_resent(
    time_skipping_env: WorkflowEnvironment,
) -> None:
    """Kept outputs past the inline size: the carry goes through the message store, and
    the next run still re-sends the compacted tail from its first changed message."""
    huge = "customer record " * 6_000  # ~96 kB each, three of them

    def tool(r: ToolRequest) -> ToolResult:
        return ToolResult(ok=True, output=huge if r.name == "lookup_customer"
                          else f"article {r.step:03d}: " + "kb text " * 500)

    lookup = reply("lookup_customer", '{"customer_id": "C100"}')
    fakes = HygieneFakes(lambda r: SEARCH, tool_output=tool)
    fakes.script = sized(fakes, lambda req: lookup if req.step <= 3 else SEARCH)
    async with workers(time_skipping_env, fakes) as client:
        res = await run(client, profile=KEEPER, limits=LIMITS.model_copy(
            update={"max_steps": 20}))
    assert res.runs >= 2 and fakes.loads  # carried through S3
    assert res.transcript == []  # too big for the result: it is in S3
    whole = fakes.stored[-1].transcript
    archived = summaries(whole)
    assert archived and all(s["tool"] == "search_kb" for s in archived)
    assert [m.content for m in whole if m.role == "tool"][:3] == [huge] * 3
    assert_prompts_match_the_transcript(fakes, res)


async def test_fresh_hygiene_histories_replay(time_skipping_env: WorkflowEnvironment) -> None:
    """The compaction paths' commands (the archive, the continue-as-new it asks for; the
    every-step archive in place) replay; recorded with WARMLOOP_RECORD_HISTORIES=1 for
    test_replay. A bundled profile, so the recorded histories replay anywhere."""
    from tests.workflow.test_replay import _record, _replayer

    for mode, name, steps in (("cost_model", "agent_job_context_hygiene.json", 24),
                              ("every_step", "agent_job_context_hygiene_every_step.json", 6)):
        fakes = HygieneFakes(lambda r: SEARCH, tool_output=lambda r: ToolResult(
            ok=True, output=f"article {r.step:03d}: " + "kb text " * 260))  # just large
        fakes.script = searcher(fakes)
        async with workers(time_skipping_env, fakes) as client:
            handle = await client.start_workflow(
                AgentJob.run, JobInput(profile="ticket-triage", task=TICKET,
                                       context_hygiene=mode,  # type: ignore[arg-type]
                                       limits=LIMITS.model_copy(update={"max_steps": steps})),
                id=f"hyg-replay-{uuid.uuid4().hex[:8]}", task_queue=AGENT_TASK_QUEUE)
            res = await handle.result()
            first = client.get_workflow_handle(handle.id,
                                               run_id=handle.first_execution_run_id)
            history = await first.fetch_history()
        assert fakes.archive_calls >= 1
        assert (res.runs == 1) == (mode == "every_step")
        await _replayer().replay_workflow(history)
        _record(name, history)
