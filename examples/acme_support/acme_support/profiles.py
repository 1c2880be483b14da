"""Acme's profiles: one in Python (its tools are functions), two as YAML files (an HTTP
tool, and a refund tool that is an activity of Acme's own worker)."""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from acme_support.tools import add_note, order_status
from warmloop import JobLimits, Profile, ToolSpec


class OrderQuestion(BaseModel):
    """The task of an acme-orders job."""

    model_config = ConfigDict(extra="forbid")
    order_id: str = Field(pattern=r"^O[0-9]{4}$")
    question: str = Field(min_length=1, max_length=500)


class Answer(BaseModel):
    model_config = ConfigDict(extra="forbid")
    answer: Literal["on_its_way", "delivered", "cancelled", "unknown"]


ORDERS = Profile(
    name="acme-orders",
    system_prompt=(
        "You are Acme's order desk. Answer the customer's question about one order.\n"
        "Call exactly one tool per reply: order_status to read the order, add_note to "
        "record what you did, finish with the answer when you know it. Never answer in "
        "prose.\n"),
    task_model=OrderQuestion, task_id_field="order_id",
    tools=(order_status.spec, add_note.spec,
           ToolSpec("finish", "Answer the customer and end the job.", Answer,
                    finishes_job=True)),
    limits=JobLimits(max_steps=6),
)

HERE = Path(__file__).parent
PROFILES = [ORDERS, HERE / "profiles"]
"""What warmloop loads from this plugin: a Profile and a folder of YAML profiles."""
