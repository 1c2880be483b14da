"""Small model first: a profile's model ladder and when a step escalates.

Each step runs on the ladder's cheapest model. It is asked again of the next model up
when the cheap model's call fails validation, when the model was unsure of it (the mean
or the lowest log-probability of the call's tokens, as the engine reports them, under
the ladder's threshold), or when the profile's rules say the call is hard (a tool, an
amount). The next step goes back down unless the ladder says to stay.

The trap an orchestrator that does not own the prefix falls into: an escalated step
lands on a cold engine and re-prefills the whole transcript, every time. Here each
model is its own engine pool, routed cache-aware like any other, so the big model's
engine gets a job's prefix once and later escalations of that job find it warm.

Pure: the workflow decides with it; the report and ``make eval-ladder`` reuse it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class EscalationReason(StrEnum):
    INVALID = "invalid"
    """The cheaper model's call failed validation."""
    LOW_CONFIDENCE = "low_confidence"
    """Its call's log-probabilities were under the ladder's threshold."""
    HARD_TOOL = "hard_tool"
    """It called a tool the profile keeps for the top model."""
    HARD_AMOUNT = "hard_amount"
    """It called a tool with an amount over the profile's threshold."""
    STAYED = "stayed"
    """An earlier step escalated and the ladder stays up (``stay_escalated``)."""


class HardCall(BaseModel):
    """A call the profile wants made by the top model: any call of ``tool``, or (with
    ``field``) one whose numeric argument ``field`` is over ``over``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    tool: str = Field(min_length=1)
    field: str | None = None
    over: float | None = None

    @model_validator(mode="after")
    def _both_or_neither(self) -> HardCall:
        if (self.field is None) != (self.over is None):
            raise ValueError(f"hard call rule for {self.tool!r}: give field and over together "
                             "(an amount threshold) or neither (every call of the tool)")
        return self

    def matches(self, tool: str, args: dict[str, Any]) -> bool:
        if tool != self.tool:
            return False
        if self.field is None:
            return True
        v = args.get(self.field)
        return (isinstance(v, int | float) and not isinstance(v, bool)
                and self.over is not None and v > self.over)


class ModelLadder(BaseModel):
    """Models a profile's steps may run on, cheapest first."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    models: tuple[str, ...] = Field(min_length=2, max_length=8)
    """Served model names, cheapest first; each is routed only to engines serving it."""
    min_mean_logprob: float | None = Field(default=-0.35, le=0)
    """Escalate when the mean log-probability of the call's tokens is under this.
    Structural JSON tokens are near-certain and lift the mean: the minimum is the
    sharper signal for one wrong id. None: not used. Sweep it with ``make eval-ladder``."""
    min_token_logprob: float | None = Field(default=None, le=0)
    """Escalate when any one token of the call is under this log-probability."""
    hard_calls: tuple[HardCall, ...] = ()
    """Calls always made by the top model (the cheap model's call is asked again)."""
    escalate_invalid: bool = True
    """Ask the next model when the cheaper one's call fails validation (instead of
    telling the same model its error)."""
    stay_escalated: Literal["never", "job"] = "never"
    """never: the next step starts at the bottom again; job: once a job escalates, its
    later steps run on the model it reached."""

    @model_validator(mode="after")
    def _distinct(self) -> ModelLadder:
        if len(set(self.models)) != len(self.models):
            raise ValueError(f"model ladder {list(self.models)} names a model twice")
        return self

    @property
    def top(self) -> int:
        return len(self.models) - 1


@dataclass(frozen=True)
class CallConfidence:
    """How sure the model was of the tokens of its call, from the engine's logprobs.
    Why it exists: the engine's guided decoding makes every call parseable, so a
    parseable call says nothing about whether the model knew what to put in it."""

    mean: float
    minimum: float
    tokens: int

    @staticmethod
    def of(logprobs: list[float]) -> CallConfidence | None:
        if not logprobs:
            return None
        return CallConfidence(mean=sum(logprobs) / len(logprobs), minimum=min(logprobs),
                              tokens=len(logprobs))


@dataclass(frozen=True)
class Escalation:
    """Why a step goes one model up; recorded on the step."""

    reason: EscalationReason
    detail: str


def escalation(ladder: ModelLadder, level: int, *, invalid: str | None,
               tool: str | None, args: dict[str, Any] | None,
               confidence: CallConfidence | None) -> Escalation | None:
    """Whether the call the model at ``level`` made should be asked of the next model.
    None at the top rung (nothing to escalate to) or when the call stands."""
    if level >= ladder.top:
        return None
    if invalid is not None:
        return (Escalation(EscalationReason.INVALID, invalid[:200])
                if ladder.escalate_invalid else None)
    if tool is not None:
        for rule in ladder.hard_calls:
            if rule.matches(tool, args or {}):
                if rule.field is None:
                    return Escalation(EscalationReason.HARD_TOOL, f"{tool} is for the top model")
                return Escalation(EscalationReason.HARD_AMOUNT,
                                  f"{tool} {rule.field} {(args or {}).get(rule.field)} "
                                  f"> {rule.over:g}")
    if confidence is not None:
        if ladder.min_mean_logprob is not None and confidence.mean < ladder.min_mean_logprob:
            return Escalation(EscalationReason.LOW_CONFIDENCE,
                              f"mean logprob {confidence.mean:.3f} < {ladder.min_mean_logprob}")
        if (ladder.min_token_logprob is not None
                and confidence.minimum < ladder.min_token_logprob):
            return Escalation(EscalationReason.LOW_CONFIDENCE,
                              f"min logprob {confidence.minimum:.3f} < "
                              f"{ladder.min_token_logprob}")
    return None


def start_level(ladder: ModelLadder, reached: int) -> int:
    """The rung a job's next step starts on, given the highest it has reached."""
    return reached if ladder.stay_escalated == "job" else 0


@dataclass(frozen=True)
class LadderShare:
    """Steps per model and what the ladder saved, for ``warmloop report``."""

    steps_by_model: dict[str, int]
    escalations: dict[str, int]
    cost_usd: float
    top_only_cost_usd: float | None
    """The same tokens priced at the top model's rate; None when it is unpriced."""

    @property
    def saved_share(self) -> float | None:
        if not self.top_only_cost_usd:
            return None
        return 1 - self.cost_usd / self.top_only_cost_usd
