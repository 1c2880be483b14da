"""Grounded arguments (activities/grounding.py): which ids a step may name, the
constraint sent to the engine, and reading the call back from its text."""

from __future__ import annotations

import json
from typing import Any

from warmloop.activities.grounding import (
    MAX_CANDIDATES,
    context_text,
    ground_parameters,
    grounded_constraint,
    parse_hermes_call,
    seen_values,
)
from warmloop.workflows.contracts import ChatMessage, FunctionCall, ToolCall
from warmloop.workflows.profiles import get_profile
from warmloop.workflows.prompt import request_tools


def test_only_whole_matches_of_the_pattern_are_seen_in_order() -> None:
    text = 'task {"customer_id":"C128"} then C12 and C1289 and xC130 and C131, C128 again'
    assert seen_values(r"^C[0-9]{3}$", text) == ["C128", "C131"]
    assert seen_values(r"^INV[0-9]{4}$", text) == []
    assert seen_values(r"^(unclosed$", text) == []  # a pattern Python cannot read: none


def test_candidates_are_capped_at_the_earliest_seen() -> None:
    text = " ".join(f"C{n:03d}" for n in range(200))
    values = seen_values(r"^C[0-9]{3}$", text)
    assert len(values) == MAX_CANDIDATES and values[0] == "C000"


def test_patterned_strings_become_enums_of_seen_values_others_stay() -> None:
    params: dict[str, Any] = {"type": "object", "properties": {
        "invoice_id": {"type": "string", "pattern": r"^INV[0-9]{4}$"},
        "po_number": {"type": "string", "pattern": r"^PO[0-9]{4}$"},
        "reason": {"type": "string", "enum": ["price_mismatch"]},
        "amount": {"type": "number"}}}
    grounded = ground_parameters(params, "INV1001 INV1002 and nothing else")
    assert grounded["properties"]["invoice_id"] == {"type": "string",
                                                    "enum": ["INV1001", "INV1002"]}
    # no PO number seen: its pattern stays; enums and numbers are left as they are
    assert grounded["properties"]["po_number"] == params["properties"]["po_number"]
    assert grounded["properties"]["reason"] == params["properties"]["reason"]
    assert grounded["properties"]["amount"] == {"type": "number"}  # no number seen
    assert params["properties"]["invoice_id"]["pattern"]  # the profile's schema is untouched


def test_numbers_become_enums_of_the_literals_seen_within_bounds() -> None:
    from warmloop.activities.grounding import seen_numbers

    text = ('{"invoice_id":"INV1001","lines":[{"qty":20,"unit_price":24.5,"amount":490.0}],'
            '"total":1109.0,"credit":-5,"date":"2025-03-01","v":"1.2.3"} total 1109.0 again')
    amount = {"type": "number", "minimum": 0, "maximum": 1_000_000}
    # ids' digits, dates, versions and numbers below the minimum are not amounts
    assert seen_numbers(amount, text) == [20, 24.5, 490.0, 1109.0]
    assert seen_numbers({"type": "integer", "exclusiveMinimum": 0}, text) == [20]
    params = {"type": "object", "properties": {"amount": amount}}
    grounded = ground_parameters(params, text)["properties"]["amount"]
    assert grounded == {"type": "number", "enum": [20, 24.5, 490.0, 1109.0]}
    # each literal as the model writes it: a float keeps its ".0"
    assert json.dumps(grounded["enum"]) == "[20, 24.5, 490.0, 1109.0]"


def test_the_context_is_the_task_the_calls_and_the_results() -> None:
    transcript = [
        ChatMessage(role="assistant", tool_calls=[ToolCall(id="1", function=FunctionCall(
            name="fetch_invoice", arguments='{"invoice_id": "INV1001"}'))]),
        ChatMessage(role="tool", tool_call_id="1", content='{"po_number": "PO4001"}')]
    text = context_text({"vendor_id": "V201"}, transcript)
    assert all(s in text for s in ("V201", "INV1001", "PO4001"))


def test_the_constraint_is_one_hermes_call_of_the_offered_tools_with_grounded_ids() -> None:
    tools = request_tools(get_profile("invoice-reconciliation"), None)
    fields = grounded_constraint(tools, '{"invoice_id":"INV1001","po_number":"PO4001"}')
    assert fields["tool_choice"] == "none" and fields["skip_special_tokens"] is False
    tag = json.loads(fields["structured_outputs"]["structural_tag"])
    fmt = tag["format"]
    assert fmt["stop_after_first"] and fmt["at_least_one"]
    by_name = {t["begin"].split('"name": "')[1].split('"')[0]: t for t in fmt["tags"]}
    assert set(by_name) == {t["function"]["name"] for t in tools}
    fetch = by_name["fetch_invoice"]
    assert fetch["begin"] == '<tool_call>{"name": "fetch_invoice", "arguments": '
    assert fetch["end"] == "}</tool_call>"
    assert fetch["content"]["max_whitespace_cnt"] == 1  # no padding until max_tokens
    assert fetch["content"]["json_schema"]["properties"]["invoice_id"]["enum"] == ["INV1001"]


def test_a_call_is_read_from_the_text_and_anything_else_is_no_call() -> None:
    text = '<tool_call>{"name": "finish", "arguments": {"outcome": "paid"}}</tool_call>'
    content, calls = parse_hermes_call(text, "c-1")
    assert content == "" and len(calls) == 1
    assert calls[0].id == "c-1" and calls[0].function.name == "finish"
    assert json.loads(calls[0].function.arguments) == {"outcome": "paid"}
    # a whole call whose closing tag max_tokens cut is still the call
    for cut in ("</tool_call", "<", ""):
        _, calls = parse_hermes_call(text.removesuffix("</tool_call>") + cut, "c-3")
        assert [c.function.name for c in calls] == ["finish"], cut
    for bad in ('<tool_call>{"name": "finish", "arguments": {"outc',  # cut by max_tokens
                '<tool_call>["finish"]</tool_call>', '<tool_call>{"name": 3}</tool_call>',
                "plain text", ""):
        assert parse_hermes_call(bad, "c-2") == (bad, [])


# ---- the inference activity with grounding on (a scripted engine) ----------------------


def _text_stream(text: str) -> bytes:
    from tests.unit.engine_fakes import role_chunk, sse, usage_chunk

    return sse(role_chunk(),
               {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]},
               {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]},
               usage_chunk(), "[DONE]")


async def test_a_grounded_step_sends_the_constraint_and_reads_the_call_from_its_text() -> None:
    import httpx

    from tests.unit.engine_fakes import TASK, engine, generate, inference

    requests: list[httpx.Request] = []
    call = '<tool_call>{"name": "lookup_customer", "arguments": {"customer_id": "C115"}}' \
           "</tool_call>"
    inf = inference(engine(_text_stream(call), requests), grounded_arguments=True)
    res = await generate(inf)
    sent = json.loads(requests[0].content)
    # the prompt's tools are the profile's own (the cached prefix does not change) ...
    assert sent["tools"] == request_tools(get_profile("ticket-triage"), None)
    # ... and the grammar lists the task's customer id as the only one
    tag = json.loads(sent["structured_outputs"]["structural_tag"])
    lookup = next(t for t in tag["format"]["tags"] if '"lookup_customer"' in t["begin"])
    assert lookup["content"]["json_schema"]["properties"]["customer_id"]["enum"] == \
        [TASK["customer_id"]]
    assert sent["tool_choice"] == "none"
    assert res.content == "" and [c.function.name for c in res.tool_calls] == ["lookup_customer"]
    assert json.loads(res.tool_calls[0].function.arguments) == {"customer_id": "C115"}


async def test_a_grounded_step_cut_short_is_text_without_a_call() -> None:
    from tests.unit.engine_fakes import engine, generate, inference

    cut = '<tool_call>{"name": "lookup_customer", "arguments": {"custo'
    res = await generate(inference(engine(_text_stream(cut)), grounded_arguments=True))
    assert res.tool_calls == [] and res.content == cut


async def test_without_grounding_the_request_is_as_before() -> None:
    import httpx

    from tests.unit.engine_fakes import engine, generate, inference

    requests: list[httpx.Request] = []
    await generate(inference(engine(requests=requests)))
    sent = json.loads(requests[0].content)
    assert sent["tool_choice"] == "required" and "structured_outputs" not in sent


def test_grounding_is_on_by_default_only_for_the_demo_model() -> None:
    from pathlib import Path

    from warmloop.workers.settings import Settings

    assert Settings(engine_model="demo").grounds_arguments
    assert not Settings(engine_model="tiny").grounds_arguments
    assert not Settings(engine_model="demo", model_path=Path("/m")).grounds_arguments
    assert Settings(engine_model="tiny", grounded_arguments=True).grounds_arguments
    assert not Settings(engine_model="demo", grounded_arguments=False).grounds_arguments


def test_the_gpu_trained_demo_model_is_served_from_its_artifact_and_grounded() -> None:
    from pathlib import Path

    from warmloop.infra.demo_model import ARTIFACT_DIR, GPU_ARTIFACT_DIR
    from warmloop.workers.settings import Settings

    gpu = Settings(engine_model="demo-gpu")
    assert gpu.resolved_model_path == GPU_ARTIFACT_DIR != ARTIFACT_DIR
    assert gpu.serves_demo_model and gpu.grounds_arguments
    assert Settings(engine_model="demo").resolved_model_path == ARTIFACT_DIR
    assert not Settings(engine_model="demo-gpu", model_path=Path("/m")).serves_demo_model
