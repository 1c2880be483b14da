"""One agent loop, two policies: the oracle that writes training transcripts and the
engine that is evaluated.

Both go through warmloop's own code wherever the production path has it: the request
body is built by ``InferenceActivities._body`` (the inference worker's prompt assembly:
system prompt, tools, task, transcript, budget tail, ``tool_choice`` and guided
decoding), tools run through ``ToolActivities.run_tool`` (the agent worker's activity:
out-of-task refusals, the side-effect ledger, output cuts) over the real toolsets, calls
are validated by ``AgentJob._validate`` and repaired by ``AgentJob._repair_messages``,
and budgets come from ``workflows.budgets``. The loop itself mirrors ``AgentJob._loop``
(caps before each step, per-tool caps, finish, approvals granted at once as the demo's
stand-in approver does); it is the only part written again here, because the workflow
needs a Temporal server to run.
"""

from __future__ import annotations

import asyncio
import copy
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

from warmloop.infra.demo_model.world import World

TICKET = "ticket-triage"
INVOICE = "invoice-reconciliation"


def load_profiles() -> None:
    """Register the bundled profiles (as every warmloop process does at start), and keep
    the tools' per-call info logs out of this batch tool's output."""
    import logging

    import structlog

    from warmloop.workers.plugins import load_plugins

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(logging.WARNING))
    load_plugins(toolsets=False)


@dataclass
class StepOutput:
    """What one model step produced, as the inference worker reports it."""

    tool_calls: list[Any]
    content: str = ""
    prompt_tokens: int = 0
    completion_tokens: int = 0
    prompt_ids: list[int] = field(default_factory=list)


Policy = Callable[[int, dict[str, Any]], Awaitable[StepOutput]]
"""(step, request body) -> the step's output."""


class _Transcripts:
    """The transcript store ``InferenceActivities`` reads: here the job's messages are
    passed whole with every step (base_len 0), so it keeps nothing."""

    async def extend_deferred(self, job_id: str, base_len: int, new: list[Any]
                              ) -> tuple[list[Any], asyncio.Future[Any]]:
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        done.set_result(None)
        return list(new), done


class _MemoryRedis:
    """The few Redis calls ``EffectLedger`` makes, in memory (one job at a time)."""

    def __init__(self) -> None:
        self._kv: dict[str, Any] = {}

    async def set(self, key: str, value: str, nx: bool = False) -> bool:
        if nx and key in self._kv:
            return False
        self._kv[key] = value
        return True

    async def get(self, key: str) -> Any:
        return self._kv.get(key)

    async def hincrby(self, key: str, field_: str, n: int) -> int:
        h = self._kv.setdefault(key, {})
        h[field_] = h.get(field_, 0) + n
        return int(h[field_])


class RequestBuilder:
    """The inference worker's request body for a step (``InferenceActivities._body``)."""

    def __init__(self, served_model: str = "tiny", *, grounded: bool = False) -> None:
        import httpx

        from warmloop.activities.inference import InferenceActivities

        self._acts = InferenceActivities(
            engine_id="eval", base_url="http://127.0.0.1:1", model=served_model,
            http=httpx.AsyncClient(), transcripts=_Transcripts(),  # type: ignore[arg-type]
            grounded_arguments=grounded)

    async def body(self, *, job_id: str, step: int, profile: str, task: dict[str, Any],
                   transcript: list[Any], tail: str, max_tokens: int) -> dict[str, Any]:
        from warmloop.workflows.contracts import GenerateRequest

        req = GenerateRequest(job_id=job_id, step=step, profile=profile, task=task,
                              base_len=0, new_messages=transcript, tail=tail,
                              max_tokens=max_tokens)
        body, _profile, _stored = await self._acts._body(req)
        return body


def chat_inputs(body: dict[str, Any]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The messages and tools the engine's chat template receives for ``body``: vLLM
    validates the request (``ChatCompletionRequest``; its tool model orders the keys of
    each tool) and parses each tool call's arguments into an object
    (``_postprocess_messages``). Checked against the engine's own prompt token ids by
    ``evaluate``."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    req = ChatCompletionRequest.model_validate(
        {"model": body["model"], "messages": body["messages"], "tools": body["tools"]})
    tools = [t.model_dump() for t in (req.tools or [])]
    messages = copy.deepcopy(body["messages"])
    for m in messages:
        for call in m.get("tool_calls") or []:
            args = call["function"].get("arguments")
            if args and isinstance(args, str):
                call["function"]["arguments"] = json.loads(args)
    return messages, tools


def render_prompt(tokenizer: Any, body: dict[str, Any]) -> str:
    """The prompt text the engine builds from ``body`` with the model's chat template."""
    messages, tools = chat_inputs(body)
    text = tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                         tokenize=False)
    assert isinstance(text, str)
    return text


def call_text(name: str, arguments: dict[str, Any]) -> str:
    """A tool call as the model emits it: vLLM's hermes structural tag (``<tool_call>``,
    the name, then the arguments as the chat template renders them) and end of turn."""
    return ("<tool_call>" + json.dumps({"name": name, "arguments": arguments},
                                       ensure_ascii=False) + "</tool_call><|end|>")


_HTTP: Any = None


class ToolRunner:
    """The agent worker's ``run_tool`` activity over a world's toolsets."""

    def __init__(self, world: World) -> None:
        import httpx

        from warmloop.activities.tools import ToolActivities
        from warmloop.activities.tools.base import EffectLedger
        from warmloop.activities.tools.invoice_reconciliation import (
            InvoiceReconciliationTools,
        )
        from warmloop.activities.tools.ticket_triage import TicketTriageTools

        toolsets = [TicketTriageTools(world.customers, world.kb),
                    InvoiceReconciliationTools(world.vendors, world.invoices,
                                               world.purchase_orders)]
        global _HTTP
        if _HTTP is None:  # the bundled tools make no HTTP calls; one idle client for all
            _HTTP = httpx.AsyncClient()
        self._acts = ToolActivities(toolsets, EffectLedger(_MemoryRedis()),  # type: ignore[arg-type]
                                    s3=None, bucket="none", http=_HTTP)

    async def run(self, *, job_id: str, step: int, profile: str, task_id: str, name: str,
                  arguments: dict[str, Any]) -> Any:
        from warmloop.workflows.contracts import ToolRequest

        return await self._acts.run_tool(ToolRequest(
            job_id=job_id, step=step, profile=profile, task_id=task_id, name=name,
            arguments=arguments))


@dataclass
class JobRun:
    """How one job went: its end, its calls and what each step saw."""

    state: str
    reason: str
    final: dict[str, Any] | None
    calls: list[tuple[str, dict[str, Any], str]]
    """(tool, arguments, what the tool answered) of every valid call."""
    steps: int
    valid_steps: int
    transcript: list[Any]
    bodies: list[dict[str, Any]] = field(default_factory=list)
    outputs: list[StepOutput] = field(default_factory=list)


async def run_job(*, profile_name: str, task: dict[str, Any], world: World, policy: Policy,
                  builder: RequestBuilder, job_id: str, max_steps: int | None = None,
                  elapsed: Callable[[int], float] | None = None) -> JobRun:
    """One job, as ``AgentJob._loop`` runs it (approvals granted at once)."""
    from warmloop.workflows.agent_job import AgentJob
    from warmloop.workflows.budgets import (
        StepKind,
        Usage,
        check_before_step,
        check_tool_cap,
        remaining_text,
        step_output_budget,
    )
    from warmloop.workflows.contracts import ChatMessage, GenerateResult
    from warmloop.workflows.profiles import ToolCallError, get_profile

    profile = get_profile(profile_name)
    limits = profile.limits if max_steps is None else profile.limits.model_copy(
        update={"max_steps": max_steps})
    validated = profile.validate_task(task).model_dump(mode="json")
    task_id = str(task.get(profile.task_id_field, ""))
    tools = ToolRunner(world)
    usage, kind, invalid = Usage(), StepKind.PLAN, 0
    transcript: list[ChatMessage] = []
    run = JobRun(state="", reason="", final=None, calls=[], steps=0, valid_steps=0,
                 transcript=transcript)
    while True:
        seconds = elapsed(usage.steps) if elapsed else 0.0
        hit = check_before_step(limits, usage, seconds)
        if hit:
            run.state, run.reason = hit.state, hit.reason
            break
        step = usage.steps + 1
        body = await builder.body(
            job_id=job_id, step=step, profile=profile.name, task=validated,
            transcript=list(transcript), tail=remaining_text(limits, usage, seconds),
            max_tokens=step_output_budget(profile.budgets, kind, limits, usage))
        out = await policy(step, body)
        run.bodies.append(body)
        run.outputs.append(out)
        usage.steps = step
        usage.prompt_tokens += out.prompt_tokens
        usage.completion_tokens += out.completion_tokens
        run.steps = step
        gen = GenerateResult(engine_id="eval", model=body["model"], attempt=1,
                             content=out.content, tool_calls=out.tool_calls,
                             finish_reason="tool_calls", prompt_tokens=out.prompt_tokens,
                             cached_tokens=0, completion_tokens=out.completion_tokens,
                             ttft_ms=0.0, latency_ms=0.0)
        try:
            spec, args = AgentJob._validate(profile, gen, None)
        except ToolCallError as e:
            transcript.extend(AgentJob._repair_messages(gen, str(e)))
            invalid += 1
            kind = StepKind.REFLECT
            if invalid >= profile.max_invalid_calls:
                run.state, run.reason = "INVALID_OUTPUT", f"{invalid} invalid calls; last: {e}"
                break
            continue
        invalid = 0
        run.valid_steps += 1
        call = gen.tool_calls[0]
        cap = check_tool_cap(limits, usage, spec.name, spec.max_calls)
        usage.tool_calls[spec.name] = usage.tool_calls.get(spec.name, 0) + 1
        transcript.append(ChatMessage(role="assistant", tool_calls=[call]))
        if cap:
            transcript.append(ChatMessage(role="tool", tool_call_id=call.id,
                                          content=f"refused: {cap.reason}"))
            run.state, run.reason = cap.state, cap.reason
            break
        if spec.finishes_job:
            transcript.append(ChatMessage(role="tool", tool_call_id=call.id, content="done"))
            run.calls.append((spec.name, args, "done"))
            run.state, run.reason, run.final = "FINISHED", f"{spec.name} called", args
            break
        refusal = profile.out_of_task(spec, task_id, args)
        if refusal is not None:
            transcript.append(ChatMessage(role="tool", tool_call_id=call.id, content=refusal))
            run.calls.append((spec.name, args, refusal))
            kind = StepKind.REFLECT
            continue
        result = await tools.run(job_id=job_id, step=step, profile=profile.name,
                                 task_id=task_id, name=spec.name, arguments=args)
        run.calls.append((spec.name, args, result.output))
        transcript.append(ChatMessage(role="tool", tool_call_id=call.id, content=result.output))
        kind = StepKind.EXECUTE if result.ok else StepKind.REFLECT
    return run
