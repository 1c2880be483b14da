"""Context hygiene's pure policy: which outputs go, what replaces them, when it pays."""

from __future__ import annotations

import json
from typing import Any

import pytest

from warmloop.activities.hygiene import HygieneActivities
from warmloop.workflows.budgets import JobLimits, Usage
from warmloop.workflows.contracts import ChatMessage, FunctionCall, ToolCall
from warmloop.workflows.hygiene import (
    ARCHIVE_MARKER,
    ContextHygiene,
    apply_items,
    archive_batches,
    archive_key,
    due_for_check,
    expected_remaining_steps,
    is_summary,
    plan_compaction,
    plan_every_step,
    resolve_hygiene,
    select_items,
)
from warmloop.workflows.profiles.document import profile_from_document


def transcript(outputs: list[tuple[str, str]]) -> list[ChatMessage]:
    """One step per (tool, output): the call, then its answer."""
    out: list[ChatMessage] = []
    for i, (tool, text) in enumerate(outputs, 1):
        out.append(ChatMessage(role="assistant", tool_calls=[ToolCall(
            id=f"call-{i}", function=FunctionCall(name=tool, arguments='{"key": "alpha"}'))]))
        out.append(ChatMessage(role="tool", tool_call_id=f"call-{i}", content=text))
    return out


BIG = "record alpha: " + "ledger " * 600  # ~4.2k characters
CFG = ContextHygiene(min_item_chars=2_000, keep_recent_steps=3)


def usage(steps: int, *, prompt: int = 10_000, cached: int = 9_000) -> Usage:
    return Usage(steps=steps, prompt_tokens=prompt, cached_tokens=cached)


def test_large_outputs_past_the_recent_steps_are_selected_with_structured_summaries() -> None:
    msgs = transcript([("lookup", BIG), ("lookup", "short"), ("lookup", BIG),
                       ("lookup", BIG), ("lookup", BIG), ("lookup", BIG)])
    items = select_items(msgs, CFG, job_id="acme/job-1")
    # steps 1 and 3 are older than 3 steps and large; "short" stays, the last 3 stay
    assert [it.index for it in items] == [1, 5]
    first = items[0]
    assert first.why == "large" and first.tool == "lookup" and first.ok
    assert first.key == "tenants/acme/tool-archive/job-1/000001.txt"
    body = json.loads(first.summary)["archived_tool_output"]
    assert body == {"tool": "lookup", "ok": True, "chars": len(BIG), "step": 1,
                    "head": " ".join(BIG[:80].split()), "ref": 1}
    assert archive_key("acme/job-1", body["ref"]) == first.key  # the ref names the archive
    # deterministic: the same transcript gives the same bytes
    assert select_items(msgs, CFG, job_id="acme/job-1") == items
    # jobs started before short refs keep whole keys (their length enters the decision)
    old = select_items(msgs, CFG, job_id="acme/job-1", short_refs=False)
    assert json.loads(old[0].summary)["archived_tool_output"]["s3_key"] == first.key
    assert [len(it.summary) for it in old] > [len(it.summary) for it in items]


def test_compacted_transcript_keeps_pairing_and_is_never_compacted_again() -> None:
    msgs = transcript([("lookup", BIG)] * 6)
    items = select_items(msgs, CFG, job_id="j")
    after = apply_items(msgs, items)
    assert [m.role for m in after] == [m.role for m in msgs]
    assert [m.tool_call_id for m in after] == [m.tool_call_id for m in msgs]
    assert all(is_summary(after[it.index].content) for it in items)
    assert msgs[1].content == BIG  # the input is not changed in place
    assert select_items(after, CFG, job_id="j") == []


def test_a_summary_longer_than_the_item_is_not_used() -> None:
    tiny = ContextHygiene(min_item_chars=10, keep_recent_steps=0)
    msgs = transcript([("lookup", "x" * 40), ("lookup", "y" * 5_000)])
    items = select_items(msgs, tiny, job_id="j")
    assert [it.index for it in items] == [3]  # the 40-char output would grow


def test_stale_outputs_expire_per_tool_lifetime() -> None:
    cfg = ContextHygiene(min_item_chars=100_000, keep_recent_steps=0,
                         expire_after_steps=4, tool_expire_after_steps={"status": 1})
    poll = "status: pending " + "." * 400
    msgs = transcript([("lookup", "a" * 600), ("status", poll), ("lookup", "b" * 600),
                       ("status", poll)])
    # ages: step 1 -> 3 steps after it, step 2 -> 2, step 3 -> 1, step 4 -> 0
    items = select_items(msgs, cfg, job_id="j")
    assert [(it.index, it.why) for it in items] == [(3, "stale")]  # status older than 1
    older = transcript([("lookup", "a" * 600)] + [("other", "ok")] * 5)
    assert [it.index for it in select_items(older, cfg, job_id="j")] == [1]


def test_failed_outputs_are_summarised_as_not_ok_and_load_tools_answers_stay() -> None:
    cfg = ContextHygiene(min_item_chars=500, keep_recent_steps=0)
    msgs = transcript([("lookup", "tool lookup failed: " + "e" * 800),
                       ("load_tools", "schemas " + "s" * 800)])
    items = select_items(msgs, cfg, job_id="j")
    assert [(it.index, it.ok) for it in items] == [(1, False)]


def test_short_jobs_do_not_fire() -> None:
    """A 6-step job on an 8-step budget: one eligible output, a couple of steps left."""
    msgs = transcript([("lookup", BIG)] * 6)
    plan = plan_compaction(msgs, ContextHygiene(keep_recent_steps=4), job_id="j",
                           limits=JobLimits(max_steps=8), usage=usage(6), fixed_chars=8_000,
                           last_prompt_tokens=6_000)
    assert not plan.fire and plan.reason in ("too_little", "does_not_pay")


def test_long_jobs_fire_when_the_saving_beats_the_reprefill() -> None:
    msgs = transcript([("lookup", BIG)] * 12)
    plan = plan_compaction(msgs, CFG, job_id="j", limits=JobLimits(max_steps=48),
                           usage=usage(12), fixed_chars=8_000, last_prompt_tokens=12_000)
    assert plan.fire and plan.reason == "pays"
    assert len(plan.items) == 9 and plan.first_index == 1  # all but the last 3
    assert plan.saving >= CFG.margin * plan.cost > 0
    # the same transcript with 2 steps left does not pay
    late = plan_compaction(msgs, CFG, job_id="j", limits=JobLimits(max_steps=14),
                           usage=usage(12), fixed_chars=8_000, last_prompt_tokens=12_000)
    assert not late.fire and late.reason == "does_not_pay"
    assert late.saved_tokens == pytest.approx(plan.saved_tokens)


def test_a_cold_cache_makes_compaction_pay_sooner() -> None:
    """With a contended KV pool (low hit share) a re-read costs nearly a full prefill,
    and the cache compaction throws away was mostly lost anyway."""
    msgs = transcript([("lookup", BIG)] * 8)
    kw = dict(job_id="j", limits=JobLimits(max_steps=14), fixed_chars=8_000,
              last_prompt_tokens=9_000)
    warm = plan_compaction(msgs, CFG, usage=usage(8, cached=9_900), **kw)  # type: ignore[arg-type]
    cold = plan_compaction(msgs, CFG, usage=usage(8, cached=1_000), **kw)  # type: ignore[arg-type]
    assert not warm.fire and cold.fire
    assert cold.cost < warm.cost and cold.saving > warm.saving


def test_the_cached_token_price_is_the_engines() -> None:
    msgs = transcript([("lookup", BIG)] * 10)
    kw = dict(job_id="j", limits=JobLimits(max_steps=20), usage=usage(10),
              fixed_chars=8_000, last_prompt_tokens=10_000)
    cheap = plan_compaction(msgs, CFG.model_copy(update={"cached_fraction": 0.0}), **kw)  # type: ignore[arg-type]
    dear = plan_compaction(msgs, CFG.model_copy(update={"cached_fraction": 0.5}), **kw)  # type: ignore[arg-type]
    # a free cached read saves only the missed share; a dear one saves more, costs less
    assert cheap.saving < dear.saving and cheap.cost > dear.cost


def test_pending_approvals_and_oversized_resends_refuse() -> None:
    msgs = transcript([("lookup", BIG)] * 12)
    kw = dict(job_id="j", limits=JobLimits(max_steps=48), usage=usage(12),
              fixed_chars=8_000, last_prompt_tokens=12_000)
    assert plan_compaction(msgs, CFG, pending_approvals=1, **kw).reason == "pending_approval"  # type: ignore[arg-type]
    assert plan_compaction(msgs, CFG, max_resend_bytes=1_000, **kw).reason == "resend_too_big"  # type: ignore[arg-type]
    assert plan_every_step(msgs, CFG, job_id="j", pending_approvals=2).reason == "pending_approval"


def test_every_step_fires_on_anything_eligible() -> None:
    msgs = transcript([("lookup", BIG)] * 4)
    plan = plan_every_step(msgs, CFG, job_id="j")
    assert plan.fire and [it.index for it in plan.items] == [1]
    assert not plan_every_step(transcript([("lookup", BIG)] * 3), CFG, job_id="j").fire


def test_remaining_steps_from_caps_and_prior() -> None:
    limits = JobLimits(max_steps=40)
    assert expected_remaining_steps(limits=limits, usage=Usage(steps=10),
                                    remaining_share=0.5) == 15
    # the token cap at the job's own rate binds first: 10 steps of 1k, 5k left
    tight = JobLimits(max_steps=40, max_total_tokens=15_000)
    assert expected_remaining_steps(limits=tight, usage=Usage(steps=10, prompt_tokens=10_000),
                                    remaining_share=1.0) == pytest.approx(5)
    # the profile's prior while the job is younger than it; the budget after
    assert expected_remaining_steps(limits=limits, usage=Usage(steps=10), remaining_share=0.5,
                                    expected_job_steps=16) == 6
    assert expected_remaining_steps(limits=limits, usage=Usage(steps=20), remaining_share=0.5,
                                    expected_job_steps=16) == 10
    assert expected_remaining_steps(limits=limits, usage=Usage(steps=40),
                                    remaining_share=0.5) == 0


def test_resolve_and_check_points() -> None:
    mine = ContextHygiene(min_item_chars=999, mode="off")
    assert resolve_hygiene(None, None) is None
    assert resolve_hygiene(None, mine) is None
    assert resolve_hygiene("off", ContextHygiene()) is None
    on = resolve_hygiene("every_step", mine)
    assert on is not None and on.mode == "every_step" and on.min_item_chars == 999
    default = resolve_hygiene("cost_model", None)
    assert default == ContextHygiene()
    assert [s for s in range(20) if due_for_check(ContextHygiene(check_every_steps=8), s)] == [
        8, 16]


def test_archive_batches_bound_payloads() -> None:
    msgs = transcript([("lookup", BIG)] * 8)
    items = select_items(msgs, CFG, job_id="j")
    batches = archive_batches(msgs, items, job_id="j", max_bytes=2 * len(BIG))
    assert [len(b.outputs) for b in batches] == [2, 2, 1]
    assert [o.key for b in batches for o in b.outputs] == [archive_key("j", i.index)
                                                          for i in items]
    assert batches[0].outputs[0].text == BIG


def test_a_profile_document_takes_hygiene() -> None:
    doc = {"name": "long-reader", "system_prompt": "Read records.",
           "task_schema": {"type": "object", "properties": {"id": {"type": "string",
                                                                   "pattern": "^[0-9]+$"}},
                           "required": ["id"]},
           "tools": [{"name": "finish", "description": "Done.", "finishes_job": True,
                      "arguments": {"type": "object", "properties": {}}}],
           "hygiene": {"expire_after_steps": 6, "check_every_steps": 4}}
    profile = profile_from_document(doc)
    assert profile.hygiene == ContextHygiene(expire_after_steps=6, check_every_steps=4)
    assert ARCHIVE_MARKER.startswith('{"archived_tool_output"')


class _S3:
    def __init__(self, down: bool = False) -> None:
        self.objects: dict[str, bytes] = {}
        self.down = down

    def put_object(self, *, Bucket: str, Key: str, Body: bytes, **_: Any) -> None:  # noqa: N803
        if self.down:
            raise ConnectionError("S3 unreachable")
        self.objects[Key] = Body


async def test_the_archive_activity_writes_every_output_or_fails() -> None:
    msgs = transcript([("lookup", BIG)] * 6)
    items = select_items(msgs, CFG, job_id="acme/j")
    (req,) = archive_batches(msgs, items, job_id="acme/j", max_bytes=1_000_000)
    s3 = _S3()
    keys = await HygieneActivities(s3, "b").archive_tool_outputs(req)
    assert keys == [it.key for it in items]
    assert all(s3.objects[k] == BIG.encode() for k in keys)
    with pytest.raises(ConnectionError):  # the workflow then keeps its transcript whole
        await HygieneActivities(_S3(down=True), "b").archive_tool_outputs(req)
