"""Grounded arguments on a real engine (the session's random-weight model): through
vLLM's own guided decoding, every id argument the model writes is one the job's text
holds, the prompt is the one the same step sends without grounding (its prefix stays
cached), and the call comes back as a call."""

from __future__ import annotations

import json
import re
import uuid

import httpx
import pytest
from temporalio.testing import ActivityEnvironment

from warmloop.activities.inference import InferenceActivities
from warmloop.activities.transcripts import TranscriptStore
from warmloop.infra.stack import Stack
from warmloop.workers.clients import build_s3
from warmloop.workers.demo import bundled_tasks
from warmloop.workers.settings import Settings
from warmloop.workflows.contracts import GenerateRequest, GenerateResult

pytestmark = pytest.mark.integration

INVOICE = "invoice-reconciliation"
IDS = re.compile(r"\b(?:INV|PO|V)[0-9]+\b")
# the tools whose every argument is an id or an enum: a call of one is bounded in length
ID_TOOLS = ["fetch_invoice", "fetch_purchase_order", "compare_lines", "flag_discrepancy"]


async def test_grounded_steps_name_only_ids_of_the_job_and_keep_the_prompt(
        stack: Stack, settings: Settings) -> None:
    engine = settings.engine_endpoints[0]
    tasks = bundled_tasks(INVOICE)[:12]
    env = ActivityEnvironment()
    async with httpx.AsyncClient(timeout=httpx.Timeout(60.0, connect=5.0)) as http:
        def activities(grounded: bool) -> InferenceActivities:
            return InferenceActivities(
                engine_id=engine.id, base_url=engine.url, model=engine.model, http=http,
                transcripts=TranscriptStore(build_s3(settings), settings.s3_bucket),
                grounded_arguments=grounded)

        grounded, free = activities(True), activities(False)

        async def step(acts: InferenceActivities, task: dict[str, object]) -> GenerateResult:
            req = GenerateRequest(job_id=f"grounding-{uuid.uuid4().hex[:8]}", step=1,
                                  profile=INVOICE, task=task, base_len=0, tools=ID_TOOLS,
                                  tail="Budget: 5 steps left.", max_tokens=160)
            res: GenerateResult = await env.run(acts.generate, req)
            return res

        named: list[str] = []
        for task in tasks:
            res = await step(grounded, task)
            assert res.content == "" and len(res.tool_calls) == 1, (res.content, res.tool_calls)
            args = json.loads(res.tool_calls[0].function.arguments)
            ids = [v for v in args.values() if isinstance(v, str) and IDS.fullmatch(v)]
            # whatever the (random) model chose to call, its ids are the task's own
            assert all(v in task.values() for v in ids), (task, res.tool_calls)
            named += ids
            # the same step without grounding sends the same prompt: it is all cached
            again = await step(free, task)
            assert again.prompt_tokens == res.prompt_tokens
            # all but its last partial block (at most 256 tokens: the engines' block size)
            assert again.cached_tokens >= res.prompt_tokens - 256, (again, res)
        assert len(named) >= len(tasks), named  # every offered tool takes an id
