"""run_tool: large outputs go to S3 whole, side effects apply once per effect."""

from __future__ import annotations

from typing import Any

import pytest

from tests.ledger_redis import LedgerRedis
from warmloop.activities.tools import EffectLedger, ToolActivities, ToolOutcome, Toolset
from warmloop.workflows.contracts import ToolRequest, ToolResult


class FakeS3:
    def __init__(self) -> None:
        self.objects: dict[str, bytes] = {}

    def put_object(self, *, Bucket: str, Key: str, Body: bytes, **_: Any) -> None:  # noqa: N803
        self.objects[Key] = Body


class BigTools(Toolset):
    profile = "ticket-triage"

    def run(self, req: ToolRequest) -> ToolOutcome:
        if req.name == "search_kb":
            return ToolOutcome(ToolResult(ok=True, output="k" * 20_000))
        return ToolOutcome(ToolResult(ok=True, output="set"), effect={"priority": "low"})


def _req(name: str, step: int, **args: Any) -> ToolRequest:
    return ToolRequest(job_id="j1", step=step, profile="ticket-triage", task_id="T1",
                       name=name, arguments=args)


@pytest.fixture
def parts() -> tuple[ToolActivities, FakeS3, LedgerRedis]:
    s3, redis = FakeS3(), LedgerRedis()
    acts = ToolActivities([BigTools()], EffectLedger(redis), s3=s3,  # type: ignore[arg-type]
                          bucket="b")
    return acts, s3, redis


async def test_large_output_is_cut_for_the_prompt_and_kept_whole_in_s3(parts) -> None:  # type: ignore[no-untyped-def]
    acts, s3, _ = parts
    res = await acts.run_tool(_req("search_kb", 1, topic="login"))
    assert res.output_key == "tool-outputs/j1/1.txt"
    assert s3.objects[res.output_key] == b"k" * 20_000
    assert res.output.startswith("k" * 8192) and res.output.endswith("[cut: 11808 more characters]")


async def test_side_effect_applies_once_however_often_the_step_runs(parts) -> None:  # type: ignore[no-untyped-def]
    acts, _, redis = parts
    first = [await acts.run_tool(_req("set_priority", 2, priority="low")) for _ in range(3)]
    assert first == [ToolResult(ok=True, output="set")] * 3  # a retried or re-run activity
    # another step: set_priority applies once per ticket (its effect_key), not per step
    again = await acts.run_tool(_req("set_priority", 3, priority="low"))
    assert again.ok and again.output.startswith("already applied at step 2")
    assert len(redis.kv) == 1 and next(iter(redis.kv)).startswith("warmloop:effect:j1:id:")
    assert redis.hashes["warmloop:effects:j1"] == {"applied": 1, "deduplicated": 3}
