"""Synthetic profiles for benchmarks: a family of agents with long, distinct stable
prefixes, one lookup tool whose output and pause are seeded by (case, step).

They make a workload that is nearly the same under every routing policy (same
prefixes, tool outputs and step counts; only the model's sampled arguments differ), so
that cache hit rates and prefill tokens can be compared; they do no useful work.
``bench/routing.py`` runs them.
"""

from __future__ import annotations

import dataclasses
import random
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from warmloop.workflows.budgets import JobLimits, OutputBudgets
from warmloop.workflows.ladder import HardCall, ModelLadder
from warmloop.workflows.profiles.base import ApprovalRule, Profile, ToolSpec

SYNTHETIC_DOMAINS = ("support", "billing", "legal", "logistics")
LOOKUP_KEYS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel")

_VOCABULARY = """
account agent answer approve audit balance batch benefit billing branch budget carrier
case channel charge check claim client close comment contract copy credit customer data
deadline delay delivery deposit detail device dispute document draft due entry error
escalate estimate evidence export fee field file filing form freight fund grant hold
incident invoice issue item journal label ledger letter limit line log loss manifest
matter memo merchant note notice number office order owner package partner party
payment period permit plan policy port priority process product project quote rate
receipt record refund region release report request reserve review risk route rule
schedule service shipment signature source statement status step store supplier tariff
task tax team term ticket total track transfer unit update vendor version warehouse
warranty window
"""
WORDS: tuple[str, ...] = tuple(_VOCABULARY.split())


def _paragraphs(domain: str, n: int) -> str:
    rng = random.Random(f"synthetic-{domain}")
    out = []
    for i in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(28, 40))]
        out.append(f"Rule {domain[:3].upper()}-{i + 1:02d}: " + " ".join(words) + ".")
    return "\n".join(out)


def system_prompt(domain: str, *, rules: int = 32) -> str:
    """About 1.8k tokens of stable, domain-specific instructions (on the tiny model's
    tokenizer), generated from a fixed seed so every process builds the same text."""
    return (
        f"You are the {domain} operations agent. Work one case at a time, one tool call "
        "per reply, and read each result before the next call. Never answer in prose.\n\n"
        f"## Rules of the {domain} desk\n{_paragraphs(domain, rules)}\n"
    )


class Case(BaseModel):
    """The task of a synthetic job."""

    model_config = ConfigDict(extra="forbid")

    case_id: str = Field(pattern=r"^S[0-9]{4,6}$")
    text: str = Field(min_length=1, max_length=4000)


class LookupArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: Literal["alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel"]


class CloseArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    outcome: Literal["done", "escalated"]


class EscalateArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    reason: Literal["unclear", "risky", "exception"]


REVIEW_APPROVAL = ApprovalRule(
    kind="escalation", tool="escalate", approvers=("reviewer",), deadline_s=3600,
    pause_median_s=120, pause_p90_s=600,
)
"""The review profile's human step: every escalation waits for a reviewer."""


def synthetic_profile(domain: str, *, approvals: tuple[ApprovalRule, ...] = (),
                      extra_tools: tuple[ToolSpec, ...] = ()) -> Profile:
    return Profile(
        name=f"synthetic-{domain}",
        system_prompt=system_prompt(domain),
        task_id_field="case_id",
        task_model=Case,
        tools=(
            ToolSpec("lookup", f"Look up a {domain} record by key.", LookupArgs),
            ToolSpec("close", "Close the case with an outcome.", CloseArgs, finishes_job=True),
            *extra_tools,
        ),
        approvals=approvals,
        limits=JobLimits(max_steps=10, max_tool_calls={"lookup": 50}),
        # The random tiny model pads guided JSON with whitespace (unbounded inside the
        # tool-call tag) until max_tokens cuts it: allow a longer streak of repairs.
        budgets=OutputBudgets(plan=64, execute=64, reflect=64),
        max_invalid_calls=6,
    )


LADDER_MODELS = ("small", "large")
"""The served model names of the laddered profile's two engine pools."""


def laddered_profile() -> Profile:
    """synthetic-support on a model ladder (small, then large; a ``close`` is always
    made by the top model): its engines must serve ``LADDER_MODELS``."""
    return dataclasses.replace(
        synthetic_profile("support"), name="synthetic-laddered",
        ladder=ModelLadder(models=LADDER_MODELS, min_mean_logprob=-0.35,
                           hard_calls=(HardCall(tool="close"),)))


SYNTHETIC_PROFILES = (
    *(synthetic_profile(d) for d in SYNTHETIC_DOMAINS),
    laddered_profile(),
    # Not in the routing workload: its jobs wait for humans (bench-pauses approves them).
    synthetic_profile("review", approvals=(REVIEW_APPROVAL,), extra_tools=(
        ToolSpec("escalate", "Ask a reviewer to look at the case.", EscalateArgs),)),
)
