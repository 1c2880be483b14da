"""The stack across hosts: every part in its own network namespace on a private /24,
reaching the others only by their configured addresses (``warmloop.infra.multihost``).

One run of 10 jobs (interactive ticket-triage and invoice-reconciliation jobs, a payment
that waits for a finance lead, a batch from S3) is made once for the module; each test
reads its report. Needs root and ``ip netns`` (CI has both); skipped otherwise."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from warmloop.infra import multihost
from warmloop.infra.multihost import NAMED_END_STATES, MultiHostReport

pytestmark = pytest.mark.multihost

ROOT = Path(__file__).parent.parent.parent
STATE_DIR = ROOT / ".warmloop" / "multihost"
JOBS = 10


@pytest.fixture(scope="module")
def run() -> Iterator[tuple[int, MultiHostReport]]:
    if (reason := multihost.unavailable_reason()) is not None:
        pytest.skip(reason)
    report_path = STATE_DIR / "report.json"
    rc = multihost.run(JOBS, state_dir=STATE_DIR, report_path=report_path)
    assert report_path.exists(), f"the run (exit {rc}) wrote no report"
    yield rc, MultiHostReport.model_validate_json(report_path.read_text())


@pytest.fixture(scope="module")
def report(run: tuple[int, MultiHostReport]) -> MultiHostReport:
    return run[1]


def test_the_run_passes_its_own_checks(run: tuple[int, MultiHostReport]) -> None:
    rc, report = run
    assert report.problems == [] and rc == 0, report.problems


def test_every_job_ends_in_a_named_state(report: MultiHostReport) -> None:
    assert len(report.jobs) == JOBS
    assert len({j.job_id for j in report.jobs}) == JOBS
    not_ended = [(j.job_id, j.state, j.reason) for j in report.jobs
                 if j.state not in NAMED_END_STATES]
    assert not_ended == []
    assert {j.kind for j in report.jobs} == {"interactive", "approval", "batch"}
    assert {j.profile for j in report.jobs} == {"ticket-triage", "invoice-reconciliation"}


def test_every_step_names_an_engine_of_the_engine_hosts_and_its_cached_tokens(
        report: MultiHostReport) -> None:
    hosts = {h.namespace: h for h in report.hosts}
    engines = {e.id: e for e in report.engines}
    assert set(engines) == {"e0", "e1"}
    for e in engines.values():
        # each engine is served from its own host's address, not loopback
        assert e.url == f"http://{hosts[e.namespace].address}:8100"
        assert f"engine-{e.id}" in hosts[e.namespace].parts
        assert f"inference-worker-{e.id}" in hosts[e.namespace].parts
    steps = [s for j in report.jobs for s in j.steps]
    assert all(j.steps for j in report.jobs)
    assert {s.engine for s in steps} == set(engines)  # both engines served steps
    for s in steps:
        assert 0 <= s.cached_tokens <= s.prompt_tokens and s.prompt_tokens > 0, s
    later = [s for j in report.jobs for s in j.steps[1:]]
    assert sum(s.cached_tokens > 0 for s in later) > 0, "no later step read its prefix"


def test_the_payment_was_approved_by_a_verified_person_through_the_approvals_service(
        report: MultiHostReport) -> None:
    services = next(h for h in report.hosts if "inbox" in h.parts)
    assert report.approval is not None
    assert report.approval.decided_by == "bob"
    assert report.approval.outcome == "approved"
    assert report.approval.via == f"http://{services.address}:8300"
    [payment] = [j for j in report.jobs if j.kind == "approval"]
    assert [(a.kind, a.outcome, a.decided_by) for a in payment.approvals] == [
        ("large_payment", "approved", "bob")]
    assert payment.state == "FINISHED", payment.reason


def test_the_batch_finished_every_record(report: MultiHostReport) -> None:
    assert report.batch is not None
    assert report.batch.source.startswith("s3://")
    batch_jobs = [j for j in report.jobs if j.kind == "batch"]
    assert report.batch.state == "COMPLETED", report.batch.reason
    assert report.batch.records == report.batch.done == len(batch_jobs) > 0
    assert (report.batch.failed, report.batch.bad) == (0, 0)


def test_servers_listen_on_their_hosts_address_and_nothing_on_every_interface(
        report: MultiHostReport) -> None:
    def ports(host: multihost.HostRow, address: str) -> set[int]:
        return {int(entry.split(" ", 1)[0].rsplit(":", 1)[1]) for entry in host.listeners
                if entry.split(" ", 1)[0].rsplit(":", 1)[0] == address}

    hosts = {h.namespace: h for h in report.hosts}
    svc = hosts["wl-svc"]
    # Redis, S3, the approvals service, the gateway and Temporal's Web UI: on the address
    # the others are given; Temporal's frontend on every interface of wl-svc (the dev
    # server's workaround, multihost._temporal_on_every_interface)
    assert {6390, 9010, 8300, 8500, 8233} <= ports(svc, svc.address), svc.listeners
    assert {"*:7233 (temporal)", "0.0.0.0:7233 (temporal)"} & set(svc.listeners), svc.listeners
    for e in report.engines:
        host = hosts[e.namespace]
        assert 8100 in ports(host, host.address), host.listeners
        # the KV events stay on the engine host's loopback (its worker binds them)
        assert 5557 in ports(host, "127.0.0.1"), host.listeners
    assert report.wildcard_listeners() == []
