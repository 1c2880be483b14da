"""Tools loaded on demand: the index, the loader's schema and answers, what is loaded
(from the transcript alone), the engine's constraint and its parsing, the inference
worker's request, and the workflow answering load_tools itself (time-skipping server,
scripted engine)."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from typing import Literal

import httpx
import jsonschema
import pytest
import xgrammar
from pydantic import BaseModel, ConfigDict, Field
from temporalio.testing import WorkflowEnvironment

from tests.unit.engine_fakes import engine, generate, inference, role_chunk, sse, usage_chunk
from tests.workflow.fakes import FakeActivities, reply
from tests.workflow.test_agent_job import workers
from warmloop.workflows import tool_loading as tl
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    ChatMessage,
    FunctionCall,
    GenerateRequest,
    GenerateResult,
    JobInput,
    JobState,
    ToolCall,
)
from warmloop.workflows.profiles import REGISTRY
from warmloop.workflows.profiles.base import Profile, ToolSpec, unbounded_strings
from warmloop.workflows.profiles.document import profile_from_document
from warmloop.workflows.prompt import (
    assemble_prompt,
    request_tools,
    stable_prefix_hash,
    system_content,
)


class Task(BaseModel):
    model_config = ConfigDict(extra="forbid")
    case_id: str = Field(pattern=r"^C[0-9]{1,6}$")


class Pick(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: Literal["a", "b", "c"]


class Sub(BaseModel):
    model_config = ConfigDict(extra="forbid")
    level: Literal["low", "high"]


class Nested(BaseModel):
    model_config = ConfigDict(extra="forbid")
    sub: Sub
    record: str = Field(pattern=r"^R[0-9]{3}$")


class Finish(BaseModel):
    model_config = ConfigDict(extra="forbid")
    outcome: Literal["done", "failed"]


def tools() -> tuple[ToolSpec, ...]:
    return (
        ToolSpec("alpha", "Look up an alpha record. It answers a long line of words.", Pick),
        ToolSpec("beta", "Update a beta record.", Nested),
        ToolSpec("gamma", "Search gamma records; the best first", Pick),
        ToolSpec("finish", "Finish the case.", Finish, finishes_job=True),
    )


def profile(name: str = "ondemand-test", *, on_demand: bool = True,
            extra: tuple[ToolSpec, ...] = (), **kw: object) -> Profile:
    return Profile(name=name, system_prompt="You are a test agent.", task_model=Task,
                   task_id_field="case_id", tools=(*tools(), *extra),
                   tools_on_demand=on_demand, **kw)  # type: ignore[arg-type]


LAZY = profile()
EAGER = profile("eager-test", on_demand=False)


def load_call(call_id: str, names: list[str]) -> ChatMessage:
    return ChatMessage(role="assistant", tool_calls=[ToolCall(id=call_id, function=FunctionCall(
        name="load_tools", arguments=json.dumps({"names": names})))])


def answer(call_id: str, content: str) -> ChatMessage:
    return ChatMessage(role="tool", tool_call_id=call_id, content=content)


# ---- the prefix ---------------------------------------------------------------------------


def test_the_index_lists_every_loadable_tool_in_one_line_and_no_schema() -> None:
    index = tl.index_text(LAZY)
    lines = index.splitlines()
    assert [ln for ln in lines if ln.startswith("- ")] == [
        "- alpha: Look up an alpha record", "- beta: Update a beta record",
        "- gamma: Search gamma records; the best first"]
    assert "close" not in index and "finish, load_tools" in index
    assert "properties" not in index and "enum" not in index
    # the job's offer narrows it
    assert "- beta" not in tl.index_text(LAZY, ["alpha", "finish"])


def test_the_rendered_tools_are_the_loader_and_the_finishing_tools_whatever_is_loaded() -> None:
    rendered = request_tools(LAZY)
    assert [s["function"]["name"] for s in rendered] == ["finish", "load_tools"]
    assert request_tools(EAGER) == EAGER.tool_schemas()
    loader = rendered[1]["function"]["parameters"]
    names = loader["properties"]["names"]
    assert names["items"]["enum"] == ["alpha", "beta", "gamma"] and names["maxItems"] == 3
    assert loader["required"] == ["names"]
    assert unbounded_strings(tl.load_tools_spec(LAZY).args) == []


def test_the_stable_prefix_is_the_same_on_every_step_and_holds_the_index() -> None:
    task = Task(case_id="C1")
    transcript = [load_call("c1", ["beta"]), answer("c1", tl.load_answer(LAZY, ["beta"], set()))]
    first = assemble_prompt(LAZY, task, [], tail="Step 1.")
    later = assemble_prompt(LAZY, task, transcript, tail="Step 2.")
    assert first[0] == later[0] and later[2:4] == transcript
    assert first[0].content == system_content(LAZY) and "- beta: " in first[0].content
    assert stable_prefix_hash(LAZY) != stable_prefix_hash(EAGER)
    assert stable_prefix_hash(EAGER) == stable_prefix_hash(profile("eager-test",
                                                                   on_demand=False))


def test_a_profile_on_demand_is_refused_when_it_could_not_work() -> None:
    with pytest.raises(ValueError, match="adds a tool named 'load_tools'"):
        Profile(name="x", system_prompt="s", task_model=Task, tools_on_demand=True,
                tools=(*tools(), ToolSpec("load_tools", "mine", Pick)))
    with pytest.raises(ValueError, match="no tool to load"):
        Profile(name="x", system_prompt="s", task_model=Task, tools_on_demand=True,
                tools=(tools()[3],))
    huge = type("Huge", (BaseModel,), {
        "__annotations__": {f"f{i}": Literal["x" * 60, "y" * 60] for i in range(40)},
        "model_config": ConfigDict(extra="forbid")})
    with pytest.raises(ValueError, match="could never be loaded on demand"):
        profile(extra=(ToolSpec("huge", "A huge schema.", huge),), max_tool_output_chars=2000)


def test_a_yaml_profile_may_ask_for_tools_on_demand() -> None:
    doc = {"name": "yaml-lazy", "system_prompt": "s", "tools_on_demand": True,
           "task_schema": {"type": "object", "properties": {"id": {"type": "string",
                                                                    "pattern": "^[0-9]+$"}},
                           "required": ["id"]},
           "tools": [{"name": "finish", "description": "done", "finishes_job": True,
                      "arguments": {"type": "object", "properties": {}}},
                     {"name": "look", "description": "look", "http": {"url": "http://x"},
                      "arguments": {"type": "object", "properties": {
                          "k": {"type": "string", "enum": ["a"]}}, "required": ["k"]}}]}
    assert profile_from_document(doc).tools_on_demand
    assert not profile_from_document({**doc, "tools_on_demand": False}).tools_on_demand


# ---- what is loaded -------------------------------------------------------------------------


def test_loaded_tools_come_from_the_load_answers_in_the_transcript() -> None:
    first = tl.load_answer(LAZY, ["beta", "alpha"], set())
    body = json.loads(first)
    assert [s["function"]["name"] for s in body["loaded"]] == ["alpha", "beta"]
    assert body["loaded"][1] == LAZY.tool("beta").openai_schema()
    transcript = [load_call("c1", ["beta", "alpha"]), answer("c1", first)]
    assert tl.loaded_from_transcript(LAZY, transcript) == {"alpha", "beta"}
    assert tl.offered(LAZY, transcript) == ["alpha", "beta", "finish", "load_tools"]
    # an error the model read loads nothing; nor does another tool's answer that looks alike
    refused = [load_call("c2", ["gamma"]), answer("c2", "error: invalid arguments"),
               ChatMessage(role="assistant", tool_calls=[ToolCall(id="c3", function=FunctionCall(
                   name="alpha", arguments='{"key": "a"}'))]),
               answer("c3", tl.load_answer(LAZY, ["gamma"], set()))]
    assert tl.loaded_from_transcript(LAZY, transcript + refused) == {"alpha", "beta"}
    # the job's offer bounds it
    assert tl.loaded_from_transcript(LAZY, transcript, ["alpha", "finish"]) == {"alpha"}


def test_loading_again_or_past_the_answer_bound_says_so() -> None:
    again = json.loads(tl.load_answer(LAZY, ["alpha", "beta"], {"alpha"}))
    assert again["already_loaded"] == ["alpha"]
    assert [s["function"]["name"] for s in again["loaded"]] == ["beta"]
    nothing = json.loads(tl.load_answer(LAZY, ["alpha"], {"alpha"}))
    assert nothing == {"already_loaded": ["alpha"],
                       "note": "nothing new: these are loaded already; call them"}
    biggest = max(len(json.dumps(LAZY.tool(n).openai_schema(), separators=(",", ":")))
                  for n in ("alpha", "beta", "gamma"))
    tight = profile(max_tool_output_chars=max(256, biggest + 20))  # one at a time
    split = json.loads(tl.load_answer(tight, ["alpha", "beta", "gamma"], set()))
    assert [s["function"]["name"] for s in split["loaded"]] == ["alpha"]
    assert split["later"] == ["beta", "gamma"] and "again" in split["note"]


def test_refusals_the_model_reads_name_what_to_do() -> None:
    assert tl.call_problem(LAZY, "beta", "{}", set()) == \
        "tool beta is not loaded; load it first with load_tools"
    problem = tl.call_problem(LAZY, "load_tools", '{"names": ["beta", "nope"]}', set())
    assert problem is not None and "no tool named nope" in problem
    assert tl.call_problem(LAZY, "load_tools", "not json", set()) is None
    assert tl.call_problem(LAZY, "alpha", '{"key": "z"}', {"alpha"}) is None


# ---- the engine's constraint ---------------------------------------------------------------


def _one(name: str, parameters: object) -> list[dict[str, object]]:
    return [{"name": name, "parameters": parameters}]


def test_the_constraint_accepts_exactly_one_call_to_an_offered_tool() -> None:
    schema = tl.constraint_schema(LAZY, ["beta", "finish", "load_tools"], {"beta"})
    ok = jsonschema.Draft202012Validator(schema)
    assert ok.is_valid(_one("beta", {"sub": {"level": "low"}, "record": "R123"}))
    assert ok.is_valid(_one("load_tools", {"names": ["alpha", "gamma"]}))
    assert ok.is_valid(_one("finish", {"outcome": "done"}))
    assert not ok.is_valid(_one("alpha", {"key": "a"}))  # not loaded
    assert not ok.is_valid(_one("load_tools", {"names": ["beta"]}))  # loaded already
    assert not ok.is_valid(_one("load_tools", {"names": ["nope"]}))
    assert not ok.is_valid(_one("beta", {"sub": {"level": "low"}}))
    assert not ok.is_valid(_one("finish", {"outcome": "done"}) * 2)
    assert "$defs" in schema and "Sub" in schema["$defs"]  # lifted to the root
    everything = tl.constraint_schema(LAZY, ["alpha", "beta", "finish", "gamma", "load_tools"],
                                      {"alpha", "beta", "gamma"})
    names = [a["properties"]["name"]["enum"][0] for a in everything["items"]["anyOf"]]
    assert names == ["alpha", "beta", "finish", "gamma"]  # nothing left to load
    # the engine's grammar backend compiles it (xgrammar, as the stack configures vLLM)
    xgrammar.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False)


def test_the_models_constrained_text_is_parsed_into_one_call() -> None:
    assert tl.parse_call('[{"name": "beta", "parameters": {"record": "R1", "sub": {}}}]') == (
        "beta", '{"record":"R1","sub":{}}')
    assert tl.parse_call('[{"name": "beta", "parameters": {"record"') is None  # cut
    assert tl.parse_call('[{"name": "a", "parameters": {}}, {"name": "b"}]') is None
    assert tl.parse_call("[]") is None and tl.parse_call("text") is None


# ---- the inference worker ------------------------------------------------------------------


@pytest.fixture
def registered() -> Iterator[None]:
    for p in (LAZY, EAGER):
        REGISTRY.add(p, source="test")
    yield
    for p in (LAZY, EAGER):
        REGISTRY.remove(p.name)


def _content_stream(text: str) -> bytes:
    return sse(role_chunk(), {"choices": [{"index": 0, "delta": {"content": text}}]},
               {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
               usage_chunk(), "[DONE]")


async def test_the_worker_sends_a_constant_tools_list_and_the_loaded_tools_constraint(
        registered: None) -> None:
    sent: list[httpx.Request] = []
    text = '[{"name":"beta","parameters":{"record":"R123","sub":{"level":"high"}}}]'
    inf = inference(engine(_content_stream(text), sent))
    base = dict(job_id="j1", profile=LAZY.name, task={"case_id": "C1"}, tail="t",
                max_tokens=64)
    first = await generate(inf, GenerateRequest(step=1, base_len=0, **base))  # type: ignore[arg-type]
    loaded = [load_call("c1", ["beta"]), answer("c1", tl.load_answer(LAZY, ["beta"], set()))]
    second = await generate(inf, GenerateRequest(step=2, base_len=0, new_messages=loaded,
                                                 **base))  # type: ignore[arg-type]
    bodies = [json.loads(r.content) for r in sent if r.url.path == "/v1/chat/completions"]
    assert bodies[0]["tools"] == bodies[1]["tools"] == request_tools(LAZY)
    assert bodies[0]["messages"][0] == bodies[1]["messages"][0]
    assert {b["tool_choice"] for b in bodies} == {"none"}
    allowed = [[a["properties"]["name"]["enum"][0] for a in
                b["structured_outputs"]["json"]["items"]["anyOf"]] for b in bodies]
    assert allowed == [["finish", "load_tools"], ["beta", "finish", "load_tools"]]
    for result in (first, second):
        assert result.content == ""
        assert [(c.id, c.function.name, json.loads(c.function.arguments))
                for c in result.tool_calls][0][1:] == (
            "beta", {"record": "R123", "sub": {"level": "high"}})
    assert second.tool_calls[0].id == "call-j1-2-0"


async def test_a_cut_call_on_demand_comes_back_as_text_the_workflow_refuses(
        registered: None) -> None:
    inf = inference(engine(_content_stream('[{"name":"beta","parameters":{"rec')))
    result = await generate(inf, GenerateRequest(job_id="j2", step=1, profile=LAZY.name,
                                                 task={"case_id": "C1"}, base_len=0,
                                                 tail="t", max_tokens=8))
    assert result.tool_calls == [] and result.content.startswith('[{"name":"beta"')


async def test_a_profile_not_on_demand_sends_what_it_always_sent(registered: None) -> None:
    sent: list[httpx.Request] = []
    inf = inference(engine(requests=sent))
    await generate(inf, GenerateRequest(job_id="j3", step=1, profile=EAGER.name,
                                        task={"case_id": "C1"}, base_len=0, tail="t",
                                        max_tokens=8))
    body = json.loads(next(r for r in sent if r.url.path == "/v1/chat/completions").content)
    assert body["tool_choice"] == "required" and "structured_outputs" not in body
    assert body["tools"] == EAGER.tool_schemas()
    assert body["messages"][0]["content"] == EAGER.system_prompt


# ---- the workflow --------------------------------------------------------------------------


def _call(name: str, args: object) -> GenerateResult:
    return reply(name, json.dumps(args))


async def _run(env: WorkflowEnvironment, fakes: FakeActivities, **kw: object) -> object:
    async with workers(env, fakes) as client:
        return await client.execute_workflow(
            AgentJob.run, JobInput(profile=LAZY.name, task={"case_id": "C1"},
                                   **kw),  # type: ignore[arg-type]
            id=f"lazy-{uuid.uuid4().hex[:8]}", task_queue=AGENT_TASK_QUEUE)


async def test_the_workflow_answers_load_tools_itself_and_then_accepts_the_tool(
        time_skipping_env: WorkflowEnvironment, registered: None) -> None:
    script = {1: _call("load_tools", {"names": ["alpha"]}), 2: _call("alpha", {"key": "b"}),
              3: _call("finish", {"outcome": "done"})}
    fakes = FakeActivities(lambda req: script[req.step])
    res = await _run(time_skipping_env, fakes)
    assert res.state == JobState.FINISHED, res.reason  # type: ignore[attr-defined]
    assert [t.name for t in fakes.tool_requests] == ["alpha"]  # no activity for the loader
    loaded = json.loads(res.transcript[1].content)  # type: ignore[attr-defined]
    assert loaded == {"loaded": [LAZY.tool("alpha").openai_schema()]}
    # the request's tools stay the job's (its prefix family); the system message stays put
    assert {r.tools for r in fakes.generate_requests} == {None}
    assert len({p[0].content for p in fakes.prompts}) == 1
    assert [s.tool for s in res.steps] == ["load_tools", "alpha", "finish"]  # type: ignore[attr-defined]


async def test_unloaded_tools_and_unknown_names_get_an_answer_the_model_can_act_on(
        time_skipping_env: WorkflowEnvironment, registered: None) -> None:
    script = {1: _call("gamma", {"key": "a"}),
              2: _call("load_tools", {"names": ["gamma", "nope"]}),
              3: _call("load_tools", {"names": ["gamma"]}),
              4: _call("load_tools", {"names": ["gamma"]}),
              5: _call("finish", {"outcome": "done"})}
    fakes = FakeActivities(lambda req: script[req.step])
    res = await _run(time_skipping_env, fakes)
    assert res.state == JobState.FINISHED  # type: ignore[attr-defined]
    errors = [s.error for s in res.steps]  # type: ignore[attr-defined]
    assert errors[0] == "tool gamma is not loaded; load it first with load_tools"
    assert errors[1] is not None and "no tool named nope in the index" in errors[1]
    answers = [m.content for m in res.transcript if m.role == "tool"]  # type: ignore[attr-defined]
    assert json.loads(answers[3]) == {"already_loaded": ["gamma"], "note":
                                      "nothing new: these are loaded already; call them"}


async def test_a_model_that_loads_forever_is_capped(
        time_skipping_env: WorkflowEnvironment, registered: None) -> None:
    fakes = FakeActivities(lambda req: _call("load_tools", {"names": ["alpha"]}))
    res = await _run(time_skipping_env, fakes, max_steps=50)
    assert res.state == JobState.LOOP_CAP  # type: ignore[attr-defined]
    # three tools to load: two spare calls, then the cap (long before max_steps)
    assert len(res.steps) == 6 and "load_tools" in res.reason  # type: ignore[attr-defined]


async def test_loaded_tools_survive_continue_as_new(
        time_skipping_env: WorkflowEnvironment, registered: None) -> None:
    script = {1: _call("load_tools", {"names": ["beta"]}),
              2: _call("beta", {"sub": {"level": "low"}, "record": "R001"}),
              3: _call("finish", {"outcome": "done"})}
    fakes = FakeActivities(lambda req: script[req.step])
    res = await _run(time_skipping_env, fakes, continue_as_new_after_steps=1)
    assert res.state == JobState.FINISHED and res.runs >= 2  # type: ignore[attr-defined]
    assert [t.name for t in fakes.tool_requests] == ["beta"]
