"""Ids and client-supplied fields that would reach S3 keys, Redis glob patterns, rich
markup or a visibility query are refused with one line before anything starts."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st
from typer.testing import CliRunner

from warmloop.workers.cli import app
from warmloop.workers.jobs import InvalidJobError, JobClient
from warmloop.workflows.budgets import Usage
from warmloop.workflows.contracts import MAX_ID_LEN, JobCarry, id_problem

TICKET = {"ticket_id": "T1001", "customer_id": "C100", "subject": "crash", "body": "x"}
runner = CliRunner()


@pytest.mark.parametrize("good", ["job-1", "ticket-triage-0a1b2c", "sched-x-2026-12-01T14:00:00Z",
                                  "a", "user@acme.io:42", "x" * MAX_ID_LEN])
def test_ids_that_name_a_job(good: str) -> None:
    assert id_problem("job", good) is None


@pytest.mark.parametrize(("bad", "says"), [
    ("", "empty"), ("x" * (MAX_ID_LEN + 1), "at most"), ("job*", "may hold only"),
    ("job?1", "may hold only"), ("[bold]x[/bold]", "may hold only"), ("a/b", "may hold only"),
    ("-job", "may hold only"), ("job one", "may hold only"), ("jöb", "may hold only"),
    ("x'; drop", "may hold only"), ("a\nb", "may hold only"),
])
def test_ids_that_cannot_are_refused_in_one_line(bad: str, says: str) -> None:
    problem = id_problem("job", bad)
    assert problem is not None and says in problem and "\n" not in problem


@given(st.text(max_size=300))
def test_an_accepted_id_is_safe_for_keys_globs_markup_and_queries(value: str) -> None:
    if id_problem("job", value) is None:
        assert 0 < len(value) <= MAX_ID_LEN
        assert not set(value) & set("*?[]'\"/\\ \n\t{}")
        assert value.isascii()


async def test_the_job_client_refuses_a_bad_id_and_a_carry_before_starting() -> None:
    client = JobClient(None)  # type: ignore[arg-type]  # nothing may be started
    with pytest.raises(InvalidJobError, match="may hold only"):
        await client.submit("ticket-triage", TICKET, job_id="job*")
    carry = JobCarry(transcript=[], stored_len=0, steps=[], usage=Usage(), engine=None,
                     invalid_streak=0, next_kind="plan", started_at="2026-01-01T00:00:00Z",
                     runs=1)
    with pytest.raises(InvalidJobError, match="continue-as-new only"):
        await client.submit("ticket-triage", TICKET, carry=carry)


@pytest.fixture
def no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARMLOOP_TEMPORAL_ADDRESS", "127.0.0.1:1")


@pytest.mark.usefixtures("no_stack")
@pytest.mark.parametrize("argv", [
    ["report", "--profile", "x' OR WorkflowType != '"],
    ["batch", "run", "in.jsonl", "--profile", "ticket-triage", "--batch-id", "b*"],
])
def test_the_cli_refuses_ids_that_would_reach_a_query_or_a_key(argv: list[str]) -> None:
    result = runner.invoke(app, argv)
    assert result.exit_code == 1, result.output
    assert "may hold only" in result.output
    assert "Traceback" not in result.output and "cannot reach Temporal" not in result.output
