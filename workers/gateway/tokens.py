"""A call's prompt token ids, computed in the gateway's own process when it can.

The gateway learns each served prompt's block chain after the call (``Gateway._learn``).
Asking the engine that served it (``POST /tokenize``) costs an HTTP round trip and the
engine's own CPU (its API server renders and tokenizes in the loop that also admits
calls). Where the model's directory is on this host (the embedded stack's engines, or
``GatewayConfig.tokenizer_paths``), the gateway renders the chat template and
tokenizes itself instead: the ``tokenizers`` library and ``jinja2`` (no
``transformers``: its import takes seconds of CPU), the way vLLM does it (its message
and tool normalisation, Hugging Face's template environment).

Hazard: a rendering that differs from the engine's by one token learns a chain that
matches nothing cached, silently. So local ids are trusted only once they agreed with
the engine's: each distinct rendering context (model, tools, template, and the shapes
of the messages: roles, fields, content types) is checked once against ``/tokenize``
(that call learns the engine's ids), and a context that disagreed stays with the
engine. A model without a local directory, a template this renderer cannot run, or
content it does not normalise (parts lists, images) goes to the engine as before.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import structlog

from warmloop.workflows.prompt import canonical_json

log = structlog.get_logger(__name__)

MAX_CONTEXTS = 10_000
"""Rendering contexts remembered as checked (all forgotten, to be checked again, past)."""


class LocalTokenizer:
    """One model directory's tokenizer and chat template, as vLLM applies them."""

    def __init__(self, path: Path) -> None:
        from tokenizers import Tokenizer

        self.path = path
        self._tok = Tokenizer.from_file(str(path / "tokenizer.json"))
        config = _json(path / "tokenizer_config.json")
        self._special = {k: _token_text(config.get(k)) for k in (
            "bos_token", "eos_token", "unk_token", "pad_token")}
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t.get("template") for t in template
                             if isinstance(t, dict) and t.get("name") == "default"), None)
        jinja_file = path / "chat_template.jinja"
        if jinja_file.exists():
            template = jinja_file.read_text()
        self._template_source: str | None = template if isinstance(template, str) else None
        self._compiled: dict[str, Any] = {}

    def chat_ids(self, payload: dict[str, Any]) -> list[int] | None:
        """The ids of a chat ``/tokenize`` payload (``Call.tokenize_payload``), or None
        when this renderer does not handle it (the engine does)."""
        source = payload.get("chat_template") or self._template_source
        messages = vllm_messages(payload.get("messages"))
        if not isinstance(source, str) or messages is None:
            return None
        tools = vllm_tools(payload.get("tools"))
        kwargs = payload.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            return None
        text = self._template(source).render(
            messages=messages, tools=tools, documents=None,
            add_generation_prompt=payload.get("add_generation_prompt", True),
            continue_final_message=payload.get("continue_final_message", False),
            **{k: v for k, v in self._special.items() if v is not None}, **kwargs)
        return self.text_ids(text, add_special_tokens=bool(payload.get("add_special_tokens",
                                                                       False)))

    def text_ids(self, text: str, *, add_special_tokens: bool) -> list[int]:
        # encode_batch lets go of the GIL while it works: the event loop runs meanwhile
        return list(self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids)

    def _template(self, source: str) -> Any:
        t = self._compiled.get(source)
        if t is None:
            if len(self._compiled) > 16:
                self._compiled.clear()
            t = self._compiled[source] = hf_template(source)
        return t


class Tokenizers:
    """Local tokenizers by model (``paths``), each context checked against the engine
    once (see the module doc); the engine's ``/tokenize`` otherwise."""

    def __init__(self, paths: dict[str, Path], *,
                 count: Callable[[str], None] = lambda where: None) -> None:
        self._paths = {m: p for m, p in paths.items() if (p / "tokenizer.json").exists()}
        self._count = count
        self._loaded: dict[str, LocalTokenizer | None] = {}
        self._checked: dict[str, bool] = {}
        """Rendering context -> whether local ids agreed with the engine's there."""
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="gw-tokenize")

    @property
    def models(self) -> list[str]:
        return sorted(self._paths)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def trusted(self, model: str | None, payload: dict[str, Any] | None) -> bool:
        """Whether ``payload`` would be tokenized here (its context agreed before)."""
        if payload is None or self._model(model) is None:
            return False
        ctx = context_key(payload)
        return ctx is not None and bool(self._checked.get(ctx))

    def _model(self, model: str | None) -> str | None:
        if model is None and len(self._paths) == 1:
            return next(iter(self._paths))
        return model if model in self._paths else None

    async def ids(self, model: str | None, payload: dict[str, Any] | None,
                  engine: Callable[[dict[str, Any]], Awaitable[list[int]]]) -> list[int]:
        """The prompt ids of ``payload`` (a ``/tokenize`` request): local once its
        context agreed with the engine, else (or to check) ``engine(payload)``."""
        if payload is None:
            raise ValueError("nothing to tokenize")
        ctx = context_key(payload)
        checked = self._checked.get(ctx) if ctx is not None else False
        if checked:
            local = await self._local(model, payload)
            if local is not None:
                self._count("local")
                return local
        self._count("engine")
        ids = await engine(payload)
        if checked is None and ctx is not None:
            local = await self._local(model, payload)
            if local is not None:
                agreed = local == ids
                if len(self._checked) >= MAX_CONTEXTS:
                    self._checked.clear()
                self._checked[ctx] = agreed
                if not agreed:
                    self._count("mismatch")
                    log.warning("local_tokenizer_disagrees", model=model, local=len(local),
                                engine=len(ids), first_difference=_first_difference(local, ids))
        return ids

    async def _local(self, model: str | None, payload: dict[str, Any]) -> list[int] | None:
        tok = await self._tokenizer(model)
        if tok is None:
            return None
        try:
            return await asyncio.get_running_loop().run_in_executor(
                self._pool, self._render, tok, payload)
        except Exception as e:  # noqa: BLE001 - a template this renderer cannot run
            log.info("local_tokenize_failed", model=model, error=repr(e)[:200])
            return None

    @staticmethod
    def _render(tok: LocalTokenizer, payload: dict[str, Any]) -> list[int] | None:
        if "messages" in payload:
            return tok.chat_ids(payload)
        prompt = payload.get("prompt")
        if not isinstance(prompt, str):
            return None
        return tok.text_ids(prompt, add_special_tokens=bool(payload.get("add_special_tokens",
                                                                        True)))

    async def _tokenizer(self, model: str | None) -> LocalTokenizer | None:
        model = self._model(model)
        if model is None:
            return None
        if model not in self._loaded:
            path = self._paths[model]
            try:
                self._loaded[model] = await asyncio.get_running_loop().run_in_executor(
                    self._pool, LocalTokenizer, path)
            except Exception as e:  # noqa: BLE001 - no local tokenizer: the engine's
                log.warning("local_tokenizer_unavailable", model=model, path=str(path),
                            error=repr(e)[:200])
                self._loaded[model] = None
        return self._loaded[model]


def context_key(payload: dict[str, Any]) -> str | None:
    """What a rendering depends on besides the messages' text: the model, tools,
    template and its options, and each message's shape. None: not renderable here."""
    messages = payload.get("messages")
    if messages is None:
        return canonical_json(["text", payload.get("model"),
                               payload.get("add_special_tokens", True)])
    if not isinstance(messages, list):
        return None
    shapes = sorted({canonical_json([m.get("role"), sorted(m), type(m.get("content")).__name__,
                                     bool(m.get("tool_calls"))])
                     for m in messages if isinstance(m, dict)})
    rest = {k: v for k, v in payload.items() if k != "messages"}
    return hashlib.blake2b(canonical_json([rest, shapes]).encode(),
                           digest_size=16).hexdigest()


def vllm_messages(messages: Any) -> list[dict[str, Any]] | None:
    """The messages as vLLM hands them to a string-content chat template (its
    ``parse_chat_messages`` and ``_postprocess_messages``), or None for content it
    would render otherwise (parts lists, images, reasoning)."""
    if not isinstance(messages, list):
        return None
    out: list[dict[str, Any]] = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            return None
        content = m.get("content")
        if content is not None and not isinstance(content, str):
            return None
        if m["role"] == "developer" or "reasoning" in m:
            return None
        msg: dict[str, Any] = {"role": m["role"], "content": content or ""}
        if m["role"] == "assistant" and m.get("tool_calls") is not None:
            calls = m["tool_calls"]
            if not isinstance(calls, list):
                return None
            if calls:
                msg["tool_calls"] = [_tool_call(c) for c in calls]
                if any(c is None for c in msg["tool_calls"]):
                    return None
        elif m["role"] == "tool" and "tool_call_id" in m:
            msg["tool_call_id"] = m["tool_call_id"]
        if isinstance(m.get("name"), str):
            msg["name"] = m["name"]
        out.append(msg)
    return out


def _tool_call(c: Any) -> dict[str, Any] | None:
    if not isinstance(c, dict) or not isinstance(c.get("function"), dict):
        return None
    fn = dict(c["function"])
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            fn["arguments"] = json.loads(args)
        except ValueError:
            return None
    return {**c, "function": fn}


def vllm_tools(tools: Any) -> list[dict[str, Any]] | None:
    """The tools as vLLM's ``ChatCompletionToolsParam.model_dump()`` gives them to the
    template: declared fields only, in their order; a function's unset description and
    parameters as null, ``strict`` and ``defer_loading`` only when set."""
    if tools is None:
        return None
    out = []
    for t in tools:
        f = t["function"]
        fn = {"name": f["name"], "description": f.get("description"),
              "parameters": f.get("parameters")}
        defer = f.get("defer_loading")
        if defer is None:
            defer = t.get("defer_loading")
        if f.get("strict") is not None:
            fn["strict"] = f["strict"]
        if defer is not None:
            fn["defer_loading"] = defer
        tool: dict[str, Any] = {"type": t.get("type", "function"), "function": fn}
        if t.get("defer_loading") is not None:
            tool["defer_loading"] = t["defer_loading"]
        out.append(tool)
    return out


def hf_template(source: str) -> Any:
    """A chat template compiled as Hugging Face's ``apply_chat_template`` compiles it
    (its sandbox, whitespace options, ``tojson`` and globals)."""
    from datetime import datetime

    import jinja2
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None,
               separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt: str) -> str:
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(source)


def model_dirs(settings: Any) -> dict[str, Path]:
    """The model directories the settings' embedded engines serve, by served model name
    (empty where the settings start no engines: their tokenizers may not be here)."""
    if not getattr(settings, "manages_engines", False):
        return {}
    out: dict[str, Path] = {}
    for e in settings.engine_endpoints:
        try:
            out.setdefault(e.model, Path(settings.engine_model_path(e)))
        except (AttributeError, ValueError, OSError):
            continue
    return out


def _json(path: Path) -> dict[str, Any]:
    try:
        got = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return got if isinstance(got, dict) else {}


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):
        v = v.get("content")
    return v if isinstance(v, str) else None


def _first_difference(a: list[int], b: list[int]) -> int:
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y),
                min(len(a), len(b)))
