"""The OpenAI Agents SDK on Temporal, on warm caches: a model provider for
``temporalio.openai_agents.OpenAIAgentsPlugin`` that sends every model call of an agent
workflow to warmloop's OpenAI-compatible gateway with the workflow id as the session id.

An existing OpenAI-Agents-on-Temporal project changes its worker setup only, the
plugin of the client its worker runs on::

    Client.connect(address, plugins=[warmloop_agents_plugin()])  # was OpenAIAgentsPlugin()

(The project's own client, not warmloop's ``connect``: these workflows use the SDK's
data converter, which the plugin sets.)

How it works. Under the plugin, an agent's model calls leave the workflow as the plugin's
model activity (``invoke_model_activity``), which asks the provider for a model by the
agent's model name and calls it. The model this provider returns is the SDK's own
``OpenAIChatCompletionsModel`` over an ``AsyncOpenAI`` client pointed at the gateway;
at each call it reads the running activity's ``temporalio.activity.info()`` and adds

- ``x-session-id: <workflow id>``: the gateway keeps every call of one workflow on
  the engine that holds its prefix (all its agents, all its runs, across worker
  restarts, activity retries and continue-as-new, which keeps the id);
- ``x-session-kind: <kind>``: the gateway learns pause lengths per kind (default the
  workflow type: one agent workflow, one kind of pauses) for its hold decision.

to the request (``ModelSettings.extra_headers``, the SDK's supported per-request
headers), and turns on usage in streamed responses so ``cached_tokens`` comes back on
both paths. The engine's ``usage`` reaches the workflow unchanged:
``RunResult.raw_responses[i].usage.input_tokens_details.cached_tokens``.

Hazards:

- Only Chat Completions: the gateway serves ``/v1/chat/completions``, not the Responses
  API, so hosted tools (web/file search, code interpreter, computer use) and
  ``previous_response_id``/``conversation_id`` are not available; function tools,
  handoffs and ``activity_as_tool`` are.
- The engines must serve the model the agent names. Agents written for OpenAI name
  OpenAI models (``"gpt-4.1"``): map them (``model_map``) or leave ``Agent.model``
  unset (``default_model``). An unknown name is the gateway's 404 (``model_not_found``),
  which the plugin makes a non-retryable activity failure.
- ``tool_choice``: vLLM (``--enable-auto-tool-choice``, the hermes parser) supports
  ``"auto"``, ``"required"``, ``"none"`` and a named function. ``"required"`` and a
  named function are guided decoding: the call's form is forced, but a weak model can
  pad its JSON with whitespace until ``max_tokens`` cuts it, and the cut call comes
  back as text; leave it room, bound string arguments (an enum, a ``pattern``) and set
  ``parallel_tool_calls=False`` (else the grammar lets a second call start and be cut).
  ``"auto"`` is the parser reading free text. The SDK resets ``tool_choice`` after a
  tool call (``Agent.reset_tool_choice``), else ``"required"`` never ends a run.
- Explicit ``extra_headers`` in an agent's ``ModelSettings`` win over the provider's:
  a workflow may name its own session id (two workflows sharing one conversation) or
  mark its last call (``x-session-final: 1``: the gateway ends the session's hold at
  once). A session whose last call is not marked keeps its hold, which the gateway
  sizes from the kind's learned pauses (after a human review: hours), until that
  hold's TTL: KV held for nobody. Mark the last call where the workflow knows it.
- The session id is the bare workflow id: two namespaces using the same ids through one
  gateway share sessions (routing stays correct; pause statistics and holds mix). Pass
  ``session_id=lambda info: f"{info.namespace}/{info.workflow_id}"`` there.
- Outside an activity (the SDK used directly, without Temporal) and in a standalone
  activity (no workflow) no session header is sent: the gateway routes by prefix alone.
- Retries: the client makes none (``max_retries=0``); the model activity's retry policy
  decides, so a retried call is a new activity attempt with the same session.
- The SDK's tracing is the SDK's: with ``OPENAI_API_KEY`` set, its default exporter
  still sends each run's traces (prompts included) to OpenAI, gateway or not. Turn it
  off (``OPENAI_AGENTS_DISABLE_TRACING=1``) or point it elsewhere where that matters.
- A provider holds one HTTP connection pool; one provider per worker process, closed
  with ``aclose()`` (the plugin does not close it: it lives as long as the process).
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Callable, Mapping
from datetime import timedelta
from typing import Any

from agents import (
    AgentOutputSchemaBase,
    Handoff,
    Model,
    ModelProvider,
    ModelResponse,
    ModelSettings,
    ModelTracing,
    OpenAIChatCompletionsModel,
    Tool,
    TResponseInputItem,
)
from agents.items import TResponseStreamEvent
from openai import AsyncOpenAI
from openai.types.responses.response_prompt_param import ResponsePromptParam
from temporalio import activity
from temporalio.common import RetryPolicy
from temporalio.openai_agents import ModelActivityParameters, OpenAIAgentsPlugin

from warmloop.workers.settings import Settings

SESSION_ID_HEADER = "x-session-id"
"""The gateway's session id header: the workflow id."""
SESSION_KIND_HEADER = "x-session-kind"
"""The gateway's session kind header: what pause statistics the session feeds."""
SESSION_FINAL_HEADER = "x-session-final"
"""Set (to ``"1"``) on a session's last request: its hold ends at once."""

DEFAULT_API_KEY = "warmloop"
"""Sent when no key is given: ``AsyncOpenAI`` needs one, a gateway without keys ignores
it (not ``OPENAI_API_KEY``: an OpenAI key must not travel to another server)."""

DEFAULT_MODEL_TIMEOUT = timedelta(minutes=2)
"""One model call through the gateway, queueing for admission included."""

SessionId = Callable[[activity.Info], str | None]
"""The session id of a model call, from the running activity; None sends none."""


def workflow_session_id(info: activity.Info) -> str | None:
    """The default session id: the workflow id (None in a standalone activity)."""
    return info.workflow_id


def session_headers(session_id: SessionId = workflow_session_id,
                    session_kind: str | None = None) -> dict[str, str]:
    """The session headers of the model call running now: ``x-session-id`` from the
    activity (``session_id``), ``x-session-kind`` (``session_kind``, default the
    workflow type). Empty outside an activity."""
    if not activity.in_activity():
        return {}
    info = activity.info()
    headers: dict[str, str] = {}
    sid = session_id(info)
    if sid:
        headers[SESSION_ID_HEADER] = sid
    kind = session_kind or info.workflow_type
    if kind:
        headers[SESSION_KIND_HEADER] = kind
    return headers


class WarmloopChatModel(OpenAIChatCompletionsModel):
    """The SDK's Chat Completions model, with the gateway's session headers added to
    each call (read when the call is made, so a model object kept across activities
    still sends each call's own workflow id) and usage asked for in streams.

    ``headers`` is called once per model call, in the caller's context (inside the
    model activity); precedence, lowest first: ``headers()``, then the agent's
    ``ModelSettings.extra_headers``."""

    def __init__(self, model: str, openai_client: AsyncOpenAI,
                 headers: Callable[[], Mapping[str, str]]) -> None:
        super().__init__(model=model, openai_client=openai_client)
        self._headers = headers

    def _with_session(self, settings: ModelSettings) -> ModelSettings:
        extra = {**self._headers(), **(settings.extra_headers or {})}
        return dataclasses.replace(
            settings, extra_headers=extra or None,
            # Without stream_options.include_usage a non-OpenAI server sends no usage
            # in a stream, and cached_tokens would be lost on the streaming path.
            include_usage=True if settings.include_usage is None else settings.include_usage)

    async def get_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        previous_response_id: str | None = None,
        conversation_id: str | None = None,
        prompt: ResponsePromptParam | None = None,
    ) -> ModelResponse:
        return await super().get_response(
            system_instructions, input, self._with_session(model_settings), tools,
            output_schema, handoffs, tracing, previous_response_id=previous_response_id,
            conversation_id=conversation_id, prompt=prompt)

    def stream_response(
        self,
        system_instructions: str | None,
        input: str | list[TResponseInputItem],
        model_settings: ModelSettings,
        tools: list[Tool],
        output_schema: AgentOutputSchemaBase | None,
        handoffs: list[Handoff],
        tracing: ModelTracing,
        previous_response_id: str | None = None,
        conversation_id: str | None = None,
        prompt: ResponsePromptParam | None = None,
    ) -> AsyncIterator[TResponseStreamEvent]:
        return super().stream_response(
            system_instructions, input, self._with_session(model_settings), tools,
            output_schema, handoffs, tracing, previous_response_id=previous_response_id,
            conversation_id=conversation_id, prompt=prompt)


class WarmloopModelProvider(ModelProvider):
    """Models served through warmloop's gateway, each call tagged with its workflow's
    session (see the module docstring for what is sent and the hazards).

    ``base_url``: the gateway's OpenAI base URL (``http://127.0.0.1:8500/v1``).
    ``api_key``: the gateway's key, if it checks one. ``default_model``: the served
    model for agents that name none. ``model_map``: agent model names to served names
    (others pass unchanged). ``session_kind``: the kind for every session (default: each
    call's workflow type). ``session_id``: the session id from the activity's info
    (default: the workflow id). ``extra_headers``: sent with every call (the gateway's
    lane, ``{"x-warmloop-lane": "batch"}``, say), below the session headers.
    ``timeout``: one HTTP call; keep it under the model activity's start-to-close
    timeout. ``client``: a ready client instead (tests, a custom transport); then
    ``base_url``, ``api_key`` and ``timeout`` are its own.

    ``from_settings`` builds one for the gateway and engines that warmloop's settings
    describe."""

    def __init__(self, base_url: str | None = None, *, api_key: str | None = None,
                 default_model: str | None = None,
                 model_map: Mapping[str, str] | None = None,
                 session_kind: str | None = None,
                 session_id: SessionId = workflow_session_id,
                 extra_headers: Mapping[str, str] | None = None,
                 timeout: timedelta = DEFAULT_MODEL_TIMEOUT,
                 client: AsyncOpenAI | None = None) -> None:
        if client is None:
            if base_url is None:
                raise ValueError("WarmloopModelProvider needs the gateway's base_url "
                                 "(or a client)")
            client = AsyncOpenAI(base_url=base_url, api_key=api_key or DEFAULT_API_KEY,
                                 max_retries=0, timeout=timeout.total_seconds())
        self._client = client
        self._default_model = default_model
        self._model_map = dict(model_map or {})
        self._session_kind = session_kind
        self._session_id = session_id
        self._extra_headers = dict(extra_headers or {})

    @classmethod
    def from_settings(cls, settings: Settings | None = None, *, base_url: str | None = None,
                      default_model: str | None = None,
                      **options: Any) -> WarmloopModelProvider:
        """A provider for warmloop's gateway on this host (``settings.gateway_port``;
        ``base_url`` for one elsewhere) whose default model is the one every engine
        serves (none when the engines serve several: agents must then name theirs).
        ``settings``: read from the environment when None. ``options``: the other
        arguments of the constructor."""
        settings = settings or Settings()
        models = {e.model for e in settings.engine_endpoints}
        return cls(base_url or gateway_base_url(settings),
                   default_model=default_model or (models.pop() if len(models) == 1
                                                   else None),
                   **options)

    @property
    def client(self) -> AsyncOpenAI:
        """The client every model of this provider shares."""
        return self._client

    def served_model(self, model_name: str | None) -> str:
        """The served model name an agent's ``model_name`` is sent as."""
        if model_name:
            return self._model_map.get(model_name, model_name)
        if self._default_model is None:
            raise ValueError("the agent names no model and the provider has no "
                             "default_model")
        return self._default_model

    def headers(self) -> dict[str, str]:
        """The headers of the model call running now (in its activity)."""
        return {**self._extra_headers, **session_headers(self._session_id,
                                                         self._session_kind)}

    def get_model(self, model_name: str | None) -> Model:
        return WarmloopChatModel(self.served_model(model_name), self._client, self.headers)

    async def aclose(self) -> None:
        await self._client.close()


def gateway_base_url(settings: Settings) -> str:
    """The OpenAI base URL of the gateway the settings describe: ``gateway_url``, else
    the embedded stack's on this host."""
    base = settings.gateway_url or f"http://127.0.0.1:{settings.gateway_port}"
    return base.rstrip("/") + "/v1"


def default_model_params() -> ModelActivityParameters:
    """The model activity's options ``warmloop_agents_plugin`` uses by default: a
    start-to-close timeout 10 s over the HTTP timeout (``DEFAULT_MODEL_TIMEOUT``: the
    call gives up first, and the attempt fails with the client's error rather than a
    timeout) and five attempts (a 4xx other than 408/409/429 is not retried at all)."""
    return ModelActivityParameters(
        start_to_close_timeout=DEFAULT_MODEL_TIMEOUT + timedelta(seconds=10),
        retry_policy=RetryPolicy(maximum_attempts=5))


def warmloop_agents_plugin(settings: Settings | None = None, *,
                           provider: WarmloopModelProvider | None = None,
                           model_params: ModelActivityParameters | None = None,
                           **plugin_options: Any) -> OpenAIAgentsPlugin:
    """``OpenAIAgentsPlugin`` whose model activity calls warmloop's gateway: the one
    change an OpenAI-Agents-on-Temporal project makes. Give it to the client
    (``Client.connect(..., plugins=[...])``), whose workers then run the model activity.
    The plugin also sets the client's data converter to the SDK's and refuses a client
    that has another: warmloop's own ``connect`` (its converter and payload codec) is
    not the client for these workflows.

    ``provider``: default ``WarmloopModelProvider.from_settings(settings)`` (the gateway
    on this host, the engines' model as the default model; build one for a model map,
    a session kind, a lane, a gateway elsewhere). ``settings``: used only for that
    default. ``model_params``: the model activity's options (default
    ``default_model_params()``). ``plugin_options``: the rest of ``OpenAIAgentsPlugin``'s
    arguments (``mcp_servers``, ``register_activities`` ...).
    """
    return OpenAIAgentsPlugin(
        model_params=model_params or default_model_params(),
        model_provider=provider or WarmloopModelProvider.from_settings(settings),
        **plugin_options)


__all__ = [
    "SESSION_FINAL_HEADER", "SESSION_ID_HEADER", "SESSION_KIND_HEADER",
    "WarmloopChatModel", "WarmloopModelProvider", "default_model_params", "gateway_base_url",
    "session_headers", "warmloop_agents_plugin", "workflow_session_id",
]
