"""CLI errors are one clear line and start nothing. No server runs here: input is
checked before the CLI connects, and a missing stack is reported as such."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from warmloop.workers.cli import app

runner = CliRunner()
GOOD = {"ticket_id": "T1001", "customer_id": "C100", "subject": "crash", "body": "it crashes"}


def _write(tmp_path: Path, obj: object) -> Path:
    p = tmp_path / "in.json"
    p.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return p


@pytest.fixture(autouse=True)
def no_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    # A port nothing listens on: any attempt to reach Temporal fails fast.
    monkeypatch.setenv("WARMLOOP_TEMPORAL_ADDRESS", "127.0.0.1:1")


@pytest.mark.parametrize(
    ("profile", "content", "message"),
    [
        ("nope", GOOD, "unknown profile 'nope'"),
        ("ticket-triage", {**GOOD, "ticket_id": "x"}, "ticket_id"),
        ("ticket-triage", {**GOOD, "surprise": 1}, "surprise"),
        ("ticket-triage", "{not json", "is not valid JSON"),
        ("ticket-triage", [GOOD], "must hold one JSON object"),
    ],
)
def test_invalid_input_is_refused_before_anything_starts(
    tmp_path: Path, profile: str, content: object, message: str
) -> None:
    result = runner.invoke(app, ["submit", profile, "--input", str(_write(tmp_path, content))])
    assert result.exit_code == 1
    assert message in result.output
    assert "Traceback" not in result.output
    # refused before connecting: the "stack not running" error would say so otherwise
    assert "cannot reach Temporal" not in result.output


def test_missing_stack_is_one_clear_line(tmp_path: Path) -> None:
    result = runner.invoke(app, ["submit", "ticket-triage", "--input",
                                 str(_write(tmp_path, GOOD))])
    assert result.exit_code == 1
    assert "cannot reach Temporal at 127.0.0.1:1" in result.output
    assert "warmloop dev up" in result.output
    assert "Traceback" not in result.output


def test_missing_input_file(tmp_path: Path) -> None:
    result = runner.invoke(app, ["submit", "ticket-triage", "--input",
                                 str(tmp_path / "absent.json")])
    assert result.exit_code == 1 and "cannot read" in result.output


def test_a_result_names_its_failed_attempts_beside_the_steps(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A step's failed attempts are in the job's tokens and cost but not in the step's
    row (its answer's figures): the result says how many and what they spent."""
    from rich.console import Console

    from warmloop.workers import cli
    from warmloop.workflows.budgets import Usage
    from warmloop.workflows.contracts import AttemptSpend, JobResult, JobState, StepRecord

    out = Console(record=True, width=200)
    monkeypatch.setattr(cli, "console", out)
    step = StepRecord(step=1, engine_id="e0", route_reason="prefix", tool="search_kb",
                      valid=True, prompt_tokens=300, cached_tokens=256, completion_tokens=12,
                      ttft_ms=40.0, latency_ms=90.0, failed_attempts=AttemptSpend(
                          attempts=2, prompt_tokens=600, completion_tokens=20,
                          cost_usd=0.0012))
    res = JobResult(job_id="j1", profile="ticket-triage", state=JobState.LOOP_CAP,
                    reason="step cap", steps=[step], transcript=[],
                    usage=Usage(steps=1, prompt_tokens=900, completion_tokens=32,
                                cost_usd=0.002))
    cli._print_result(res)
    text = out.export_text()
    assert "failed attempts: 2 (600 prompt, 20 completion tokens, $0.001200)" in text
    cli._print_result(res.model_copy(update={"steps": [step.model_copy(
        update={"failed_attempts": None})]}))
    assert out.export_text().count("failed attempts") == 0  # export_text clears


def test_the_report_bills_each_tenant_its_jobs() -> None:
    """Per tenant (of the jobs' ids): jobs, steps, tokens, cache share and dollars, a
    lower bound where a step ran on an unpriced engine."""
    from rich.console import Console

    from warmloop.workers.report import tenant_table
    from warmloop.workflows.budgets import Usage
    from warmloop.workflows.contracts import JobResult, JobState

    def job(jid: str, cost: float, unknown: int = 0) -> JobResult:
        return JobResult(job_id=jid, profile="ticket-triage", state=JobState.FINISHED,
                         reason="", steps=[], transcript=[],
                         usage=Usage(steps=2, prompt_tokens=1_000, cached_tokens=800,
                                     completion_tokens=40, cost_usd=cost,
                                     cost_unknown_steps=unknown))

    out = Console(record=True, width=200)
    out.print(tenant_table([job("a1", 0.001), job("acme/b1", 0.002),
                            job("acme/b2-L3", 0.003), job("globex/c", 0.0, 2)], title="t"))
    rows = {line.split("│")[1].strip(): [c.strip() for c in line.split("│")[2:-1]]
            for line in out.export_text().splitlines() if line.count("│") == 8}
    assert rows["default"] == ["1", "2", "1000", "80.0%", "40", "$0.001000"]
    assert rows["acme"] == ["2", "4", "2000", "80.0%", "80", "$0.005000"]
    assert rows["globex"][-1] == "at least $0.000000 (2 unpriced steps)"


def test_a_waiting_batch_says_what_its_next_job_waits_for() -> None:
    """``batch status`` of a batch whose next job waits for its tenant's quota prints
    the claim's last refusal (Temporal keeps it with the pending activity), else what
    such a wait is for."""
    from types import SimpleNamespace

    from warmloop.workers.cli import _quota_wait

    def desc(*pending: tuple[str, str]) -> SimpleNamespace:
        return SimpleNamespace(raw_description=SimpleNamespace(pending_activities=[
            SimpleNamespace(activity_type=SimpleNamespace(name=name),
                            last_failure=SimpleNamespace(message=message))
            for name, message in pending]))

    refused = "tenant acme has 1 jobs running, its max_jobs_in_flight quota is 1; the batch..."
    assert _quota_wait(desc(("read_records", "s3 down"), ("claim_job_slot", refused))) == refused
    assert "max_jobs_in_flight" in _quota_wait(desc(("claim_job_slot", "")))
    assert "tokens_per_hour" in _quota_wait(desc())
