"""A team's own agents on the real stack: the example project (examples/acme_support),
loaded by every warmloop process as a plugin, runs its three tool kinds end to end:
Python functions in warmloop's agent worker, an HTTP service the example starts, and
an activity served by the example's own worker on its own task queue."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from typing import Any

import pytest
from temporalio.client import Client
from temporalio.worker import Worker

from tests.integration.cli import warmloop
from warmloop import JobClient, JobResult, JobState
from warmloop.workflows.contracts import TERMINAL_STATES

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def returns_service(settings: object) -> Iterator[Any]:
    from acme_support import service

    server = service.serve(8765)  # the URL in acme-returns.yaml
    yield service
    server.shutdown()


def _tool_answers(result: JobResult, tool: str) -> list[str]:
    """What ``tool`` answered in the job (repairs of invalid calls, which never ran the
    tool, left out)."""
    ids = {c.id for m in result.transcript if m.tool_calls for c in m.tool_calls
           if c.function.name == tool}
    return [m.content for m in result.transcript if m.role == "tool" and m.tool_call_id in ids
            and not m.content.startswith("error: ")]


async def test_the_examples_three_tool_kinds_run_end_to_end(
        client: Client, returns_service: Any) -> None:
    from acme_support.worker import TASK_QUEUE, Refunds, SupportCase

    refunds = Refunds()
    jobs = JobClient(client)
    tag = uuid.uuid4().hex[:6]
    # Each job is offered one kind of tool and no finish tool, so every valid step
    # calls that kind (the tiny model's choices are random) until the step cap.
    specs = {
        "python": ("acme-orders", {"order_id": "O1001", "question": "where is it?"},
                   ["order_status", "add_note"]),
        "http": ("acme-returns", {"return_id": "R2001"}, ["lookup_return"]),
        "activity": ("acme-returns", {"return_id": "R2000"}, ["issue_refund"]),
    }
    async with Worker(client, task_queue=TASK_QUEUE, workflows=[SupportCase],
                      activities=[refunds.issue_refund]):
        ids = {kind: await jobs.submit(profile, task, tools=tools, max_steps=4,
                                       job_id=f"byo-{kind}-{tag}")
               for kind, (profile, task, tools) in specs.items()}
        results = dict(zip(ids, await asyncio.gather(*(jobs.result(i) for i in ids.values())),
                           strict=True))
    for kind, r in results.items():
        assert r.state in TERMINAL_STATES and r.state != JobState.ENGINE_UNAVAILABLE, (kind, r)
        assert len(r.steps) >= 2, (kind, r.reason)
        # the engine, not warmloop, reports what it served from its prefix cache
        assert sum(s.cached_tokens for s in r.steps[1:]) > 0, kind
    python_answers = (_tool_answers(results["python"], "order_status")
                      + _tool_answers(results["python"], "add_note"))
    assert python_answers and all(a.startswith(("{", "not found", "noted on"))
                                  for a in python_answers), python_answers
    http_answers = _tool_answers(results["http"], "lookup_return")
    assert http_answers and returns_service.STATS["lookups"] >= len(http_answers)
    assert all(a.startswith(("{", "HTTP 404")) for a in http_answers), http_answers
    refund_answers = _tool_answers(results["activity"], "issue_refund")
    assert refund_answers and refunds.calls == len(refund_answers)


async def test_a_teams_own_workflow_runs_a_warmloop_job_as_its_child(client: Client) -> None:
    from acme_support.worker import TASK_QUEUE, Refunds
    from acme_support.workflows import SupportCase, SupportCaseInput

    async with Worker(client, task_queue=TASK_QUEUE, workflows=[SupportCase],
                      activities=[Refunds().issue_refund]):
        out = await client.execute_workflow(
            SupportCase.run, SupportCaseInput(order_id="O1002", question="is it late?"),
            id=f"case-{uuid.uuid4().hex[:6]}", task_queue=TASK_QUEUE)
    # the random model may finish, hit the cap or ramble; the engine must have served it
    assert out.state in {"FINISHED", "LOOP_CAP", "INVALID_OUTPUT"} and out.steps >= 1, out


def test_the_cli_lists_the_examples_profiles_with_their_sources() -> None:
    out = warmloop("profiles")
    assert out.returncode == 0, out.stderr
    assert "acme-returns" in out.stdout and "acme-orders" in out.stdout
    assert "plugin module acme_support.profiles (WARMLOOP_PLUGINS)" in out.stdout


def test_the_cli_submits_an_example_job_and_refuses_a_bad_one(tmp_path: Any) -> None:
    good = tmp_path / "good.json"
    good.write_text(json.dumps({"return_id": "R2003"}))
    out = warmloop("submit", "acme-returns", "--input", str(good), "--max-steps", "1")
    assert out.returncode == 0 and "started job acme-returns-" in out.stdout, out.stderr
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"return_id": "X"}))
    out = warmloop("submit", "acme-returns", "--input", str(bad))
    assert out.returncode != 0 and "return_id" in out.stderr
