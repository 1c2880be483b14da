"""``warmloop gateway``: an OpenAI-compatible endpoint in front of the engine registry,
for agents that run their own loop (the OpenAI Agents SDK, LangGraph, plain clients).

Each call is routed by the workflows' own policy (``warmloop.workflows.routing``: the
prefix directory and the engines' load, sticky to the session's engine), its answer
relayed unchanged, and between a session's calls its pause is learned and its prefix
held warm by the inference workers' hold code (``warmloop.activities.holds``). Headers:
``warmloop.workers.gateway.calls``; endpoints and errors: ``warmloop.workers.gateway.app``
(``create_gateway_app``, ``serve``); the steps of a call: ``warmloop.workers.gateway.core``;
knobs: ``warmloop.workers.gateway.config.GatewayConfig``.

Nothing is imported here, so that ``warmloop.workers.settings`` can import
``GatewayConfig`` (``Settings.gateway``) without importing the gateway's app, which
imports the settings.
"""
