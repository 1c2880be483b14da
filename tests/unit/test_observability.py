"""workers/observability.py: the exposition text, the observer's samples from the
registry, jobs and approvals, and the metrics relay."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

import httpx
import pytest
from starlette.testclient import TestClient

from warmloop.activities.holds import HOLD_STATS
from warmloop.activities.registry import ENGINE_KEY, EngineHeartbeat
from warmloop.workers import observability
from warmloop.workers.observability import Observer, Sample, relay_app, render, sample
from warmloop.workflows.contracts import PendingApproval

NOW = 1_800_000_000.0


class FakeRedis:
    """What the observer reads: the registry's set and keys, and hold statistics."""

    def __init__(self) -> None:
        self.sets: dict[str, set[str]] = {}
        self.strings: dict[str, str] = {}
        self.hashes: dict[str, dict[str, str]] = {}

    async def smembers(self, key: str) -> set[bytes]:
        return {m.encode() for m in self.sets.get(key, set())}

    async def mget(self, keys: list[str]) -> list[bytes | None]:
        return [self.strings[k].encode() if k in self.strings else None for k in keys]

    async def hgetall(self, key: str) -> dict[bytes, bytes]:
        return {k.encode(): v.encode() for k, v in self.hashes.get(key, {}).items()}


def add_engine(redis: FakeRedis, engine_id: str, **fields: Any) -> None:
    from warmloop.activities.registry import ENGINE_SET

    hb = EngineHeartbeat(engine_id=engine_id, task_queue=f"engine.{engine_id}", model="m",
                         url="http://10.0.0.1:8000", healthy=True, at=NOW - 0.5, **fields)
    redis.sets.setdefault(ENGINE_SET, set()).add(engine_id)
    redis.strings[ENGINE_KEY.format(engine_id)] = hb.model_dump_json()


def values(samples: list[Sample], name: str) -> dict[tuple[tuple[str, str], ...], float]:
    return {s.labels: s.value for s in samples if s.name == name}


def test_render_is_prometheus_text_with_the_catalogue_help() -> None:
    text = render([sample("warmloop_engine_kv_usage", 0.25, engine='e"0'),
                   sample("warmloop_registry_live_engines", 2)])
    assert "# TYPE warmloop_engine_kv_usage gauge" in text
    assert 'warmloop_engine_kv_usage{engine="e\\"0"} 0.25' in text
    assert "warmloop_registry_live_engines 2\n" in text
    with pytest.raises(KeyError):
        sample("warmloop_not_in_the_catalogue", 1)


async def test_registry_samples_per_engine() -> None:
    redis = FakeRedis()
    add_engine(redis, "warmloop-engine-0", kv_usage=0.5, held_tokens=4096, batch_limit=3,
               batch_active=2, batch_waiting=5, kv_capacity_tokens=100_000,
               interactive_ttft_p95_ms=800.0)
    add_engine(redis, "warmloop-engine-1")
    redis.hashes[HOLD_STATS.format("warmloop-engine-0")] = {"holds": "7", "touches": "40",
                                                            "not_a_known_field": "1"}
    observer = Observer(redis=redis,  # type: ignore[arg-type]
                        client_factory=lambda: None, clock=lambda: NOW)
    out = await observer.registry_samples()
    assert values(out, "warmloop_registry_live_engines") == {(): 2}
    e0 = (("engine", "warmloop-engine-0"),)
    assert values(out, "warmloop_engine_batch_limit") == {e0: 3}  # engine-1 has no K
    assert values(out, "warmloop_engine_batch_waiting")[e0] == 5
    assert values(out, "warmloop_engine_held_tokens")[e0] == 4096
    assert values(out, "warmloop_engine_heartbeat_age_seconds")[e0] == pytest.approx(0.5)
    holds = values(out, "warmloop_hold_events_total")
    assert holds[(("engine", "warmloop-engine-0"), ("event", "touches"))] == 40
    assert holds[(("engine", "warmloop-engine-1"), ("event", "touches"))] == 0
    assert not any(dict(k).get("event") == "not_a_known_field" for k in holds)
    render(out)  # every sample is in the catalogue


async def test_job_and_approval_samples(monkeypatch: pytest.MonkeyPatch) -> None:
    now = datetime.fromtimestamp(NOW, tz=UTC)
    jobs = [observability._RunningJob("ticket-triage", now - timedelta(hours=3), 3600.0),
            observability._RunningJob("ticket-triage", now - timedelta(minutes=5), 3600.0),
            observability._RunningJob("invoice", now - timedelta(days=2), None)]

    async def running_jobs(self: Observer, client: Any) -> list[Any]:
        return jobs

    def pending(kind: str, age: timedelta, left: timedelta) -> PendingApproval:
        return PendingApproval(approval_id=f"{kind}-1", job_id="j", kind=kind, tool="t",
                               arguments={}, step=1, approvers=["r"], profile="invoice",
                               requested_at=now - age, deadline=now + left)

    async def list_pending(client: Any) -> list[PendingApproval]:
        return [pending("large_payment", timedelta(minutes=30), timedelta(minutes=10)),
                pending("large_payment", timedelta(minutes=5), timedelta(hours=1))]

    monkeypatch.setattr(Observer, "running_jobs", running_jobs)
    monkeypatch.setattr("warmloop.workers.approvals.list_pending", list_pending)
    observer = Observer(redis=FakeRedis(),  # type: ignore[arg-type]
                        client_factory=lambda: None, clock=lambda: NOW)
    client: Any = None
    out = await observer.job_samples(client) + await observer.approval_samples(client)
    triage, invoice = (("profile", "ticket-triage"),), (("profile", "invoice"),)
    assert values(out, "warmloop_jobs_running") == {triage: 2, invoice: 1}
    # only the 3-hour job is past its 1-hour cap; a job without a cap never is
    assert values(out, "warmloop_jobs_past_wall_cap") == {triage: 1, invoice: 0}
    assert values(out, "warmloop_job_oldest_age_seconds")[invoice] == 2 * 86400
    key = (("kind", "large_payment"), ("profile", "invoice"))
    assert values(out, "warmloop_approvals_pending") == {key: 2}
    assert values(out, "warmloop_approval_oldest_age_seconds") == {key: 1800}
    assert values(out, "warmloop_approval_deadline_seconds") == {key: 600}


async def test_collect_reports_a_source_that_fails() -> None:
    async def no_temporal() -> Any:
        raise RuntimeError("cannot reach Temporal")

    observer = Observer(redis=FakeRedis(),  # type: ignore[arg-type]
                        client_factory=no_temporal, clock=lambda: NOW)
    out = await observer.collect()
    assert values(out, "warmloop_observer_up") == {(("source", "redis"),): 1,
                                                   (("source", "temporal"),): 0}
    assert observer.samples == out


def test_relay_serves_the_loopback_page_and_fails_without_it() -> None:
    page = "# TYPE temporal_request counter\ntemporal_request{namespace=\"default\"} 3\n"

    def upstream(request: httpx.Request) -> httpx.Response:
        if request.url.port == 9464:
            return httpx.Response(200, text=page)
        raise httpx.ConnectError("refused", request=request)

    ok = TestClient(relay_app(["http://127.0.0.1:9464/metrics"],
                              transport=httpx.MockTransport(upstream)))
    r = ok.get("/metrics")
    assert r.status_code == 200 and r.text == page
    assert ok.get("/healthz").status_code == 200
    down = TestClient(relay_app(["http://127.0.0.1:9470/metrics"],
                                transport=httpx.MockTransport(upstream)))
    assert down.get("/metrics").status_code == 503
    health = down.get("/healthz")
    assert health.status_code == 503 and "9470" in health.text
