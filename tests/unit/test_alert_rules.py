"""The alert rules (infra/prometheus): promtool checks them and runs their unit tests
(each alert fires on the series that should fire it, and only then), each names only
exported series, and each has its runbook entry."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import yaml

from tests.unit.promql import metric_names, promtool
from warmloop.workers.observability import exported_series

ROOT = Path(__file__).resolve().parents[2]
PROM = ROOT / "infra" / "prometheus"
RULES = PROM / "warmloop-alerts.yaml"
TESTS = PROM / "rule-tests" / "warmloop-alerts.test.yaml"
RUNBOOK = PROM / "RUNBOOK.md"
ISSUE_ALERTS = {"WarmloopCacheBustSpike", "WarmloopCacheHitShareDrop", "WarmloopJobsPastWallCap",
                "WarmloopApprovalDeadlineNear", "WarmloopEngineMissingFromRegistry",
                "WarmloopWorkflowTaskFailures"}


def alerts() -> list[dict]:
    return [r for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
            if "alert" in r]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([promtool(), *args], capture_output=True, text=True, timeout=120)


def test_promtool_checks_the_rules() -> None:
    out = run("check", "rules", str(RULES))
    assert out.returncode == 0, out.stdout + out.stderr
    assert f"{len(alerts())} rules found" in out.stdout


def test_promtool_runs_the_rule_tests() -> None:
    out = run("test", "rules", str(TESTS))
    assert out.returncode == 0, out.stdout + out.stderr
    assert "SUCCESS" in out.stdout


def test_every_alert_is_tested_firing() -> None:
    tested = {case["alertname"] for t in yaml.safe_load(TESTS.read_text())["tests"]
              for case in t.get("alert_rule_test", []) if case.get("exp_alerts")}
    assert {a["alert"] for a in alerts()} <= tested


def test_the_rule_tests_fail_on_a_broken_rule(tmp_path: Path) -> None:
    """The same tests against rules with one threshold raised tenfold must fail: they
    test the rules, not only their syntax."""
    broken = RULES.read_text().replace(
        "sum by (profile) (rate(warmloop_cache_busts[10m])) * 60 > 1",
        "sum by (profile) (rate(warmloop_cache_busts[10m])) * 60 > 10")
    assert broken != RULES.read_text()
    (tmp_path / "tests").mkdir()
    (tmp_path / RULES.name).write_text(broken)
    shutil.copy(TESTS, tmp_path / "tests" / TESTS.name)
    out = run("test", "rules", str(tmp_path / "tests" / TESTS.name))
    assert out.returncode != 0
    assert "WarmloopCacheBustSpike" in out.stdout + out.stderr


def test_alerts_cover_the_issue_and_name_exported_series() -> None:
    names = {a["alert"] for a in alerts()}
    assert names >= ISSUE_ALERTS
    known = exported_series()
    for a in alerts():
        used = metric_names(a["expr"])
        assert used and used <= known, f"{a['alert']}: {sorted(used - known)} not exported"
        assert a["labels"]["severity"] in ("warning", "critical")
        assert a["annotations"]["summary"] and a["annotations"]["description"]


def _anchor(heading: str) -> str:
    """GitHub's anchor for a Markdown heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_alert_has_its_runbook_entry() -> None:
    headings = [ln[3:] for ln in RUNBOOK.read_text().splitlines() if ln.startswith("## ")]
    anchors = {_anchor(h) for h in headings}
    assert set(headings) == {a["alert"] for a in alerts()}, "one entry per alert, no more"
    for a in alerts():
        url = a["annotations"]["runbook_url"]
        path, _, anchor = url.partition("#")
        assert (ROOT / path).resolve() == RUNBOOK.resolve(), url
        assert anchor in anchors and anchor == _anchor(a["alert"]), url
    sections = RUNBOOK.read_text().split("\n## ")[1:]
    for section in sections:
        assert "**What.**" in section and ("**Fixes.**" in section), section.splitlines()[0]
