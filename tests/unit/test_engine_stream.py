"""The engine's SSE stream, read by ``generate``: whatever goes wrong inside a 200
stream is the engine's failure (an ``EngineError``, retried then failed over), never
the model's (an invalid tool call), and tokens the engine reported come with it."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from temporalio.exceptions import ApplicationError

from tests.unit.engine_fakes import (
    GOOD_STREAM,
    USAGE,
    CutStream,
    call_chunks,
    engine,
    generate,
    inference,
    role_chunk,
    sse,
    step_request,
    usage_chunk,
)

ENGINE_ERROR = "EngineError"  # the type generate has always given a failing engine (5xx)


async def engine_error(stream: bytes | Any) -> ApplicationError:
    with pytest.raises(ApplicationError) as err:
        await generate(inference(engine(stream)))
    assert err.value.type == ENGINE_ERROR, err.value
    assert not err.value.non_retryable  # retried, then failed over by the workflow
    return err.value


def reported(err: ApplicationError) -> dict[str, Any]:
    """The usage the engine reported before it failed (the error's first detail: the
    step's attempts' spend, here one attempt's)."""
    assert err.details, "the error carries the step's usage"
    detail = err.details[0]
    assert isinstance(detail, dict) and detail["attempts"] == 1
    return {k: detail[k] for k in ("prompt_tokens", "cached_tokens", "completion_tokens")}


async def test_a_whole_stream_is_a_step() -> None:
    result = await generate(inference(engine(GOOD_STREAM)))
    assert [c.function.name for c in result.tool_calls] == ["search_kb"]
    assert result.tool_calls[0].function.arguments == '{"topic": "crash"}'
    assert (result.prompt_tokens, result.cached_tokens, result.completion_tokens) == (300, 256,
                                                                                      12)


async def test_an_error_event_inside_a_200_stream_is_an_engine_error() -> None:
    # vLLM writes an error it meets mid-stream as a data event, then [DONE]
    err = await engine_error(sse(role_chunk(), call_chunks()[0],
                                 {"error": {"message": "engine core died", "type":
                                            "InternalServerError", "code": 500}}, "[DONE]"))
    assert "engine core died" in err.message
    # older vLLM: the error object itself, and the SSE `event: error` form
    await engine_error(sse(role_chunk(), {"object": "error", "message": "boom",
                                          "type": "InternalServerError", "code": 500}))
    await engine_error(sse(role_chunk()) + b"event: error\n" + sse({"message": "overloaded"}))


async def test_usage_reported_before_an_error_event_is_counted() -> None:
    err = await engine_error(sse(role_chunk(), *call_chunks(), usage_chunk(),
                                 {"error": {"message": "detokenizer failed"}}, "[DONE]"))
    assert reported(err) == {"prompt_tokens": 300, "cached_tokens": 256,
                             "completion_tokens": 12}


async def test_a_stream_cut_before_done_is_an_engine_error() -> None:
    # the body ends cleanly, but without [DONE]
    err = await engine_error(sse(role_chunk(), *call_chunks(), usage_chunk()))
    assert reported(err)["prompt_tokens"] == USAGE["prompt_tokens"]
    # the connection drops mid-body
    err = await engine_error(lambda: CutStream(sse(role_chunk(), call_chunks()[0])))
    assert reported(err) == {"prompt_tokens": 0, "cached_tokens": 0, "completion_tokens": 0}


async def test_a_stream_without_usage_is_an_engine_error() -> None:
    err = await engine_error(sse(role_chunk(), *call_chunks(), "[DONE]"))
    assert "usage" in err.message


async def test_non_json_data_is_an_engine_error() -> None:
    err = await engine_error(sse(role_chunk(), "{not json", *call_chunks(), usage_chunk(),
                                 "[DONE]"))
    assert "JSON" in err.message or "json" in err.message


@pytest.mark.parametrize("chunk", [
    5, "text", None, [1, 2], {"choices": 5}, {"choices": [5]}, {"choices": [{"delta": "x"}]},
    {"choices": [{"delta": {"content": 7}}]},
    {"choices": [{"delta": {"tool_calls": [{"index": "zero", "function": {"name": 1}}]}}]},
    {"choices": [{"delta": {"tool_calls": 3}}]},
    {"usage": {"prompt_tokens": "many"}}, {"usage": {"prompt_tokens": -1}},
    {"usage": {"prompt_tokens": 1, "prompt_tokens_details": {"cached_tokens": [1]}}},
    {"prompt_token_ids": "abc"},
])
async def test_malformed_chunks_are_engine_errors(chunk: Any) -> None:
    await engine_error(sse(role_chunk(), json.dumps(chunk), *call_chunks(), usage_chunk(),
                           "[DONE]"))


async def outcome(stream: bytes) -> str:
    """'ok', or the engine error's type; any other exception escapes (the test fails)."""
    try:
        await generate(inference(engine(stream)), timeout_s=5.0)
    except ApplicationError as e:
        assert e.type == ENGINE_ERROR and not e.non_retryable, e
        return e.type
    return "ok"


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.binary(max_size=2048))
def test_random_bytes_as_the_stream_are_a_clean_engine_error(stream: bytes) -> None:
    assert asyncio.run(outcome(stream)) == ENGINE_ERROR


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-5, 10**6) | st.floats(allow_nan=False)
    | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(
        st.sampled_from(["choices", "delta", "content", "tool_calls", "index", "function",
                         "name", "arguments", "usage", "prompt_tokens", "completion_tokens",
                         "prompt_tokens_details", "cached_tokens", "finish_reason",
                         "prompt_token_ids", "error", "object", "id"]), inner, max_size=4),
    max_leaves=12)
lines = st.one_of(json_values.map(lambda v: "data: " + json.dumps(v)),
                  st.just("data: [DONE]"), st.text(max_size=20), st.just(""),
                  st.just("event: error"))


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(lines, max_size=12))
def test_random_chunks_are_a_step_or_a_clean_engine_error(stream: list[str]) -> None:
    body = "\n".join(stream).encode()
    assert asyncio.run(outcome(body)) in ("ok", ENGINE_ERROR)


async def test_a_non_200_answer_is_still_sorted_by_status() -> None:
    def answer(status: int, text: str) -> httpx.MockTransport:
        return httpx.MockTransport(lambda r: httpx.Response(status, text=text))

    with pytest.raises(ApplicationError) as err:
        await generate(inference(answer(400, "maximum context length is 2048")))
    assert err.value.type == "ContextOverflow" and err.value.non_retryable
    with pytest.raises(ApplicationError) as err:
        await generate(inference(answer(503, "busy")))
    assert err.value.type == ENGINE_ERROR and not err.value.non_retryable


class CountingUsage:
    """A tenant's hour, as the inference worker adds to it."""

    def __init__(self) -> None:
        self.added: list[tuple[str, int]] = []

    async def add(self, tenant: str, tokens: int) -> None:
        self.added.append((tenant, tokens))


async def test_a_steps_retries_sum_what_each_failed_attempt_spent() -> None:
    """Temporal retries a step its engine failed: each attempt reads the earlier ones'
    spend from its heartbeat details, so the attempt that fails last reports them all
    (the workflow sees only that error) and the one that succeeds returns them; each
    failed attempt's tokens go onto the tenant's hour, at the engine's price."""
    import dataclasses

    from temporalio.testing import ActivityEnvironment

    from warmloop.workflows.contracts import AttemptSpend
    from warmloop.workflows.pricing import EnginePrice

    price = EnginePrice(input_usd_per_mtok=1.0, cached_input_usd_per_mtok=0.1,
                        output_usd_per_mtok=2.0)
    one_cost = price.cost(prompt_tokens=300, cached_tokens=256, completion_tokens=12)
    broken = sse(role_chunk(), *call_chunks(), usage_chunk(),
                 {"error": {"message": "detokenizer failed"}}, "[DONE]")
    usage = CountingUsage()

    async def attempt(stream: bytes, n: int, details: list[Any]) -> tuple[Any, list[Any]]:
        beats: list[Any] = []
        env = ActivityEnvironment()
        env.info = dataclasses.replace(env.info, attempt=n, heartbeat_details=details)
        env.on_heartbeat = lambda *d: beats.append(d)
        inf = inference(engine(stream), price=price, usage=usage)  # type: ignore[arg-type]
        try:
            out: Any = await asyncio.wait_for(env.run(inf.generate, step_request()), 10)
        except ApplicationError as e:
            assert e.type == ENGINE_ERROR and not e.non_retryable
            out = e
        assert await inf.drain(10) == 0
        return out, beats

    first, beats = await attempt(broken, 1, [])
    spent = AttemptSpend.model_validate(first.details[0])
    assert (spent.attempts, spent.prompt_tokens, spent.cached_tokens,
            spent.completion_tokens) == (1, 300, 256, 12)
    assert spent.cost_usd == pytest.approx(one_cost) and spent.unpriced_attempts == 0
    assert beats[-1] == (first.details[0],)  # beaten: Temporal hands it to the next attempt
    second, _ = await attempt(broken, 2, [first.details[0]])
    both = AttemptSpend.model_validate(second.details[0])
    assert (both.attempts, both.prompt_tokens, both.completion_tokens) == (2, 600, 24)
    assert both.cost_usd == pytest.approx(2 * one_cost)
    result, beats = await attempt(GOOD_STREAM, 3, [second.details[0]])
    assert result.failed_attempts == both
    assert (result.prompt_tokens, result.completion_tokens) == (300, 12)  # its own answer's
    # each attempt's own tokens onto the tenant's hour: two failed, one answered
    assert usage.added == [("default", 312)] * 3
    # a cut with no usage still counts as an attempt; a garbled detail counts as none
    cut, _ = await attempt(b"", 4, [{"attempts": "many"}])
    assert AttemptSpend.model_validate(cut.details[0]).attempts == 1


async def test_an_attempt_failing_otherwise_still_reports_the_earlier_attempts() -> None:
    """The engine refuses the retry (a 4xx: EngineRejected, not retried): the earlier
    attempts' spend goes with that last failure, the only error the workflow sees."""
    import dataclasses

    from temporalio.testing import ActivityEnvironment

    from warmloop.workflows.contracts import AttemptSpend

    earlier = AttemptSpend(attempts=1, prompt_tokens=300, cached_tokens=256,
                           completion_tokens=12)

    def refuse(request: httpx.Request) -> httpx.Response:
        return httpx.Response(422, text="bad request")

    env = ActivityEnvironment()
    env.info = dataclasses.replace(env.info, attempt=2, heartbeat_details=[earlier.model_dump()])
    inf = inference(httpx.MockTransport(refuse))
    with pytest.raises(ApplicationError) as err:
        await asyncio.wait_for(env.run(inf.generate, step_request()), 10)
    assert err.value.type == "EngineRejected" and err.value.non_retryable
    assert AttemptSpend.model_validate(err.value.details[0]) == earlier
