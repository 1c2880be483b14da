"""run_tool for function and HTTP tools: results the model reads, retries for what is
transient, the response cap, and side effects applied once per (job, step)."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Annotated, Any, Literal

import httpx
import pytest
from pydantic import BaseModel, ConfigDict, Field
from temporalio.exceptions import ApplicationError
from temporalio.testing import ActivityEnvironment

from tests.ledger_redis import LedgerRedis
from warmloop import Profile, ToolContext, ToolSpec, tool
from warmloop.activities.tools import EffectLedger, ToolActivities
from warmloop.workflows.contracts import ToolRequest
from warmloop.workflows.profiles import REGISTRY, HttpRunner

CALLS: list[dict[str, Any]] = []


@tool(side_effect=True)
def charge(amount: Annotated[int, Field(ge=1, le=100)], ctx: ToolContext) -> dict[str, Any]:
    """Charge the customer."""
    CALLS.append({"amount": amount, "key": ctx.idempotency_key})
    return {"charged": amount}


@tool
async def look(key: Literal["a", "b"]) -> str:
    """Look a key up."""
    if key == "b":
        raise RuntimeError("backend flaked")
    return f"value of {key}"


class Task(BaseModel):
    id: str


class Key(BaseModel):
    model_config = ConfigDict(extra="forbid")
    key: Literal["a", "b", "big", "e400", "e503"]


def _http(side_effect: bool) -> ToolSpec:
    return ToolSpec("fetch", "Fetch a record.", Key, side_effect=side_effect,
                    runner=HttpRunner(url="http://tools.test/fetch", max_response_bytes=100,
                                      headers=(("X-Api-Key", "k"),)))


PROFILE = Profile(name="runner-test", system_prompt="s", task_model=Task, max_tool_output_chars=500,
                  tools=(charge.spec, look.spec, _http(False),
                         ToolSpec("done", "done", Key, finishes_job=True)))
PROFILE_FX = Profile(name="runner-test-fx", system_prompt="s", task_model=Task,
                     tools=(_http(True), ToolSpec("done", "done", Key, finishes_job=True)))


SEEN: list[httpx.Request] = []


def _service(request: httpx.Request) -> httpx.Response:
    SEEN.append(request)
    key = json.loads(request.content)["key"]
    match key:
        case "big":
            return httpx.Response(200, text="x" * 1000)
        case "e400":
            return httpx.Response(404, text="no such record")
        case "e503":
            return httpx.Response(503, text="overloaded")
        case "b":
            return httpx.Response(302, headers={"Location": "http://elsewhere.test/"})
    return httpx.Response(200, json={"record": key})


@pytest.fixture(autouse=True)
def registered() -> Iterator[None]:
    REGISTRY.add(PROFILE, source="test")
    REGISTRY.add(PROFILE_FX, source="test")
    CALLS.clear()
    SEEN.clear()
    yield
    REGISTRY.remove(PROFILE.name)
    REGISTRY.remove(PROFILE_FX.name)


@pytest.fixture
def acts() -> ToolActivities:
    http = httpx.AsyncClient(transport=httpx.MockTransport(_service))
    return ToolActivities([], EffectLedger(LedgerRedis()), s3=None, bucket="b",  # type: ignore[arg-type]
                          http=http)


def _req(name: str, profile: str = PROFILE.name, step: int = 3, **args: Any) -> ToolRequest:
    return ToolRequest(job_id="j1", step=step, profile=profile, task_id="T1", name=name,
                       arguments=args)


async def test_a_function_tool_runs_with_its_context(acts: ToolActivities) -> None:
    r = await ActivityEnvironment().run(acts.run_tool, _req("charge", amount=7))
    assert r.ok and json.loads(r.output) == {"charged": 7}
    assert CALLS == [{"amount": 7, "key": "j1:3:charge"}]


async def test_a_side_effect_function_is_not_called_again_on_retry(acts: ToolActivities) -> None:
    env = ActivityEnvironment()
    first = await env.run(acts.run_tool, _req("charge", amount=7))
    again = await env.run(acts.run_tool, _req("charge", amount=7))  # a retry: same job, step
    assert again == first and len(CALLS) == 1
    await env.run(acts.run_tool, _req("charge", step=4, amount=7))  # a new call
    assert len(CALLS) == 2


async def test_an_async_function_tool_that_raises_fails_the_attempt(
        acts: ToolActivities) -> None:
    r = await ActivityEnvironment().run(acts.run_tool, _req("look", key="a"))
    assert r.ok and r.output == "value of a"
    # a plain exception: Temporal retries the activity per the tool's retry policy
    with pytest.raises(RuntimeError, match="backend flaked"):
        await ActivityEnvironment().run(acts.run_tool, _req("look", key="b"))


async def test_http_tool_2xx_4xx_5xx_and_the_size_cap(acts: ToolActivities) -> None:
    env = ActivityEnvironment()
    ok = await env.run(acts.run_tool, _req("fetch", key="a"))
    assert ok.ok and json.loads(ok.output) == {"record": "a"}
    assert SEEN[-1].headers["X-Api-Key"] == "k" and "Idempotency-Key" not in SEEN[-1].headers
    bad = await env.run(acts.run_tool, _req("fetch", key="e400"))
    assert not bad.ok and bad.output == "HTTP 404: no such record"  # the model reads it
    with pytest.raises(ApplicationError, match="HTTP 503") as e:
        await env.run(acts.run_tool, _req("fetch", key="e503"))
    assert e.value.type == "ToolUnavailable" and not e.value.non_retryable
    assert "tools.test" not in str(e.value)  # a URL may carry a key; this reaches the prompt
    big = await env.run(acts.run_tool, _req("fetch", key="big"))
    assert not big.ok and "larger than 100 bytes" in big.output
    moved = await env.run(acts.run_tool, _req("fetch", key="b"))
    assert not moved.ok and "HTTP 302 redirect not followed" in moved.output


async def test_http_side_effect_tools_send_an_idempotency_key_and_apply_once(
        acts: ToolActivities) -> None:
    env = ActivityEnvironment()
    first = await env.run(acts.run_tool, _req("fetch", profile=PROFILE_FX.name, key="a"))
    assert SEEN[-1].headers["Idempotency-Key"] == "j1:3:fetch"
    again = await env.run(acts.run_tool, _req("fetch", profile=PROFILE_FX.name, key="a"))
    assert again == first and len(SEEN) == 1


async def test_an_http_tool_that_is_down_fails_the_attempt(acts: ToolActivities) -> None:
    def down(request: httpx.Request) -> httpx.Response:
        raise httpx.ConnectError("connection refused", request=request)

    acts._http = httpx.AsyncClient(transport=httpx.MockTransport(down))
    with pytest.raises(httpx.ConnectError):
        await ActivityEnvironment().run(acts.run_tool, _req("fetch", key="a"))


async def test_an_unknown_tool_is_not_retried(acts: ToolActivities) -> None:
    with pytest.raises(ApplicationError) as e:
        await ActivityEnvironment().run(acts.run_tool, _req("nope"))
    assert e.value.non_retryable
