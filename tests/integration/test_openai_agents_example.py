"""The OpenAI Agents SDK example (examples/openai_agents_support) on the real stack: its
own worker, set up with ``warmloop_agents_plugin``, runs the support workflow (a tool
call, a person's review through a workflow Update, the final reply) with every model
call through warmloop's gateway to the embedded engines; every call after the first
finds its prefix cached, by the engines' own ``cached_tokens``."""

from __future__ import annotations

import asyncio
import json
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.polling import eventually
from warmloop.infra.stack import Stack
from warmloop.workers.openai_agents import gateway_base_url
from warmloop.workers.settings import Settings

pytestmark = pytest.mark.integration

EXAMPLE = Path(__file__).parent.parent.parent / "examples" / "openai_agents_support"


@pytest.fixture(scope="module")
def example() -> Iterator[None]:
    """The example project importable, as ``pip install -e`` would make it."""
    if str(EXAMPLE) not in sys.path:
        sys.path.insert(0, str(EXAMPLE))
    yield


async def _gateway_up(settings: Settings, timeout_s: float = 60.0) -> None:
    url = gateway_base_url(settings).removesuffix("/v1") + "/health"
    async with httpx.AsyncClient(timeout=2.0) as http:
        for _ in range(int(timeout_s / 0.5)):
            try:
                if (await http.get(url)).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            await asyncio.sleep(0.5)
    pytest.fail(f"warmloop's gateway is not serving at {url} (the stack's gateway part)")


async def test_the_agent_runs_with_a_review_and_every_call_after_the_first_is_cached(
        stack: Stack, settings: Settings, example: None) -> None:
    from openai_agents_support.worker import TASK_QUEUE, build_worker, connect
    from openai_agents_support.workflows import Review, SupportRequest, SupportWorkflow

    await _gateway_up(settings)
    client = await connect(settings)
    tag = uuid.uuid4().hex[:8]
    # The customer opens the agent's instructions: this case's prefix is on no engine
    # yet, so its first call is cold and every later hit is the session's own prefix
    # on the engine the gateway kept it on.
    request = SupportRequest(customer=f"Ada {tag}", question="Where is my order O1001?")
    async with build_worker(client):
        handle = await client.start_workflow(SupportWorkflow.run, request,
                                             id=f"oa-support-{tag}", task_queue=TASK_QUEUE)

        async def drafted() -> tuple[str] | None:  # (a draft may be empty text)
            draft = await handle.query(SupportWorkflow.draft)
            return None if draft is None else (draft,)

        (draft,) = await eventually(drafted, attempts=240, interval_s=0.5)
        decided = await handle.execute_update(
            SupportWorkflow.review, Review(approved=True, reviewer="ann", note="Send it."))
        outcome = await asyncio.wait_for(handle.result(), timeout=300)

    # the review step: the workflow waited for it and went on with the decision
    assert decided == draft == outcome.draft
    assert outcome.review == Review(approved=True, reviewer="ann", note="Send it.")
    # the tool ran (the model's order id is random, so found or not)
    assert outcome.tool_outputs, outcome
    assert all("order_id" in json.loads(o) for o in outcome.tool_outputs)
    # lookup, draft, and the reply after the review, at least
    calls = outcome.model_calls
    assert len(calls) >= 3, calls
    assert calls[0].cached_tokens == 0, calls
    assert all(c.cached_tokens > 0 for c in calls[1:]), calls
