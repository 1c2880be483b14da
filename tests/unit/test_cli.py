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
