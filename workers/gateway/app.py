"""The gateway's HTTP face: an OpenAI-compatible API over ``Gateway`` (Starlette).

- ``POST /v1/chat/completions``, ``POST /v1/completions``: routed, relayed unchanged
  (streamed or not); the response carries ``x-warmloop-engine`` and
  ``x-warmloop-route`` (the route reason) headers.
- ``GET /v1/models``: the live engines' models. ``GET /health``. ``GET /metrics``:
  Prometheus text.

Errors are OpenAI's shape (``{"error": {"message", "type", "param", "code"}}``): 400 for
a body that is not JSON (or not a call), 404 for a model no engine serves, 413 for a
body over ``GatewayConfig.max_body_bytes``, 503 when no live engine may take the call,
502 when the engine failed it (a stream gets the error as its last event instead).

Hazard: the gateway checks no API key. Bind it to loopback (the default) or put it
behind a proxy that authenticates; the bearer key a client sends only scopes its
sessions and cache (``warmloop.workers.gateway.calls``).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import httpx
import redis.asyncio as aioredis
import structlog
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from warmloop.workers.gateway.calls import BadCall, Endpoint, parse_call
from warmloop.workers.gateway.config import GatewayConfig
from warmloop.workers.gateway.core import Flight, Gateway, QuotaRefused
from warmloop.workers.gateway.relay import EventRelay, error_event, error_object, read_body
from warmloop.workers.gateway.routing import NoEngineError
from warmloop.workers.settings import Settings

if TYPE_CHECKING:
    import uvicorn

log = structlog.get_logger(__name__)
ENGINE_HEADER = "x-warmloop-engine"
ROUTE_HEADER = "x-warmloop-route"


def create_gateway_app(settings: Settings, *, redis: aioredis.Redis | None = None,
                       http: httpx.AsyncClient | None = None,
                       config: GatewayConfig | None = None,
                       instance: str | None = None) -> Starlette:
    """The ASGI app. ``redis``/``http``: clients to use instead of building them from
    ``settings`` (tests); either way they are used from the app's event loop only.
    ``instance``: the gateway's name among its replicas (default ``host-pid``). The
    ``Gateway`` is ``app.state.gateway``; it starts and stops with the app's lifespan."""
    gateway = Gateway(settings, redis=redis, http=http, config=config or configured(settings),
                      instance=instance)
    keys = KeyCheck.of(settings.gateway_key_digests)

    @contextlib.asynccontextmanager
    async def lifespan(_: Starlette) -> AsyncIterator[None]:
        await gateway.start()
        try:
            yield
        finally:
            await gateway.stop()

    async def chat(request: Request) -> Response:
        return keys.refuse(request, gateway) or await _completion(gateway, "chat", request)

    async def completions(request: Request) -> Response:
        return keys.refuse(request, gateway) or await _completion(gateway, "completions",
                                                                 request)

    async def models(request: Request) -> Response:
        return keys.refuse(request, gateway) or JSONResponse(gateway.models())

    async def health(_: Request) -> Response:
        return JSONResponse(gateway.health())

    async def metrics(_: Request) -> Response:
        return PlainTextResponse(gateway.metrics_text(),
                                 media_type="text/plain; version=0.0.4; charset=utf-8")

    app = Starlette(routes=[
        Route("/v1/chat/completions", chat, methods=["POST"]),
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
    ], lifespan=lifespan)
    app.state.gateway = gateway
    return app


_ENDPOINTS = {"/v1/chat/completions": "chat", "/v1/completions": "completions",
              "/v1/models": "models"}


@dataclass(frozen=True)
class KeyCheck:
    """The API keys the gateway accepts, by SHA-256 digest (``Settings.
    gateway_key_digests``); none configured: every caller."""

    digests: tuple[bytes, ...] = ()

    @classmethod
    def of(cls, configured: str | None) -> KeyCheck:
        return cls(tuple(bytes.fromhex(d) for d in (configured or "").split(",") if d))

    def refuse(self, request: Request, gateway: Gateway) -> Response | None:
        """A 401 for a call without an accepted key; None to let it through. Every
        digest is compared in constant time, so timing tells nothing of which is near."""
        if not self.digests:
            return None
        scheme, _, key = (request.headers.get("authorization") or "").partition(" ")
        given = hashlib.sha256(key.strip().encode()).digest()
        ok = scheme.lower() == "bearer" and bool(key.strip())
        matched = False
        for d in self.digests:
            matched |= hmac.compare_digest(given, d)
        if ok and matched:
            return None
        gateway.metrics.inc("warmloop_gateway_requests_total",
                            endpoint=_ENDPOINTS.get(request.url.path, "other"), status="401")
        return error_response(401, "a valid API key is required (Authorization: Bearer "
                              "<key>)", kind="invalid_request_error", code="invalid_api_key")


def configured(settings: Settings) -> GatewayConfig:
    """The settings' ``gateway`` (``WARMLOOP_GATEWAY='{...}'``) once ``Settings`` has
    one, else the defaults."""
    given = getattr(settings, "gateway", None)
    return given if isinstance(given, GatewayConfig) else GatewayConfig()


def error_response(status: int, message: str, *, kind: str, param: str | None = None,
                   code: int | str | None = None) -> JSONResponse:
    return JSONResponse(error_object(message, kind=kind, param=param, code=code),
                        status_code=status)


async def _completion(gateway: Gateway, endpoint: Endpoint, request: Request) -> Response:
    arrived = time.perf_counter()
    raw = await _body(request, gateway.config.max_body_bytes)
    try:
        if raw is None:
            raise BadCall("request body too large", status=413)
        call = parse_call(endpoint, request.headers, raw,
                          key_tenants=gateway.settings.gateway_key_tenants)
    except BadCall as e:
        gateway.metrics.inc("warmloop_gateway_requests_total", endpoint=endpoint,
                            status=str(e.status))
        return _bad(e)
    session = gateway.open_session(call)
    try:
        flight = await gateway.send(call, session, arrived)
    except BadCall as e:
        gateway.close_unsent(session)
        gateway.metrics.inc("warmloop_gateway_requests_total", endpoint=endpoint,
                            status=str(e.status))
        return _bad(e)
    except NoEngineError as e:
        gateway.close_unsent(session)
        # the client is told; the operator too (an empty fleet view is worth knowing)
        log.warning("call_refused_no_engine", endpoint=endpoint, reason=str(e),
                    live=len(gateway.fleet.engines))
        gateway.metrics.inc("warmloop_gateway_requests_total", endpoint=endpoint, status="503")
        return error_response(503, f"{e}; retry later", kind="service_unavailable", code=503)
    except QuotaRefused as e:
        gateway.close_unsent(session)
        gateway.metrics.inc("warmloop_gateway_requests_total", endpoint=endpoint, status="429")
        refused = error_response(429, str(e), kind="rate_limit_error",
                                 code="tenant_quota_exceeded")
        refused.headers["retry-after"] = str(math.ceil(e.retry_after_s))
        return refused
    except BaseException:
        gateway.close_unsent(session)
        raise
    if call.stream and flight.upstream.status_code == 200:
        return RelayResponse(_relay(gateway, flight),
                             on_close=lambda: gateway.finish(flight, ok=False, outcome=None),
                             media_type="text/event-stream", headers=_route_headers(flight))
    return await _answer(gateway, flight)


async def _body(request: Request, limit: int) -> bytes | None:
    """The request body, or None past ``limit`` bytes (read no further)."""
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            return None
        chunks.append(chunk)
    return b"".join(chunks)


def _bad(e: BadCall) -> JSONResponse:
    kind = "invalid_request_error"
    return error_response(e.status, str(e), kind=kind, param=e.param, code=e.code)


def _route_headers(flight: Flight) -> dict[str, str]:
    return {ENGINE_HEADER: flight.engine.engine_id, ROUTE_HEADER: flight.decision.reason}


async def _answer(gateway: Gateway, flight: Flight) -> Response:
    """A whole answer: the engine's bytes and status, unchanged (its errors too)."""
    try:
        content = await flight.upstream.aread()
    except httpx.HTTPError as e:
        await gateway.finish(flight, ok=False, outcome=None, died=e)
        return error_response(
            502, f"engine {flight.engine.engine_id} failed before its answer was complete "
            f"({type(e).__name__}); the call may be retried", kind="engine_error", code=502)
    except BaseException:
        with anyio.CancelScope(shield=True):
            await gateway.finish(flight, ok=False, outcome=None)
        raise
    ok = flight.upstream.status_code == 200
    await gateway.finish(flight, ok=ok, outcome=read_body(content) if ok else None)
    return Response(content, status_code=flight.upstream.status_code,
                    media_type=flight.upstream.headers.get("content-type", "application/json"),
                    headers=_route_headers(flight))


async def _relay(gateway: Gateway, flight: Flight) -> AsyncIterator[bytes]:
    """The engine's events as they come, whole; a clean error event if it dies."""
    relay = EventRelay(drop_usage_event=flight.call.hidden_usage)
    completed, died = False, None
    try:
        try:
            async for data in flight.upstream.aiter_raw():
                if flight.first_byte_at is None:
                    flight.first_byte_at = time.perf_counter()
                ready = relay.take(data)
                if ready:
                    yield ready
            rest = relay.flush()
            if rest:
                yield rest
            completed = True
        except httpx.HTTPError as e:
            died = e
            yield error_event(
                f"engine {flight.engine.engine_id} failed mid-stream ({type(e).__name__}); "
                "the response is incomplete, retry the call")
    finally:
        with anyio.CancelScope(shield=True):
            await gateway.finish(flight, ok=completed, outcome=relay.outcome, died=died)


class RelayResponse(StreamingResponse):
    """A streamed answer whose ``on_close`` runs however the response ends: a stream
    the client left before it began never runs its generator's ``finally``, and the
    engine's connection and the call's bookkeeping must be let go all the same."""

    def __init__(self, content: AsyncIterator[bytes], *,
                 on_close: Callable[[], Awaitable[None]], **kwargs: Any) -> None:
        super().__init__(content, **kwargs)
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._on_close()


def server_config(settings: Settings, *, host: str = "127.0.0.1", port: int | None = None,
                  config: GatewayConfig | None = None) -> uvicorn.Config:
    """uvicorn's settings for the gateway app (``serve``)."""
    import uvicorn

    config = config or configured(settings)
    return uvicorn.Config(create_gateway_app(settings, config=config), host=host,
                          port=port or settings.gateway_port, log_level="warning",
                          server_header=False, access_log=False,
                          timeout_keep_alive=config.keep_alive_s)


def serve(settings: Settings, *, host: str = "127.0.0.1", port: int | None = None,
          config: GatewayConfig | None = None) -> None:
    """Serve the gateway with uvicorn until interrupted (``warmloop gateway``)."""
    import uvicorn

    uvicorn.Server(server_config(settings, host=host, port=port, config=config)).run()
