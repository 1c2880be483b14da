"""A Temporal remote codec server: lets the Temporal Web UI and CLI show encrypted
payloads (``warmloop.workers.codec.EncryptionCodec``) to authorised users.

Protocol (Temporal's "Codec Server Protocol"): ``POST <anything>/encode`` and ``POST
<anything>/decode`` with a ``Payloads`` message as protobuf JSON, ``{"payloads":
[{"metadata": {"encoding": "<base64>", ...}, "data": "<base64>"}]}``, answered with
the same shape; only the last path segment is looked at, so the app can be mounted
under a prefix or serve ``/<namespace>/decode``. The Web UI calls it from the browser,
with ``X-Namespace`` and (when "pass access token" is on) ``Authorization`` headers and
credentials, so it needs CORS for the UI's origin, preflight included.

Hazard: this endpoint decrypts anything encrypted with the key for whoever it
authorises: it is exactly as strong as ``authorize``. Serve it over HTTPS; a 401 is
answered before the body is read.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from google.protobuf import json_format
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.middleware import Middleware
from starlette.middleware.cors import CORSMiddleware
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from temporalio.api.common.v1 import Payload, Payloads
from temporalio.converter import PayloadCodec

CODEC_CORS_HEADERS = ["Authorization", "Content-Type", "X-Namespace"]
"""Request headers the Web UI and CLI send to a codec server."""
MAX_BODY_BYTES = 64 * 1024 * 1024
"""Largest request body read: a whole history's payloads, well above Temporal's limits."""


def codec_app(codec: PayloadCodec, *, authorize: Callable[[str | None], bool],
              allowed_origins: list[str]) -> Starlette:
    """The codec server for ``codec``.

    ``authorize`` gets the request's ``Authorization`` header (None when absent) and
    returns whether the caller may encode and decode; False is a 401. It runs in a
    worker thread, so it may block (fetching a JWKS, reading a token file).
    ``allowed_origins`` are the browser origins allowed to call it, e.g. the Temporal
    Web UI's ``http://127.0.0.1:8233``; credentials are allowed, so no ``*``.
    """
    if "*" in allowed_origins:
        raise ValueError("codec_app: allowed_origins cannot be '*' with credentials; name "
                         "the Temporal Web UI's origin")

    operations: dict[str, Callable[[Sequence[Payload]], Awaitable[list[Payload]]]] = {
        "encode": codec.encode, "decode": codec.decode}

    async def apply(request: Request) -> Response:
        operation = operations.get(request.url.path.rstrip("/").rsplit("/", 1)[-1])
        if operation is None:
            return JSONResponse({"error": "not found: POST .../encode or .../decode"},
                                status_code=404)
        if not await run_in_threadpool(authorize, request.headers.get("authorization")):
            return JSONResponse({"error": "not authorised"}, status_code=401,
                                headers={"WWW-Authenticate": "Bearer"})
        content_type = request.headers.get("content-type", "").split(";")[0].strip().lower()
        if content_type != "application/json":
            # Also keeps cross-site "simple" POSTs (forms, text/plain) out: a JSON body
            # from another origin needs a CORS preflight, which only allowed origins pass.
            return JSONResponse({"error": "expected Content-Type: application/json"},
                                status_code=415)
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > MAX_BODY_BYTES:
            return JSONResponse({"error": "request body too large"}, status_code=413)
        body = await request.body()
        if len(body) > MAX_BODY_BYTES:
            return JSONResponse({"error": "request body too large"}, status_code=413)
        try:
            payloads = json_format.Parse(body, Payloads())
        except (json_format.ParseError, UnicodeDecodeError) as e:
            return JSONResponse({"error": f"invalid Payloads JSON: {e}"}, status_code=400)
        try:
            result = await operation(payloads.payloads)
        except ValueError as e:  # e.g. PayloadDecryptionError: wrong key, tampered
            return JSONResponse({"error": str(e)}, status_code=400)
        return Response(json_format.MessageToJson(Payloads(payloads=result)),
                        media_type="application/json")

    return Starlette(
        routes=[Route("/{path:path}", apply, methods=["POST"])],
        middleware=[Middleware(
            CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["POST"],
            allow_headers=CODEC_CORS_HEADERS, allow_credentials=True, max_age=600)],
    )
