"""The support workflow: the agent looks the order up and drafts a reply, a person
reviews the draft (a workflow Update), and the agent writes the final reply.

Plain OpenAI Agents SDK code on Temporal: nothing here imports warmloop (one header on
the last call speaks to its gateway; other servers ignore it). Every model call
(three, or more if the model calls the tool again) runs as the plugin's model
activity; the worker's model provider sends each to the gateway with this workflow's
id as the session, so the calls after the first find the conversation's prefix cached
on the engine that served it, including the one after the review, however long the
person took.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from temporalio import workflow

with workflow.unsafe.imports_passed_through():
    from agents import (
        Agent,
        ModelResponse,
        ModelSettings,
        RunErrorHandlerInput,
        RunErrorHandlerResult,
        RunErrorHandlers,
        Runner,
        RunResult,
        ToolCallItem,
        ToolCallOutputItem,
        TResponseInputItem,
    )
    from temporalio.openai_agents.workflow import activity_as_tool

    from openai_agents_support.orders import lookup_order

INSTRUCTIONS = """\
You answer customers of an online shop about their orders.
Always look the order up with the lookup_order tool before you answer; never guess an
order's status, carrier or delivery date. Order ids are an O followed by four digits.
Write short, friendly replies in plain text: one greeting line, the facts from the
order system, and what happens next. If the order is not found, ask the customer to
check the id. Do not promise refunds, discounts or delivery dates the order system did
not give. A support lead reviews every draft before it is sent: when the lead rejects a
draft, rewrite it following the lead's note; when the lead approves, send it with the
lead's changes, if any.
"""


@dataclass
class SupportRequest:
    """A customer's question. ``customer`` opens the agent's instructions (a
    customer-specific prompt: each case's prefix is its own)."""

    customer: str
    question: str
    max_turns: int = 4
    """Model calls per agent run; the run ends with the last draft after that."""
    max_tokens: int = 256
    """Per model call. Room enough for a weak model to close its tool call: the tiny
    model the embedded stack serves pads a guided call's JSON with whitespace."""
    lookup_attempts: int = 3
    """Runs of the agent until its draft rests on a lookup (see ``run``)."""
    review_timeout_s: float = 24 * 3600.0
    """After this long without a review, the draft counts as rejected."""


@dataclass
class Review:
    """A person's decision on the draft."""

    approved: bool
    reviewer: str
    note: str = ""


@dataclass
class ModelCall:
    """One model call's usage, as the engine reported it."""

    input_tokens: int
    cached_tokens: int
    output_tokens: int


@dataclass
class SupportOutcome:
    draft: str
    review: Review
    reply: str
    tool_outputs: list[str] = field(default_factory=list)
    """What the tools answered, in order."""
    model_calls: list[ModelCall] = field(default_factory=list)


def support_agent(customer: str, *, max_tokens: int) -> Agent[Any]:
    """The agent. No model name: the worker's provider serves its default model.

    ``tool_choice="required"`` with one tool makes the first call a lookup (guided
    decoding on the engines: the call's form is forced even for the tiny random-weight
    model the embedded stack serves, given ``max_tokens`` room and a bounded order
    id); the SDK then resets it to ``auto`` for the draft."""
    return Agent(
        name="Order support",
        instructions=f"Customer: {customer}.\n{INSTRUCTIONS}",
        tools=[activity_as_tool(lookup_order, start_to_close_timeout=timedelta(seconds=30))],
        model_settings=ModelSettings(tool_choice="required", parallel_tool_calls=False,
                                     max_tokens=max_tokens),
    )


def _last_draft(data: RunErrorHandlerInput[Any]) -> RunErrorHandlerResult:
    """At max_turns, the run ends with what the model last wrote (or nothing)."""
    texts = [getattr(part, "text", "") for r in data.run_data.raw_responses
             for item in r.output for part in getattr(item, "content", None) or []]
    return RunErrorHandlerResult(final_output=next((t for t in reversed(texts) if t), ""),
                                 include_in_history=False)


ERROR_HANDLERS: RunErrorHandlers[Any] = {"max_turns": _last_draft}


def _usage(response: ModelResponse) -> ModelCall:
    u = response.usage
    return ModelCall(input_tokens=u.input_tokens, output_tokens=u.output_tokens,
                     cached_tokens=u.input_tokens_details.cached_tokens or 0)


def _tool_outputs(result: RunResult) -> list[str]:
    return [str(i.output) for i in result.new_items if isinstance(i, ToolCallOutputItem)]


@workflow.defn
class SupportWorkflow:
    def __init__(self) -> None:
        self._draft: str | None = None
        self._review: Review | None = None

    @workflow.run
    async def run(self, request: SupportRequest) -> SupportOutcome:
        agent = support_agent(request.customer, max_tokens=request.max_tokens)
        # A draft must rest on a lookup. A model that answered without one (a weak model
        # can fail to finish its tool call) is asked again, in the same conversation.
        runs: list[RunResult] = []
        conversation: str | list[TResponseInputItem] = request.question
        for _ in range(max(1, request.lookup_attempts)):
            drafting = await Runner.run(agent, conversation, max_turns=request.max_turns,
                                     error_handlers=ERROR_HANDLERS)
            runs.append(drafting)
            if any(isinstance(i, ToolCallItem) for i in drafting.new_items):
                break
            conversation = [*drafting.to_input_list(), {
                "role": "user", "content": "Look the order up with lookup_order first."}]
        self._draft = str(drafting.final_output)
        workflow.logger.info("draft ready for review after %d run(s)", len(runs))
        try:
            await workflow.wait_condition(
                lambda: self._review is not None,
                timeout=timedelta(seconds=request.review_timeout_s))
        except TimeoutError:
            self._review = Review(approved=False, reviewer="(nobody)",
                                  note="no review in time: hold the reply")
        review = self._review
        assert review is not None
        verdict = "approved" if review.approved else "rejected"
        follow_up: list[TResponseInputItem] = [
            *drafting.to_input_list(),
            {"role": "user", "content": f"Support lead {review.reviewer} {verdict} the "
                                        f"draft. {review.note}".strip()},
        ]
        # The facts are in the conversation now: no more lookups, just the reply. It is
        # this workflow's last model call: ``x-session-final`` tells the gateway, which
        # ends the session's hold on the engine now rather than at its idle TTL (any
        # other OpenAI-compatible server ignores the header).
        settings = agent.model_settings
        closing = agent.clone(model_settings=dataclasses.replace(
            settings, tool_choice="none",
            extra_headers={**(settings.extra_headers or {}), "x-session-final": "1"}))
        final = await Runner.run(closing, follow_up, max_turns=request.max_turns,
                                 error_handlers=ERROR_HANDLERS)
        runs.append(final)
        return SupportOutcome(
            draft=self._draft, review=review, reply=str(final.final_output),
            tool_outputs=[o for run in runs for o in _tool_outputs(run)],
            model_calls=[_usage(r) for run in runs for r in run.raw_responses])

    @workflow.query
    def draft(self) -> str | None:
        """The draft waiting for review (None before the agent has written it)."""
        return self._draft if self._review is None else None

    @workflow.update
    def review(self, review: Review) -> str:
        """Decide on the draft; returns the draft decided on."""
        self._review = review
        assert self._draft is not None
        return self._draft

    @review.validator
    def _check_review(self, review: Review) -> None:
        if self._draft is None:
            raise ValueError("there is no draft to review yet")
        if self._review is not None:
            raise ValueError(f"the draft was already reviewed by {self._review.reviewer}")
        if not review.reviewer:
            raise ValueError("a review names its reviewer")
