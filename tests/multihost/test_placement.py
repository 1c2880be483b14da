"""Where the multi-host test bed puts each part and what it gives it, checked without
starting anything (no root needed): every part runs under ``ip netns exec`` on its
host, servers bind the address the others are given, and nothing another host must
reach is configured on loopback."""

from __future__ import annotations

from pathlib import Path

import pytest

from warmloop.infra.multihost import (
    KV_EVENTS_ENDPOINT,
    HostRow,
    JobPlan,
    MultiHostReport,
    MultiHostStack,
    default_topology,
    multihost_settings,
)
from warmloop.infra.stack import settings_env


def _flag(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_every_part_runs_on_its_host_and_binds_the_address_others_are_given(
        tmp_path: Path) -> None:
    topo = default_topology()
    settings = multihost_settings(topo, tmp_path)
    parts = {p.name: p for p in MultiHostStack(settings, topo, log=lambda _: None).all_parts()}
    assert set(parts) == {name for h in topo.hosts for name in h.parts}
    for name, part in parts.items():
        assert part.argv[:4] == ["ip", "netns", "exec", topo.host_of(name).ns], name
    svc = topo.services.address
    assert _flag(parts["redis"].argv, "--bind") == svc
    assert _flag(parts["s3"].argv, "-H") == svc
    assert _flag(parts["inbox"].argv, "--host") == svc
    assert _flag(parts["gateway"].argv, "--host") == svc
    # the dev server's frontend on every interface of its host (its static membership
    # dials 127.0.0.1), its Web UI on the host's address
    assert _flag(parts["temporal"].argv, "--ip") == "0.0.0.0"
    assert _flag(parts["temporal"].argv, "--ui-ip") == svc
    for i, host in enumerate(topo.engines):
        argv = parts[f"engine-e{i}"].argv
        assert (_flag(argv, "--host"), _flag(argv, "--port")) == (host.address, "8100")
        assert KV_EVENTS_ENDPOINT in _flag(argv, "--kv-events-config")


def test_nothing_another_host_reaches_is_configured_on_loopback(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # the caller's own settings play no part
    monkeypatch.setenv("WARMLOOP_TEMPORAL_ADDRESS", "127.0.0.1:7233")
    monkeypatch.setenv("WARMLOOP_ENGINE_COUNT", "5")
    topo = default_topology()
    settings = multihost_settings(topo, tmp_path)
    env = settings_env(settings)
    for key in ("TEMPORAL_ADDRESS", "REDIS_URL", "S3_ENDPOINT_URL", "APPROVALS_URL"):
        value = env[f"WARMLOOP_{key}"]
        assert topo.services.address in value and "127.0.0.1" not in value, (key, value)
    engines = settings.engine_endpoints
    assert [e.url for e in engines] == [f"http://{h.address}:8100" for h in topo.engines]
    # loopback only between an engine and its own worker, on their shared host
    assert {e.kv_events for e in engines} == {KV_EVENTS_ENDPOINT}
    assert settings.s3_access_key_id is not None  # the placeholder keys are loopback-only


@pytest.mark.parametrize("n", [4, 7, 20, 33])
def test_the_job_plan_adds_up(n: int) -> None:
    plan = JobPlan.for_jobs(n)
    assert plan.tickets + plan.invoices + plan.batch_records + plan.approval_jobs == n
    assert min(plan.tickets, plan.batch_records, plan.approval_jobs) >= 1
    assert JobPlan.for_jobs(20) == JobPlan(tickets=9, invoices=4, batch_records=6)


def test_a_listener_on_every_interface_is_a_problem_unless_it_is_temporals() -> None:
    report = MultiHostReport(run_id="x", subnet="10.231.7.0/24", engines=[], hosts=[
        HostRow(namespace="wl-svc", address="10.231.7.2", parts=["temporal", "inbox"],
                listeners=["*:7233 (temporal)", "0.0.0.0:8300 (python)",
                           "10.231.7.2:6390 (redis-server)"]),
        HostRow(namespace="wl-e0", address="10.231.7.10", parts=["engine-e0"],
                listeners=["[::]:8100 (python)", "127.0.0.1:5557 (python)"])])
    assert report.wildcard_listeners() == [("wl-svc", "0.0.0.0:8300 (python)"),
                                           ("wl-e0", "[::]:8100 (python)")]
