"""What one client call asks of the gateway: read from its headers and its JSON body.

Headers (all optional):

- session id: ``x-session-id``, or the names llm-d and Dynamo accept, ``session-id``,
  ``x-session-affinity``, ``X-Dynamo-Session-ID`` (first one present wins). A session's
  calls stay on the engine that holds its prefix, its pauses are learned and its prefix
  may be held between calls. Without one, a call is routed by its prompt's prefix alone.
- ``x-session-kind``: what pause statistics the session feeds (default: one kind per
  API key, else ``default``).
- ``x-session-final`` / ``X-Dynamo-Session-Final``: ``true`` (or ``1``/``yes``) on the
  session's last call: its hold ends at once and the session is forgotten.
- ``x-warmloop-lane``: ``interactive`` (default) or ``batch``. Sets the engine request's
  vLLM ``priority`` (``warmloop.workflows.lanes.VLLM_PRIORITY``, overriding the body's)
  and sends batch calls through the engine's batch admission.

Hazard: session ids and kinds come from clients. Both are scoped by the caller's API key
(a digest of it, never the key), so one client cannot end or hijack another's session;
an id too long or a kind with odd characters is replaced by its digest (they end up in
Redis keys). The client's ``cache_salt`` is not sent as is either (see ``gateway_salt``).

A tenant's stream that does not ask for its usage (``stream_options.include_usage``) is
sent to the engine asking for it, and the usage event is taken out of what the client
gets (``Call.hidden_usage``): the tenant's hour counts every call's tokens.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

from warmloop.workflows.contracts import Lane
from warmloop.workflows.lanes import VLLM_PRIORITY
from warmloop.workflows.prompt import canonical_json
from warmloop.workflows.tenants import cache_salt

Endpoint = Literal["chat", "completions"]

SESSION_HEADERS = ("x-session-id", "session-id", "x-session-affinity", "x-dynamo-session-id")
FINAL_HEADERS = ("x-session-final", "x-dynamo-session-final")
KIND_HEADER = "x-session-kind"
LANE_HEADER = "x-warmloop-lane"
TRUE_VALUES = frozenset({"1", "true", "yes", "on"})
MAX_SESSION_ID = 200
"""Longer session ids are replaced by their digest (they name Redis keys and fields)."""
_KIND = re.compile(r"^[A-Za-z0-9_.:@-]{1,64}$")
TEXT_CHUNK_CHARS = 1024
"""A text prompt's prefix keys fall every this many characters."""
_SALT_CONTEXT = b"warmloop-gateway-salt-v1\x00"


class BadCall(ValueError):
    """The call cannot be served as sent: an OpenAI-style error for the client."""

    def __init__(self, message: str, *, status: int = 400, param: str | None = None,
                 code: str | None = None) -> None:
        super().__init__(message)
        self.status, self.param, self.code = status, param, code


@dataclass(frozen=True)
class Call:
    """One client call, parsed. ``session`` is the scoped session key (None: none)."""

    endpoint: Endpoint
    body: dict[str, Any]
    raw: bytes
    model: str | None
    stream: bool
    session: str | None
    kind: str
    lane: Lane
    lane_given: bool
    final: bool
    salt: str | None
    """The ``cache_salt`` the engine request carries (``gateway_salt``)."""
    prefix_keys: list[str] = field(default_factory=list, compare=False)
    """Keys of the call's prompt prefixes, shortest first (``chat_prefix_keys``,
    ``text_prefix_keys``): the gateway's index of learned chains is keyed by them."""
    tenant: str | None = None
    """The tenant whose key made the call (``Settings.gateway_key_tenants``); None: a
    key that is no tenant's, or none."""
    hidden_usage: bool = False
    """A tenant's stream that did not ask for its usage: the engine is asked for it
    (its tokens go onto the tenant's hour) and the relay drops that one event, so the
    client gets the stream it asked for (``EventRelay(drop_usage_event=True)``)."""

    @property
    def path(self) -> str:
        return "/v1/chat/completions" if self.endpoint == "chat" else "/v1/completions"

    def upstream_body(self) -> bytes:
        """What the engine is sent: the client's bytes, unless the lane or the salt
        changes the body (then the parsed body, re-serialised)."""
        extra: dict[str, Any] = {}
        if self.lane_given:
            extra["priority"] = VLLM_PRIORITY[self.lane]
        if self.salt != self.body.get("cache_salt"):
            extra["cache_salt"] = self.salt
        if self.hidden_usage:
            extra["stream_options"] = _asking_usage(self.body.get("stream_options"))
        if not extra:
            return self.raw
        body = {**self.body, **extra}
        if body.get("cache_salt") is None:
            body.pop("cache_salt", None)
        return json.dumps(body, ensure_ascii=False).encode()

    def prompt_ids(self) -> list[int] | None:
        """The prompt's token ids when the client sent ids (completions), else None."""
        prompt = self.body.get("prompt") if self.endpoint == "completions" else None
        if isinstance(prompt, list) and prompt and all(_is_token(t) for t in prompt):
            return prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], list) \
                and all(_is_token(t) for t in prompt[0]):
            return list(prompt[0])  # a batch of prompts: routed by its first
        return None

    def tokenize_payload(self) -> dict[str, Any] | None:
        """The engine's ``/tokenize`` request that gives this call's prompt ids exactly
        (the chat template applied as the completion applies it); None for ids."""
        b = self.body
        if self.endpoint == "chat":
            keep = ("messages", "tools", "add_generation_prompt", "continue_final_message",
                    "chat_template", "chat_template_kwargs", "add_special_tokens")
            payload = {k: b[k] for k in keep if k in b}
        else:
            text = _text_prompt(b.get("prompt"))
            if text is None:
                return None
            payload = {"prompt": text, "add_special_tokens": b.get("add_special_tokens", True)}
        if self.model is not None:
            payload["model"] = self.model
        return payload


def parse_call(endpoint: Endpoint, headers: Mapping[str, str], raw: bytes, *,
               key_tenants: Mapping[str, str] | None = None) -> Call:
    """The call, or ``BadCall`` (400) for a body the gateway cannot route.
    ``key_tenants``: API key digests that are tenants' (their calls are the tenant's)."""
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        raise BadCall("the request body is not valid JSON") from None
    if not isinstance(body, dict):
        raise BadCall("the request body must be a JSON object")
    model = body.get("model")
    if model is not None and not isinstance(model, str):
        raise BadCall("model must be a string", param="model")
    stream = body.get("stream", False)
    if not isinstance(stream, bool):
        raise BadCall("stream must be a boolean", param="stream")
    h = {k.lower(): v for k, v in headers.items()}
    scope = api_key_scope(h.get("authorization"))
    lane, lane_given = _lane(h.get(LANE_HEADER))
    tenant = (key_tenants or {}).get(api_key_digest(h.get("authorization")) or "")
    if tenant is not None and body.get("cache_salt") is None:
        salt = cache_salt(tenant)  # the tenant's jobs' own: their cache, no one else's
    else:
        salt = gateway_salt(scope, body.get("cache_salt"))
    keys = _prefix_keys(endpoint, body, salt)
    options = body.get("stream_options")
    if options is not None and not isinstance(options, dict):
        raise BadCall("stream_options must be an object", param="stream_options")
    return Call(endpoint=endpoint, body=body, raw=raw, model=model, stream=stream,
                session=_session(h, scope), kind=_kind(h.get(KIND_HEADER), scope),
                lane=lane, lane_given=lane_given,
                final=any(h.get(n, "").strip().lower() in TRUE_VALUES for n in FINAL_HEADERS),
                salt=salt, prefix_keys=keys, tenant=tenant,
                hidden_usage=(tenant is not None and stream
                              and (options or {}).get("include_usage") is not True))


def _asking_usage(options: dict[str, Any] | None) -> dict[str, Any]:
    """The client's ``stream_options`` asking for the usage event at the end: only that
    one event (vLLM's per-chunk usage, ``continuous_usage_stats``, comes only with
    ``include_usage``, so a client that asked for it without it got none, and gets none)."""
    out = {**(options or {}), "include_usage": True}
    if out.get("continuous_usage_stats"):
        out["continuous_usage_stats"] = False
    return out


def api_key_digest(authorization: str | None) -> str | None:
    """The SHA-256 hex digest of the caller's bearer key (None without one): how the
    settings name keys."""
    scheme, _, key = (authorization or "").partition(" ")
    if scheme.lower() != "bearer" or not key.strip():
        return None
    return hashlib.sha256(key.strip().encode()).hexdigest()


def api_key_scope(authorization: str | None) -> str | None:
    """A short digest of the caller's bearer key (None without one): what scopes its
    sessions, kinds and cache. The key itself is never kept."""
    digest = api_key_digest(authorization)
    return None if digest is None else digest[:12]


def gateway_salt(scope: str | None, client_salt: Any) -> str | None:
    """The ``cache_salt`` the engine request carries.

    Hazard: vLLM serves a prefix from cache only to requests with the same salt, and
    ``cached_tokens`` tells the client whether it was. A client that could send any
    salt could send a tenant's (``warmloop.workflows.tenants.cache_salt`` is a plain
    digest of the tenant's name) and probe that tenant's prompts. So the gateway salts
    each request itself, from the caller's API key and its own salt, in a namespace
    tenants' salts are not in. No key and no salt: none (the engines' shared cache,
    as for warmloop's default tenant)."""
    if scope is None and not client_salt:
        return None
    given = client_salt if isinstance(client_salt, str) else canonical_json(client_salt)
    return hashlib.sha256(_SALT_CONTEXT + f"{scope or ''}\x00{given or ''}".encode()).hexdigest()


def _lane(value: str | None) -> tuple[Lane, bool]:
    if value is None or not value.strip():
        return Lane.INTERACTIVE, False
    try:
        return Lane(value.strip().lower()), True
    except ValueError:
        raise BadCall(f"{LANE_HEADER} must be interactive or batch, not {value[:40]!r}",
                      param=LANE_HEADER) from None


def _session(h: Mapping[str, str], scope: str | None) -> str | None:
    sid = next((h[n].strip() for n in SESSION_HEADERS if h.get(n, "").strip()), None)
    if sid is None:
        return None
    if len(sid) > MAX_SESSION_ID or any(ord(c) < 32 for c in sid):
        sid = "sha-" + hashlib.sha256(sid.encode()).hexdigest()[:32]
    return sid if scope is None else f"{scope}/{sid}"


def _kind(value: str | None, scope: str | None) -> str:
    kind = (value or "").strip()
    if not kind:
        return "default" if scope is None else f"key-{scope}"
    if not _KIND.match(kind):
        kind = "k-" + hashlib.sha256(kind.encode()).hexdigest()[:16]
    return kind if scope is None else f"{scope}/{kind}"


def _prefix_keys(endpoint: Endpoint, body: dict[str, Any], salt: str | None) -> list[str]:
    if endpoint == "chat":
        messages = body.get("messages")
        if not isinstance(messages, list) or not messages \
                or not all(isinstance(m, dict) for m in messages):
            raise BadCall("messages must be a non-empty list of message objects",
                          param="messages")
        return chat_prefix_keys(body, salt)
    prompt = body.get("prompt")
    if _text_prompt(prompt) is None and not _token_prompt(prompt):
        raise BadCall("prompt must be a string, a list of token ids, or a list of either",
                      param="prompt")
    text = _text_prompt(prompt)
    return [] if text is None else text_prefix_keys(text, body.get("model"), salt)


def chat_prefix_keys(body: dict[str, Any], salt: str | None) -> list[str]:
    """One key per message: key i names the prompt's first i+1 messages (with the model,
    tools, template and salt, which change how they are tokenized)."""
    h = hashlib.blake2b(canonical_json([
        body.get("model"), body.get("tools"), body.get("chat_template"),
        body.get("chat_template_kwargs"), salt]).encode(), digest_size=16)
    keys = []
    for m in body["messages"]:
        h.update(b"\x1e" + canonical_json(m).encode())
        keys.append(h.copy().hexdigest())
    return keys


def text_prefix_keys(text: str, model: Any, salt: str | None) -> list[str]:
    """One key per whole ``TEXT_CHUNK_CHARS`` of a text prompt, and one for all of it."""
    h = hashlib.blake2b(canonical_json([model, salt]).encode(), digest_size=16)
    keys = []
    whole = len(text) // TEXT_CHUNK_CHARS
    for i in range(whole):
        h.update(text[i * TEXT_CHUNK_CHARS:(i + 1) * TEXT_CHUNK_CHARS].encode())
        keys.append(h.copy().hexdigest())
    if len(text) % TEXT_CHUNK_CHARS:
        h.update(text[whole * TEXT_CHUNK_CHARS:].encode())
        keys.append(h.hexdigest())
    return keys


def _text_prompt(prompt: Any) -> str | None:
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str) \
            and all(isinstance(p, str) for p in prompt):
        return prompt[0]  # a batch of prompts: routed by its first
    return None


def _token_prompt(prompt: Any) -> bool:
    if not isinstance(prompt, list) or not prompt:
        return False
    rows = prompt if isinstance(prompt[0], list) else [prompt]
    return all(isinstance(r, list) and all(_is_token(t) for t in r) for r in rows)


def _is_token(t: Any) -> bool:
    return isinstance(t, int) and not isinstance(t, bool) and t >= 0
