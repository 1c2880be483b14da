"""A synthetic agent with a 40-tool catalog, twice: every schema up front
(``synthetic-catalog``) and loaded on demand (``synthetic-catalog-lazy``), otherwise the
same system prompt, task and tools. ``bench/lazy_tools.py`` runs them; the integration
test of tools on demand uses the lazy one.

The tools look like a real integration catalog (CRM, billing, shipping, ...): a
two-sentence description, two to four arguments with their own descriptions, enums and
pattern-bounded ids, about 600 characters of schema each. They are generated from a
fixed seed, so every process builds the same profile. ``bench.plugin`` registers them
with the other synthetic agents.
"""

from __future__ import annotations

import random
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, create_model

from bench.synthetic_profiles import WORDS, Case, system_prompt
from warmloop import ToolOutcome, ToolRequest, ToolResult, Toolset
from warmloop.workflows.budgets import JobLimits, OutputBudgets
from warmloop.workflows.profiles.base import Profile, ToolSpec

CATALOG = "synthetic-catalog"
CATALOG_LAZY = "synthetic-catalog-lazy"
N_TOOLS = 40

_AREAS = ("crm", "billing", "shipping", "inventory", "support", "hr", "finance", "legal")
_ACTIONS = ("get", "search", "update", "list", "create")
_OBJECTS = {
    "crm": "account", "billing": "invoice", "shipping": "shipment", "inventory": "item",
    "support": "ticket", "hr": "employee", "finance": "ledger_entry", "legal": "contract"}


def _sentence(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(rng.randint(lo, hi)))


def _args_model(name: str, rng: random.Random) -> type[BaseModel]:
    record = Field(pattern=r"^[A-Z]{2}[0-9]{4,8}$",
                   description=f"Id of the record: {_sentence(rng, 6, 10)}")
    fields: dict[str, Any] = {"record_id": (Annotated[str, record], ...)}
    for i in range(rng.randint(1, 3)):
        options = tuple(dict.fromkeys(rng.choice(WORDS) for _ in range(rng.randint(3, 6))))
        one_of: Any = Literal[options]
        fields[f"{rng.choice(WORDS)}_{i}"] = (
            Annotated[one_of, Field(description=_sentence(rng, 6, 12))], ...)
    return create_model(f"{name}_args", __config__=ConfigDict(extra="forbid"), **fields)


def catalog_tools(n: int = N_TOOLS, *, seed: int = 40) -> tuple[ToolSpec, ...]:
    """``n`` tools, named area_action_object, each with a two-sentence description."""
    rng = random.Random(seed)
    names = [f"{a}_{v}_{_OBJECTS[a]}" for a in _AREAS for v in _ACTIONS][:n]
    out = []
    for name in names:
        area, action = name.split("_")[:2]
        description = (f"{action.capitalize()} a {area} {_OBJECTS[area].replace('_', ' ')}: "
                       f"{_sentence(rng, 5, 9)}. {_sentence(rng, 14, 22).capitalize()}.")
        out.append(ToolSpec(name, description, _args_model(name, rng), pause_median_s=0.2,
                            pause_p90_s=0.5))
    return tuple(out)


class CloseArgs(BaseModel):
    model_config = ConfigDict(extra="forbid")
    outcome: Literal["done", "escalated"]


def catalog_profile(*, on_demand: bool) -> Profile:
    return Profile(
        name=CATALOG_LAZY if on_demand else CATALOG,
        system_prompt=system_prompt("operations", rules=12),
        task_id_field="case_id", task_model=Case,
        tools=(*catalog_tools(),
               ToolSpec("close", "Close the case with an outcome.", CloseArgs,
                        finishes_job=True)),
        limits=JobLimits(max_steps=16),
        budgets=OutputBudgets(plan=96, execute=96, reflect=96),
        max_invalid_calls=6,
        tools_on_demand=on_demand,
    )


CATALOG_PROFILES = (catalog_profile(on_demand=False), catalog_profile(on_demand=True))


class CatalogTools(Toolset):
    """Every catalog tool answers a seeded line of words (by case, step and tool)."""

    def __init__(self, profile: str) -> None:
        self.profile = profile

    def run(self, req: ToolRequest) -> ToolOutcome:
        rng = random.Random(f"{req.task_id}/{req.step}/{req.name}")
        return ToolOutcome(ToolResult(ok=True, output=tool_output(req.name, rng)))


def tool_output(name: str, rng: random.Random) -> str:
    """What a catalog tool answers: a record of 30-50 words."""
    return f"{name}: " + " ".join(rng.choice(WORDS) for _ in range(rng.randint(30, 50)))

