"""The trace format of `warmloop replay`: every bad line is named with its field; inline
prompts are content-addressed; scripts and digests are deterministic."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from warmloop.workers.cli import app
from warmloop.workers.replay import arrival_problem, prepare
from warmloop.workflows.trace import (
    TraceError,
    inline_prompts,
    parse_trace,
    prompt_digest,
    replay_script,
    trace_profile,
)

TICKET = {"ticket_id": "T1001", "customer_id": "C100", "subject": "crash", "body": "it crashes"}


def step(name: str = "lookup_customer", args: Any = None, **kw: Any) -> dict[str, Any]:
    return {"call": {"name": name, "arguments": {"customer_id": "C100"} if args is None
                     else args}, "result": "ok", "pause_s": 1.0, "output_tokens": 20, **kw}


PROFILE_LINE = {"profile": "ticket-triage", "task": TICKET,
                "steps": [step(), step("finish", {"resolution": "resolved", "priority": "low"})]}
INLINE_LINE = {"system_prompt": "You are a careful agent.", "task": "do the thing",
               "steps": [step("fetch", {"id": 1}, pause_s=4.0), step("fetch", {"id": 2}),
                         step("done", {})]}


def lines(*objs: Any) -> list[str]:
    return [o if isinstance(o, str) else json.dumps(o) for o in objs]


def error_of(*objs: Any) -> str:
    with pytest.raises(TraceError) as e:
        parse_trace(lines(*objs))
    return str(e.value)


def test_good_lines_parse_with_their_line_numbers() -> None:
    jobs = parse_trace(lines(PROFILE_LINE, "", "  ", INLINE_LINE))
    assert [n for n, _ in jobs] == [1, 4]
    assert jobs[1][1].task_object == {"text": "do the thing"}
    assert jobs[0][1].steps[0].call.arguments_text() == '{"customer_id": "C100"}'


@pytest.mark.parametrize(("bad", "message"), [
    ({**PROFILE_LINE, "steps": [step(output_tokens=0)]},
     "line 2: steps.0.output_tokens: Input should be greater than or equal to 1"),
    ({**PROFILE_LINE, "steps": [step(pause_s=-1)]},
     "line 2: steps.0.pause_s: Input should be greater than or equal to 0"),
    ({k: v for k, v in PROFILE_LINE.items() if k != "task"}, "line 2: task: Field required"),
    ({**PROFILE_LINE, "surprise": 1}, "line 2: surprise: Extra inputs are not permitted"),
    ({**PROFILE_LINE, "steps": []}, "line 2: steps: List should have at least 1 item"),
    ({**PROFILE_LINE, "steps": [{**step(), "call": {"arguments": {}}}]},
     "line 2: steps.0.call.name: Field required"),
    ({**PROFILE_LINE, "steps": [step(args=7)]},
     "line 2: steps.0.call.arguments: must be a JSON object or the call's raw JSON text"),
    ({**PROFILE_LINE, "system_prompt": "x"}, "line 2: give exactly one of profile"),
    ({"task": TICKET, "steps": [step()]}, "line 2: give exactly one of profile"),
    ({**PROFILE_LINE, "task": "text"}, "line 2: task: must be a JSON object for a profile"),
    ({**INLINE_LINE, "task": 3}, "line 2: task: must be a JSON object or a non-empty string"),
    ({**INLINE_LINE, "tools": [{"type": "function", "function": {"name": "fetch"}}]},
     "line 2: steps.2.call.name: 'done' is not one of the line's tools (fetch)"),
    ({**INLINE_LINE, "tools": [{"type": "function", "function": {}}]},
     "line 2: tools.0.function.name: Field required"),
    ({**PROFILE_LINE, "tools": [{"type": "function", "function": {"name": "x"}}]},
     "line 2: tools: only with system_prompt"),
    ('{"profile": "ticket-triage",', "line 2: not valid JSON"),
    ("[1, 2]", "line 2: must be one JSON object, got list"),
])
def test_a_bad_line_is_named_with_its_field(bad: Any, message: str) -> None:
    assert error_of(PROFILE_LINE, bad).startswith(message)


def test_every_bad_line_is_counted_and_an_empty_trace_refused() -> None:
    with pytest.raises(TraceError) as e:
        parse_trace(lines("{", PROFILE_LINE, "[]"))
    assert e.value.errors[0].startswith("line 1:") and e.value.errors[1].startswith("line 3:")
    assert str(e.value).endswith("(and 1 more bad line(s))")
    assert error_of("", " ") == "the trace has no jobs"


def test_inline_prompts_are_shared_and_content_addressed() -> None:
    other = {**INLINE_LINE, "system_prompt": "Another agent."}
    jobs = parse_trace(lines(INLINE_LINE, PROFILE_LINE, INLINE_LINE, other))
    prompts = inline_prompts(jobs)
    assert sorted(prompts) == [1, 3, 4]
    assert prompts[1] is prompts[3] and prompts[1].name != prompts[4].name
    p = prompts[1]
    assert p.name.startswith("trace:") and len(p.name) == len("trace:") + 16
    # the same lines in another order: the same prompt, the same name
    assert p.name == inline_prompts(parse_trace(lines(other, INLINE_LINE, INLINE_LINE)))[2].name
    # no schemas given: every tool the trace calls, open parameters, in name order
    assert [t["function"]["name"] for t in p.tools] == ["done", "fetch"]
    assert p.finish_tools == ["done"]
    assert p.pauses == {"fetch": (2.5, 4.0)}  # median, p90 of the pauses after fetch


def test_an_inline_prompt_becomes_a_profile_with_its_own_schemas() -> None:
    schema = {"type": "function", "function": {"name": "fetch", "description": "get one",
                                               "parameters": {"type": "object", "properties": {
                                                   "id": {"type": "integer"}}}}}
    line = {**INLINE_LINE, "tools": [schema, {"type": "function",
                                              "function": {"name": "done"}}]}
    [(n, job)] = parse_trace(lines(line))
    prompt = inline_prompts([(n, job)])[n]
    profile = trace_profile(prompt.name, prompt)
    assert profile.system_prompt == "You are a careful agent."
    assert profile.tool_schemas()[1] == schema and profile.tool_schemas(["done"]) == [
        {"type": "function", "function": {"name": "done"}}]
    assert profile.validate_task({"text": "x", "more": 1}).model_dump() == {"text": "x",
                                                                            "more": 1}
    assert profile.tool("fetch").pause_median_s == 2.5  # pauses 4.0 and 1.0
    assert profile.tool("fetch").pause_p90_s == 4.0
    assert profile.tool("done").finishes_job


def test_a_script_carries_the_recorded_calls_and_ends_without_a_pause() -> None:
    [(_, job)] = parse_trace(lines(INLINE_LINE))
    script = replay_script(job, ["tool:fetch", "tool:fetch", "tool:done"])
    assert [s.call.id for s in script.steps] == ["call-1", "call-2", "call-3"]
    assert [s.pause_s for s in script.steps] == [4.0, 1.0, 0.0]
    assert [s.pause_kind for s in script.steps] == ["tool:fetch", "tool:fetch", ""]
    assert script.steps[0].call.function.arguments == '{"id": 1}'


def test_a_digest_depends_on_the_hashes_not_their_order() -> None:
    a = [(1, 1, "aa"), (1, 2, "bb"), (3, 1, "cc")]
    assert prompt_digest(a) == prompt_digest(list(reversed(a)))
    assert prompt_digest(a) != prompt_digest([*a[:2], (3, 1, "cd")])


def test_prepare_checks_profiles_and_derives_what_each_job_waits_on() -> None:
    urgent = {**PROFILE_LINE, "steps": [step(), step("set_priority", {"priority": "urgent"}),
                                        step("finish", {"resolution": "escalated",
                                                        "priority": "urgent"})]}
    trace = prepare(parse_trace(lines(urgent, INLINE_LINE)), "t.jsonl")
    (n1, j1), (n2, j2) = trace.jobs
    assert j1.replay is not None and j2.replay is not None
    assert [s.pause_kind for s in j1.replay.steps] == [
        "tool:lookup_customer", "approval:urgent_priority", ""]
    assert j1.limits is not None and j1.limits.max_steps == 3
    assert j1.limits.max_wall_time_s is None and j1.limits.max_total_tokens is None
    assert j2.profile == trace.prompts[0].name and len(trace.prompts) == 1
    assert trace.steps == 6
    with pytest.raises(TraceError, match="line 1: profile: unknown profile 'nope'"):
        prepare(parse_trace(lines({**PROFILE_LINE, "profile": "nope"})), "t")
    with pytest.raises(TraceError, match="line 1: task.ticket_id: String should match"):
        prepare(parse_trace(lines({**PROFILE_LINE, "task": {**TICKET, "ticket_id": "x"}})),
                "t")


def test_the_cli_refuses_a_bad_trace_before_it_connects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WARMLOOP_TEMPORAL_ADDRESS", "127.0.0.1:1")
    bad = tmp_path / "t.jsonl"
    bad.write_text("\n".join(lines(PROFILE_LINE, {**PROFILE_LINE, "steps": [step(
        output_tokens=0)]})))
    out = CliRunner().invoke(app, ["replay", str(bad)])
    assert out.exit_code == 1
    assert "line 2: steps.0.output_tokens" in out.output
    assert "Traceback" not in out.output and "cannot reach Temporal" not in out.output
    good = tmp_path / "g.jsonl"
    good.write_text(json.dumps(PROFILE_LINE))
    out = CliRunner().invoke(app, ["replay", str(good), "--routing", "random"])
    assert out.exit_code == 1 and "--routing 'random'" in out.output


def test_recorded_arrivals_and_lanes_carry_into_the_replay() -> None:
    """Arrivals count from the earliest line (any clock the trace shares); a batch line
    runs in the batch lane; one line without an arrival leaves the trace to a window."""
    batch = {**INLINE_LINE, "arrival_s": 1_700_000_012.5, "lane": "batch"}
    trace = prepare(parse_trace(lines({**PROFILE_LINE, "arrival_s": 1_700_000_010.0}, batch,
                                      {**PROFILE_LINE, "arrival_s": 1_700_000_011.0})), "t")
    assert trace.arrivals == [0.0, 2.5, 1.0]
    assert [j.lane for _, j in trace.jobs] == ["interactive", "batch", "interactive"]
    assert arrival_problem(trace) is None
    partial = prepare(parse_trace(lines({**PROFILE_LINE, "arrival_s": 3.0}, PROFILE_LINE)), "t")
    assert partial.arrivals is None
    assert "arrival_s" in (arrival_problem(partial) or "")
    assert "arrival_s: Input should be greater than or equal to 0" in error_of(
        {**PROFILE_LINE, "arrival_s": -1})
    assert "lane: Input should be 'interactive' or 'batch'" in error_of(
        {**PROFILE_LINE, "lane": "express"})


def test_a_lines_tenant_carries_into_its_replayed_job() -> None:
    """Tenants' prompts share no cache in production (each tenant's requests carry its
    salt): a replay that ran them all as the default tenant would share them."""
    trace = prepare(parse_trace(lines({**PROFILE_LINE, "tenant": "acme"}, PROFILE_LINE)), "t")
    assert [j.tenant for _, j in trace.jobs] == ["acme", "default"]
    assert "line 1: tenant: String should match pattern" in error_of(
        {**PROFILE_LINE, "tenant": "Acme/Corp"})


def test_the_cli_refuses_arrivals_a_trace_lacks_before_it_connects(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("WARMLOOP_TEMPORAL_ADDRESS", "127.0.0.1:1")
    t = tmp_path / "t.jsonl"
    t.write_text("\n".join(lines({**PROFILE_LINE, "arrival_s": 0}, PROFILE_LINE)))
    out = CliRunner().invoke(app, ["replay", str(t), "--arrivals"])
    assert out.exit_code == 1 and "--arrivals needs every line's arrival_s" in out.output
    assert "cannot reach Temporal" not in out.output
