"""The OpenAI Agents SDK model provider (workers/openai_agents.py): each model call
carries its workflow's session headers, read from the model activity, over a mock
gateway (an httpx2 MockTransport behind AsyncOpenAI); and the plugin runs the example
project's workflow (tool, human review) on Temporal's time-skipping server."""

from __future__ import annotations

import dataclasses
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx2
import pytest
from agents import ModelResponse, ModelSettings, ModelTracing
from agents.items import TResponseStreamEvent
from openai import AsyncOpenAI
from openai.types.responses import ResponseCompletedEvent
from temporalio.client import Client
from temporalio.converter import DataConverter
from temporalio.openai_agents import OpenAIAgentsPlugin
from temporalio.testing import ActivityEnvironment, WorkflowEnvironment
from temporalio.worker import Worker

from tests.polling import eventually
from warmloop.workers.openai_agents import (
    DEFAULT_MODEL_TIMEOUT,
    SESSION_ID_HEADER,
    SESSION_KIND_HEADER,
    WarmloopModelProvider,
    default_model_params,
    gateway_base_url,
    session_headers,
    warmloop_agents_plugin,
)
from warmloop.workers.settings import EngineEndpoint, Settings

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "openai_agents_support"


class MockGateway:
    """Answers /v1/chat/completions like the gateway would and keeps every request.

    A call that requires a tool gets a ``lookup_order`` call, any other a text reply;
    ``usage`` reports the request's prompt as cached past the first call of its
    session (what the real gateway's affinity gives)."""

    def __init__(self) -> None:
        self.requests: list[httpx2.Request] = []
        self.sessions: set[str | None] = set()

    def bodies(self) -> list[dict[str, Any]]:
        return [json.loads(r.content) for r in self.requests]

    def usage(self, session: str | None) -> dict[str, Any]:
        cached = 96 if session in self.sessions else 0
        self.sessions.add(session)
        return {"prompt_tokens": 100, "completion_tokens": 5, "total_tokens": 105,
                "prompt_tokens_details": {"cached_tokens": cached}}

    def handler(self, request: httpx2.Request) -> httpx2.Response:
        assert request.url.path == "/v1/chat/completions", request.url
        self.requests.append(request)
        body = json.loads(request.content)
        usage = self.usage(request.headers.get(SESSION_ID_HEADER))
        if body.get("tool_choice") == "required":
            message: dict[str, Any] = {"role": "assistant", "content": None, "tool_calls": [{
                "id": f"call_{len(self.requests)}", "type": "function",
                "function": {"name": "lookup_order",
                             "arguments": json.dumps({"order_id": "O1001"})}}]}
            finish = "tool_calls"
        else:
            message, finish = {"role": "assistant", "content": "Your order shipped."}, "stop"
        if body.get("stream"):
            chunks: list[dict[str, Any]] = [
                {"choices": [{"index": 0, "delta": {"role": "assistant",
                                                    "content": message["content"]},
                              "finish_reason": None}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": finish}]},
                # with stream_options.include_usage only, as vLLM does
                *([{"choices": [], "usage": usage}]
                  if (body.get("stream_options") or {}).get("include_usage") else []),
            ]
            sse = "".join(
                "data: " + json.dumps({"id": "c1", "object": "chat.completion.chunk",
                                       "created": 0, "model": body["model"], **c}) + "\n\n"
                for c in chunks) + "data: [DONE]\n\n"
            return httpx2.Response(200, content=sse.encode(),
                                   headers={"content-type": "text/event-stream"})
        return httpx2.Response(200, json={
            "id": "c1", "object": "chat.completion", "created": 0, "model": body["model"],
            "choices": [{"index": 0, "message": message, "finish_reason": finish}],
            "usage": usage})

    def client(self) -> AsyncOpenAI:
        return AsyncOpenAI(base_url="http://gateway.test/v1", api_key="k", max_retries=0,
                           http_client=httpx2.AsyncClient(
                               transport=httpx2.MockTransport(self.handler)))


def activity_env(workflow_id: str | None, workflow_type: str | None = "SupportWorkflow"
                 ) -> ActivityEnvironment:
    """A fake model activity of workflow ``workflow_id``."""
    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, workflow_id=workflow_id,
                                   workflow_type=workflow_type,
                                   activity_type="invoke_model_activity")
    return env


async def _call(provider: WarmloopModelProvider, model_name: str | None = None,
                settings: ModelSettings | None = None) -> ModelResponse:
    return await provider.get_model(model_name).get_response(
        system_instructions="You help.", input="Where is my order?",
        model_settings=settings or ModelSettings(), tools=[], output_schema=None,
        handoffs=[], tracing=ModelTracing.DISABLED, previous_response_id=None,
        conversation_id=None, prompt=None)


async def test_each_call_carries_its_workflows_id_and_type_as_the_session() -> None:
    gw = MockGateway()
    provider = WarmloopModelProvider(client=gw.client(), default_model="tiny")
    first = await activity_env("case-1").run(_call, provider)
    second = await activity_env("case-1").run(_call, provider)
    await activity_env("case-2", "RefundWorkflow").run(_call, provider)

    headers = [(r.headers.get(SESSION_ID_HEADER), r.headers.get(SESSION_KIND_HEADER))
               for r in gw.requests]
    assert headers == [("case-1", "SupportWorkflow"), ("case-1", "SupportWorkflow"),
                       ("case-2", "RefundWorkflow")]
    assert [b["model"] for b in gw.bodies()] == ["tiny"] * 3
    # the engine's usage comes back as the SDK records it
    assert first.usage.input_tokens == 100
    assert first.usage.input_tokens_details.cached_tokens == 0
    assert second.usage.input_tokens_details.cached_tokens == 96


async def test_a_model_kept_across_activities_sends_each_calls_own_session() -> None:
    gw = MockGateway()
    model = WarmloopModelProvider(client=gw.client(), default_model="tiny").get_model(None)

    async def call() -> None:
        await model.get_response(None, "hi", ModelSettings(), [], None, [],
                                 ModelTracing.DISABLED, previous_response_id=None,
                                 conversation_id=None, prompt=None)

    await activity_env("case-a").run(call)
    await activity_env("case-b").run(call)
    assert [r.headers.get(SESSION_ID_HEADER) for r in gw.requests] == ["case-a", "case-b"]


async def test_precedence_and_options_of_the_headers_and_model_names() -> None:
    gw = MockGateway()
    provider = WarmloopModelProvider(
        client=gw.client(), default_model="tiny", model_map={"gpt-4.1": "tiny"},
        session_kind="support", extra_headers={"x-warmloop-lane": "batch", SESSION_ID_HEADER: "no"},
        session_id=lambda info: f"{info.namespace}/{info.workflow_id}")
    env = activity_env("case-1")
    await env.run(_call, provider, "gpt-4.1")
    # the agent's own extra_headers win (a workflow naming its session, or its last call)
    await env.run(_call, provider, "other-model", ModelSettings(
        extra_headers={SESSION_ID_HEADER: "shared", "x-session-final": "1"}))
    a, b = gw.requests
    assert (a.headers[SESSION_ID_HEADER], a.headers[SESSION_KIND_HEADER],
            a.headers["x-warmloop-lane"]) == ("default/case-1", "support", "batch")
    assert (b.headers[SESSION_ID_HEADER], b.headers["x-session-final"]) == ("shared", "1")
    assert [body["model"] for body in gw.bodies()] == ["tiny", "other-model"]


async def test_outside_a_workflow_no_session_is_sent() -> None:
    gw = MockGateway()
    provider = WarmloopModelProvider(client=gw.client(), default_model="tiny")
    await _call(provider)  # not in an activity at all
    await activity_env(None, None).run(_call, provider)  # a standalone activity
    assert [SESSION_ID_HEADER in r.headers for r in gw.requests] == [False, False]
    assert session_headers() == {}


async def test_streamed_calls_ask_for_usage_and_get_the_cached_tokens() -> None:
    gw = MockGateway()
    provider = WarmloopModelProvider(client=gw.client(), default_model="tiny")

    async def stream() -> list[TResponseStreamEvent]:
        model = provider.get_model(None)
        return [e async for e in model.stream_response(
            None, "hi", ModelSettings(), [], None, [], ModelTracing.DISABLED,
            previous_response_id=None, conversation_id=None, prompt=None)]

    await activity_env("case-s").run(stream)
    events = await activity_env("case-s").run(stream)
    (body, _), (request, _) = gw.bodies(), gw.requests
    assert body["stream_options"] == {"include_usage": True}
    assert request.headers[SESSION_ID_HEADER] == "case-s"
    done = [e for e in events if isinstance(e, ResponseCompletedEvent)]
    assert done and done[-1].response.usage is not None
    assert done[-1].response.usage.input_tokens_details.cached_tokens == 96


async def test_a_model_needs_a_name_or_a_default() -> None:
    provider = WarmloopModelProvider("http://127.0.0.1:8500/v1")
    with pytest.raises(ValueError, match="default_model"):
        provider.get_model(None)
    assert provider.get_model("tiny") is not None
    assert str(provider.client.base_url) == "http://127.0.0.1:8500/v1/"
    assert provider.client.max_retries == 0  # the model activity's retry policy decides
    with pytest.raises(ValueError, match="base_url"):
        WarmloopModelProvider()


def test_the_provider_and_the_plugin_build_from_the_settings() -> None:
    one_model = Settings(gateway_port=8600, engines=[
        EngineEndpoint(id="a", url="http://127.0.0.1:8100"),
        EngineEndpoint(id="b", url="http://127.0.0.1:8101")])
    provider = WarmloopModelProvider.from_settings(one_model)
    assert gateway_base_url(one_model) == "http://127.0.0.1:8600/v1"
    assert str(provider.client.base_url) == "http://127.0.0.1:8600/v1/"
    # another host's gateway: by its configured address, never by loopback
    remote = Settings(gateway_url="http://10.231.7.2:8500/")
    assert gateway_base_url(remote) == "http://10.231.7.2:8500/v1"
    assert provider.served_model(None) == "tiny"  # what every engine serves
    two_models = Settings(engines=[
        EngineEndpoint(id="a", url="http://127.0.0.1:8100", model="tiny"),
        EngineEndpoint(id="b", url="http://127.0.0.1:8101", model="big")])
    with pytest.raises(ValueError, match="default_model"):
        WarmloopModelProvider.from_settings(two_models).served_model(None)
    elsewhere = WarmloopModelProvider.from_settings(
        one_model, base_url="http://gateway.internal:8500/v1", session_kind="support")
    assert str(elsewhere.client.base_url) == "http://gateway.internal:8500/v1/"

    # a custom provider needs a model activity timeout: the default options give one
    assert isinstance(warmloop_agents_plugin(one_model), OpenAIAgentsPlugin)
    assert isinstance(warmloop_agents_plugin(provider=elsewhere, register_activities=False),
                      OpenAIAgentsPlugin)
    params = default_model_params()
    assert params.start_to_close_timeout is not None
    assert params.start_to_close_timeout > DEFAULT_MODEL_TIMEOUT


@pytest.fixture
def example() -> Iterator[None]:
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    yield


async def test_the_example_runs_on_temporal_with_each_call_in_its_workflows_session(
        time_skipping_env: WorkflowEnvironment, example: None) -> None:
    """The example project's workflow under the plugin: the tool runs, the review
    (an Update) is waited for, and every model call reached the gateway with the
    workflow's id; the usage the workflow reports is the gateway's."""
    from openai_agents_support.orders import lookup_order
    from openai_agents_support.workflows import Review, SupportRequest, SupportWorkflow

    gw = MockGateway()
    provider = WarmloopModelProvider(client=gw.client(), default_model="tiny")
    plugin = warmloop_agents_plugin(provider=provider)
    # The plugin sets the SDK's data converter: it needs a client on the default one.
    config = time_skipping_env.client.config()
    config["data_converter"] = DataConverter.default
    config["plugins"] = [plugin]
    client = Client(**config)
    task_queue = f"oa-{uuid.uuid4().hex[:8]}"
    wf_id = f"support-{uuid.uuid4().hex[:8]}"
    async with Worker(client, task_queue=task_queue, workflows=[SupportWorkflow],
                      activities=[lookup_order]):
        handle = await client.start_workflow(
            SupportWorkflow.run, SupportRequest(customer="Ada", question="Where is O1001?"),
            id=wf_id, task_queue=task_queue)

        async def drafted() -> tuple[str] | None:
            draft = await handle.query(SupportWorkflow.draft)
            return None if draft is None else (draft,)

        (draft,) = await eventually(drafted, attempts=400)
        assert draft == "Your order shipped."
        decided = await handle.execute_update(SupportWorkflow.review,
                                              Review(approved=True, reviewer="ann"))
        assert decided == draft
        outcome = await handle.result()

    assert outcome.review.reviewer == "ann" and outcome.review.approved
    assert [json.loads(o)["status"] for o in outcome.tool_outputs] == ["shipped"]
    bodies = gw.bodies()
    # required (the lookup), then reset by the SDK after the tool ran, then none (reply)
    assert [b.get("tool_choice") for b in bodies] == ["required", None, "none"]
    assert {r.headers[SESSION_ID_HEADER] for r in gw.requests} == {wf_id}
    assert {r.headers[SESSION_KIND_HEADER] for r in gw.requests} == {"SupportWorkflow"}
    # the last call (the reply after the review) ends the session
    assert [r.headers.get("x-session-final") for r in gw.requests] == [None, None, "1"]
    assert "Customer: Ada." in bodies[0]["messages"][0]["content"]
    assert [c.cached_tokens for c in outcome.model_calls] == [0, 96, 96]

