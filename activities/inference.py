"""The vLLM client: one ``generate`` activity served by the worker beside each engine."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import structlog
from temporalio import activity
from temporalio.exceptions import ApplicationError

from activities.transcripts import TranscriptStore
from workflows.contracts import FunctionCall, GenerateRequest, GenerateResult, ToolCall
from workflows.profiles import get_profile
from workflows.prompt import assemble_prompt

log = structlog.get_logger(__name__)

# Error types the workflow acts on; they are never retried by Temporal.
CONTEXT_OVERFLOW = "ContextOverflow"
ENGINE_REJECTED = "EngineRejected"


class InferenceActivities:
    """Talks to one engine through its OpenAI-compatible API.

    Assembles the step's prompt from the profile (stable prefix), the task, the stored
    transcript and the budget tail; streams the response so TTFT is measured; asks for
    the usage chunk so the engine's own ``cached_tokens`` comes back with every step.
    """

    def __init__(self, *, engine_id: str, base_url: str, model: str,
                 http: httpx.AsyncClient, transcripts: TranscriptStore) -> None:
        self._engine_id = engine_id
        self._url = base_url.rstrip("/") + "/v1/chat/completions"
        self._model = model
        self._http = http
        self._transcripts = transcripts

    async def _body(self, req: GenerateRequest) -> dict[str, Any]:
        profile = get_profile(req.profile)
        transcript = await self._transcripts.extend(req.job_id, req.base_len, req.new_messages)
        messages = assemble_prompt(profile, profile.validate_task(req.task), transcript,
                                   tail=req.tail)
        return {
            "model": self._model,
            "messages": [m.to_openai() for m in messages],
            "tools": profile.tool_schemas(req.tools),
            # `required` + strict schemas: the engine's guided decoding makes the output
            # a parseable call, even from a weak model.
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": req.max_tokens,
            "temperature": 1.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "priority": req.priority,
        }

    @activity.defn(name="generate")
    async def generate(self, req: GenerateRequest) -> GenerateResult:
        structlog.contextvars.bind_contextvars(
            job_id=req.job_id, step=req.step, engine=self._engine_id
        )
        try:
            return await self._generate(req)
        finally:
            structlog.contextvars.unbind_contextvars("job_id", "step", "engine")

    async def _generate(self, req: GenerateRequest) -> GenerateResult:
        started = time.perf_counter()
        first_token: float | None = None
        content: list[str] = []
        calls: dict[int, dict[str, Any]] = {}
        usage: dict[str, Any] = {}
        finish_reason = None
        body = await self._body(req)
        async with self._http.stream("POST", self._url, json=body) as resp:
            if resp.status_code != 200:
                await self._raise_for(resp)
            async for line in resp.aiter_lines():
                if not line.startswith("data: "):
                    continue
                data = line[6:]
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                activity.heartbeat()  # throttled by the SDK; a hung stream stops it
                if chunk.get("usage"):
                    usage = chunk["usage"]
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    if first_token is None and (delta.get("content") or delta.get("tool_calls")):
                        first_token = time.perf_counter()
                    if delta.get("content"):
                        content.append(delta["content"])
                    for tc in delta.get("tool_calls") or []:
                        slot = calls.setdefault(tc.get("index", 0),
                                                {"id": "", "name": "", "arguments": []})
                        slot["id"] = tc.get("id") or slot["id"]
                        fn = tc.get("function") or {}
                        slot["name"] += fn.get("name") or ""
                        slot["arguments"].append(fn.get("arguments") or "")
                    finish_reason = choice.get("finish_reason") or finish_reason
        done = time.perf_counter()
        details = usage.get("prompt_tokens_details") or {}
        result = GenerateResult(
            engine_id=self._engine_id,
            model=self._model,
            attempt=activity.info().attempt,
            content="".join(content),
            tool_calls=[
                ToolCall(id=c["id"] or f"call-{req.job_id}-{req.step}-{i}",
                         function=FunctionCall(name=c["name"], arguments="".join(c["arguments"])))
                for i, c in sorted(calls.items())
            ],
            finish_reason=finish_reason,
            prompt_tokens=int(usage.get("prompt_tokens", 0)),
            cached_tokens=int(details.get("cached_tokens") or 0),
            completion_tokens=int(usage.get("completion_tokens", 0)),
            ttft_ms=((first_token or done) - started) * 1000,
            latency_ms=(done - started) * 1000,
        )
        log.info("step_generated", prompt_tokens=result.prompt_tokens,
                 cached_tokens=result.cached_tokens, ttft_ms=round(result.ttft_ms, 1))
        return result

    async def _raise_for(self, resp: httpx.Response) -> None:
        body = (await resp.aread()).decode(errors="replace")[:500]
        if resp.status_code == 400 and "context length" in body:
            raise ApplicationError(f"prompt exceeds the engine's context: {body}",
                                   type=CONTEXT_OVERFLOW, non_retryable=True)
        if 400 <= resp.status_code < 500:
            raise ApplicationError(f"engine {self._engine_id} rejected the request "
                                   f"({resp.status_code}): {body}",
                                   type=ENGINE_REJECTED, non_retryable=True)
        # 5xx: retryable; Temporal's retry policy decides how often.
        raise ApplicationError(f"engine {self._engine_id} error {resp.status_code}: {body}",
                               type="EngineError")
