from warmloop.workflows.budgets import JobLimits, Usage, remaining_text
from warmloop.workflows.contracts import ChatMessage, FunctionCall, ToolCall
from warmloop.workflows.profiles import get_profile
from warmloop.workflows.prompt import assemble_prompt, stable_prefix_hash

TRIAGE = get_profile("ticket-triage")
TASK = TRIAGE.validate_task({"ticket_id": "T1001", "customer_id": "C100", "subject": "s",
                             "body": "b"})


def _turn(i: int) -> list[ChatMessage]:
    call = ToolCall(id=f"c{i}", function=FunctionCall(name="search_kb",
                                                      arguments='{"topic":"login"}'))
    return [ChatMessage(role="assistant", tool_calls=[call]),
            ChatMessage(role="tool", tool_call_id=f"c{i}", content=f"result {i}")]


def test_stable_prefix_first_then_task_then_transcript_then_tail() -> None:
    transcript = _turn(1)
    tail = remaining_text(JobLimits(max_steps=8), Usage(steps=1), 0.0)
    msgs = assemble_prompt(TRIAGE, TASK, transcript, tail=tail)
    assert msgs[0] == ChatMessage(role="system", content=TRIAGE.system_prompt)
    assert msgs[1].role == "user" and "T1001" in msgs[1].content
    assert msgs[2:4] == transcript
    assert msgs[-1].content.startswith("Step 2 of 8")


def test_each_step_extends_the_previous_prompt_except_its_tail() -> None:
    transcript: list[ChatMessage] = []
    previous = None
    for step in range(1, 6):
        msgs = assemble_prompt(TRIAGE, TASK, transcript, tail=f"Step {step} of 8.")
        if previous is not None:
            assert msgs[: len(previous) - 1] == previous[:-1]
        previous = msgs
        transcript = transcript + _turn(step)


def test_nothing_volatile_in_the_stable_part() -> None:
    a = assemble_prompt(TRIAGE, TASK, [], tail=remaining_text(JobLimits(), Usage(), 0.0))
    b = assemble_prompt(TRIAGE, TASK, [], tail=remaining_text(
        JobLimits(max_steps=9, max_total_tokens=900), Usage(steps=6, prompt_tokens=100), 5.0))
    assert a[:-1] == b[:-1] and a[-1] != b[-1]
    assert stable_prefix_hash(TRIAGE) == stable_prefix_hash(get_profile("ticket-triage"))


def test_tool_schemas_are_built_once_and_handed_out_as_copies() -> None:
    profile = get_profile("ticket-triage")
    first = profile.tool_schemas()
    first[0]["function"]["parameters"]["properties"].clear()  # a caller edits its copy
    again = profile.tool_schemas()
    assert again != first and again[0]["function"]["parameters"]["properties"]
    spec = profile.tool(again[0]["function"]["name"])
    assert again[0] == spec._build_openai_schema()  # the cached one is the built one
