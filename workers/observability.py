"""What warmloop exports to Prometheus, in one place, and the two small servers a cluster
needs to scrape it.

**The catalogue.** ``WARMLOOP_METRICS`` names every metric a warmloop process exports
(the agent worker's and inference workers' through Temporal's metric meter, the
gateway's own page, the observer's); ``TEMPORAL_SDK_METRICS`` the Temporal SDK's own
(as its Prometheus exporter names them: ``temporal_`` prefix, counters without
``_total``, durations in milliseconds); ``vllm_metric_types`` reads vLLM's from the
installed vllm source. The dashboards and alert rules in ``infra/`` may query only
series in ``exported_series()``, and the tests check that they do, and that every
metric a ``create_counter``/``create_histogram`` call in the code makes is listed here.

**The observer** (``python -m warmloop.workers.observability observe``): facts that no
single worker knows, read every ``--interval`` seconds and served on ``/metrics``:

- the engine registry (Redis): which engines are live, and per engine the load, KV
  use, held tokens, batch K and waiting batch steps their workers heartbeat, and the
  hold statistics (holds, touches, releases) the workers count;
- Temporal visibility: running jobs per profile, how many are past their wall cap
  (a job should have ended TIMED_OUT by then: it is stuck), and the approvals pending
  with their age and the time left to their deadline.

One replica is enough (it only reads); a second would double nothing but the reads.

**The relay** (``python -m warmloop.workers.observability relay``): the workers' Temporal
runtime serves its metrics on 127.0.0.1 only (``warmloop.workers.clients.connect``), which
a Prometheus outside the pod cannot reach. The relay, a sidecar in the same pod, serves
that page on the pod's address. (A setting for the runtime's bind address would make it
unnecessary.)
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import re
import time
from collections import defaultdict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import structlog

from warmloop.workers.gateway.metrics import COUNTERS as GATEWAY_COUNTERS
from warmloop.workers.gateway.metrics import GAUGES as GATEWAY_GAUGES
from warmloop.workers.gateway.metrics import HISTOGRAM as GATEWAY_HISTOGRAM
from warmloop.workers.gateway.metrics import HISTOGRAM_HELP as GATEWAY_HISTOGRAM_HELP

if TYPE_CHECKING:
    import redis.asyncio as aioredis
    from temporalio.client import Client

    from warmloop.workers.settings import Settings

log = structlog.get_logger(__name__)

MetricType = Literal["counter", "gauge", "histogram"]


@dataclass(frozen=True)
class MetricSpec:
    name: str
    type: MetricType
    help: str
    exported_by: str
    """The process whose /metrics page carries it."""
    labels: tuple[str, ...] = ()
    """warmloop's own labels (the Temporal runtime adds namespace, task_queue, ...)."""


_AGENT = "agent worker (Temporal metric meter, WARMLOOP_AGENT_METRICS_PORT)"
_INFERENCE = "inference worker (Temporal metric meter, WARMLOOP_INFERENCE_METRICS_BASE_PORT + i)"
_GATEWAY = "gateway (/metrics on WARMLOOP_GATEWAY_PORT)"
_OBSERVER = "observer (python -m warmloop.workers.observability observe)"

HOLD_EVENTS = ("holds", "touches", "touch_prompt_tokens", "touch_computed_tokens",
               "released_on_resume", "released_on_ttl", "released_for_room", "trimmed_for_room",
               "released_lost", "released_moved", "released_job_over", "shrunk", "prewarms",
               "prewarm_computed_tokens", "regretted_blocks")
"""The fields of the inference workers' hold statistics (``activities.holds.HOLD_STATS``)
the observer exports; a field not named here is not exported (bounded labels)."""

WARMLOOP_METRICS: tuple[MetricSpec, ...] = (
    # ---- per model step, recorded by AgentJob (workflows/agent_job.py) -----------------
    MetricSpec("warmloop_steps", "counter", "Model steps.", _AGENT, ("profile", "engine")),
    MetricSpec("warmloop_prompt_tokens", "counter", "Prompt tokens.", _AGENT,
               ("profile", "engine")),
    MetricSpec("warmloop_cached_tokens", "counter",
               "Prompt tokens served from the engine's prefix cache.", _AGENT,
               ("profile", "engine")),
    MetricSpec("warmloop_completion_tokens", "counter", "Completion tokens.", _AGENT,
               ("profile", "engine")),
    MetricSpec("warmloop_cost_microusd", "counter",
               "Cost of priced steps (their failed attempts too) in millionths of a dollar.",
               _AGENT, ("profile", "engine")),
    MetricSpec("warmloop_failed_attempt_tokens", "counter",
               "Prompt and completion tokens of step attempts the engine failed (counted "
               "in the jobs' usage, not in warmloop_prompt_tokens).", _AGENT,
               ("profile", "engine")),
    MetricSpec("warmloop_step_ttft", "histogram", "Time to first token per step (ms).", _AGENT,
               ("profile", "engine")),
    MetricSpec("warmloop_jobs_ended", "counter", "Jobs by terminal state.", _AGENT,
               ("profile", "state")),
    MetricSpec("warmloop_escalations", "counter",
               "Model steps asked again of a larger model (model ladder), by reason.",
               _AGENT, ("profile", "reason")),
    MetricSpec("warmloop_hygiene_archived", "counter",
               "Tool outputs context hygiene archived to S3 and replaced by a summary.",
               _AGENT, ("profile",)),
    # ---- agent worker activities ------------------------------------------------------
    MetricSpec("warmloop_tenant_slot_waits", "counter",
               "Refused job-slot claims of tenants' batch jobs (each is retried), by quota.",
               _AGENT, ("tenant", "quota")),
    MetricSpec("warmloop_tool_hedges", "counter",
               "Read-only tool calls that got a second (hedge) request past their p95, by "
               "which request answered first.", _AGENT, ("profile", "tool", "winner")),
    # ---- inference workers (activities) -----------------------------------------------
    MetricSpec("warmloop_cache_busts", "counter",
               "Prompt prefixes that changed where they should not.", _INFERENCE,
               ("profile", "kind")),
    MetricSpec("warmloop_prefix_records_skipped", "counter",
               "Steps whose prefix-directory records were skipped (Redis away or failing).",
               _INFERENCE, ("profile", "reason")),
    MetricSpec("warmloop_batch_admission_wait", "histogram",
               "Time a batch-lane step waited for one of its engine's K batch slots (ms).",
               _INFERENCE, ("profile",)),
    # ---- the observer -----------------------------------------------------------------
    MetricSpec("warmloop_observer_up", "gauge",
               "1 when the observer's last read of the source succeeded.", _OBSERVER,
               ("source",)),
    MetricSpec("warmloop_registry_live_engines", "gauge", "Engines live in the registry.",
               _OBSERVER),
    MetricSpec("warmloop_registry_engine_up", "gauge",
               "1 for each engine live in the registry.", _OBSERVER, ("engine", "model")),
    MetricSpec("warmloop_engine_heartbeat_age_seconds", "gauge",
               "Age of the engine's last heartbeat.", _OBSERVER, ("engine",)),
    MetricSpec("warmloop_engine_running", "gauge", "Requests running on the engine.",
               _OBSERVER, ("engine",)),
    MetricSpec("warmloop_engine_waiting", "gauge", "Requests waiting on the engine.",
               _OBSERVER, ("engine",)),
    MetricSpec("warmloop_engine_kv_usage", "gauge", "Fraction of the engine's KV pool in use.",
               _OBSERVER, ("engine",)),
    MetricSpec("warmloop_engine_kv_capacity_tokens", "gauge", "The engine's KV pool in tokens.",
               _OBSERVER, ("engine",)),
    MetricSpec("warmloop_engine_held_tokens", "gauge",
               "Prefix tokens kept warm for paused jobs.", _OBSERVER, ("engine",)),
    MetricSpec("warmloop_engine_batch_limit", "gauge",
               "Batch lane K: batch steps the engine admits at once.", _OBSERVER, ("engine",)),
    MetricSpec("warmloop_engine_batch_active", "gauge", "Batch steps admitted now.", _OBSERVER,
               ("engine",)),
    MetricSpec("warmloop_engine_batch_waiting", "gauge", "Batch steps waiting for admission.",
               _OBSERVER, ("engine",)),
    MetricSpec("warmloop_engine_interactive_ttft_p95_ms", "gauge",
               "Recent interactive TTFT p95 the engine's worker sees (batch admission's "
               "signal).", _OBSERVER, ("engine",)),
    MetricSpec("warmloop_hold_events_total", "counter",
               "Hold statistics the engine's worker counts: holds taken, touches, touch "
               "tokens, releases by cause, pre-warms.", _OBSERVER, ("engine", "event")),
    MetricSpec("warmloop_jobs_running", "gauge", "Running jobs.", _OBSERVER, ("profile",)),
    MetricSpec("warmloop_jobs_past_wall_cap", "gauge",
               "Running jobs older than their wall-time cap (they should have ended "
               "TIMED_OUT).", _OBSERVER, ("profile",)),
    MetricSpec("warmloop_job_oldest_age_seconds", "gauge", "Age of the oldest running job.",
               _OBSERVER, ("profile",)),
    MetricSpec("warmloop_approvals_pending", "gauge", "Approvals waiting for a person.",
               _OBSERVER, ("profile", "kind")),
    MetricSpec("warmloop_approval_oldest_age_seconds", "gauge",
               "Age of the oldest pending approval.", _OBSERVER, ("profile", "kind")),
    MetricSpec("warmloop_approval_deadline_seconds", "gauge",
               "Seconds until the nearest pending approval's deadline (negative: past).",
               _OBSERVER, ("profile", "kind")),
    MetricSpec("warmloop_observer_collect_seconds", "gauge",
               "How long the observer's last collection took.", _OBSERVER),
    # ---- the gateway's own page (workers/gateway/metrics.py) --------------------------
    *(MetricSpec(n, "counter", h, _GATEWAY) for n, h in GATEWAY_COUNTERS.items()),
    *(MetricSpec(n, "gauge", h, _GATEWAY) for n, h in GATEWAY_GAUGES.items()),
    MetricSpec(GATEWAY_HISTOGRAM, "histogram", GATEWAY_HISTOGRAM_HELP, _GATEWAY),
)
SPECS = {m.name: m for m in WARMLOOP_METRICS}

TEMPORAL_SDK_METRICS: dict[str, MetricType] = {
    # Seen on the /metrics page of a temporalio 1.35 worker (PrometheusConfig defaults),
    # and listed in Temporal's SDK metrics reference (Core SDK worker and client metrics).
    "temporal_activity_execution_cancelled": "counter",
    "temporal_activity_execution_failed": "counter",
    "temporal_activity_execution_latency": "histogram",
    "temporal_activity_poll_no_task": "counter",
    "temporal_activity_schedule_to_start_latency": "histogram",
    "temporal_activity_succeed_endtoend_latency": "histogram",
    "temporal_activity_task_received": "counter",
    "temporal_local_activity_execution_failed": "counter",
    "temporal_local_activity_execution_latency": "histogram",
    "temporal_local_activity_total": "counter",
    "temporal_long_request": "counter",
    "temporal_long_request_failure": "counter",
    "temporal_long_request_latency": "histogram",
    "temporal_num_pollers": "gauge",
    "temporal_request": "counter",
    "temporal_request_failure": "counter",
    "temporal_request_latency": "histogram",
    "temporal_sticky_cache_hit": "counter",
    "temporal_sticky_cache_miss": "counter",
    "temporal_sticky_cache_size": "gauge",
    "temporal_sticky_cache_total_forced_eviction": "counter",
    "temporal_worker_start": "counter",
    "temporal_worker_task_slots_available": "gauge",
    "temporal_worker_task_slots_used": "gauge",
    "temporal_workflow_cancelled": "counter",
    "temporal_workflow_completed": "counter",
    "temporal_workflow_continue_as_new": "counter",
    "temporal_workflow_endtoend_latency": "histogram",
    "temporal_workflow_failed": "counter",
    "temporal_workflow_task_execution_failed": "counter",
    "temporal_workflow_task_execution_latency": "histogram",
    "temporal_workflow_task_queue_poll_empty": "counter",
    "temporal_workflow_task_queue_poll_succeed": "counter",
    "temporal_workflow_task_replay_latency": "histogram",
    "temporal_workflow_task_schedule_to_start_latency": "histogram",
}

_VLLM_METRIC = re.compile(r'(counter|gauge|histogram)_cls\(\s*name=\s*"(vllm:\w+)"')


def vllm_metric_types(root: Path | None = None) -> dict[str, MetricType]:
    """vLLM's metrics (``vllm:...`` -> type) as the installed vllm's v1 engine declares
    them, read from its source (importing vllm takes seconds and a torch); empty when
    no vllm is installed. ``root``: a vllm package folder to read instead."""
    if root is None:
        spec = importlib.util.find_spec("vllm")
        if spec is None or not spec.submodule_search_locations:
            return {}
        root = Path(next(iter(spec.submodule_search_locations)))
    found: dict[str, MetricType] = {}
    for path in sorted((root / "v1").rglob("*.py")):
        for kind, name in _VLLM_METRIC.findall(path.read_text(errors="replace")):
            found[name] = kind  # type: ignore[assignment]
    return found


def series_names(name: str, kind: MetricType, *, counter_suffix: str = "") -> set[str]:
    """The series a metric appears as on a /metrics page."""
    if kind == "histogram":
        return {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    if kind == "counter":
        return {name + counter_suffix}
    return {name}


def exported_series(vllm_root: Path | None = None) -> set[str]:
    """Every series name a query over warmloop's fleet may use: warmloop's, the Temporal
    SDK's, and the installed vLLM's (prometheus_client adds ``_total`` to counters)."""
    out: set[str] = set()
    for m in WARMLOOP_METRICS:
        out |= series_names(m.name, m.type)
    for name, kind in TEMPORAL_SDK_METRICS.items():
        out |= series_names(name, kind)
    for name, kind in vllm_metric_types(vllm_root).items():
        out |= series_names(name.removesuffix("_total"), kind, counter_suffix="_total")
    return out


# ---- the exposition format ----------------------------------------------------------------

@dataclass(frozen=True)
class Sample:
    name: str
    labels: tuple[tuple[str, str], ...]
    value: float


def sample(name: str, value: float, **labels: str) -> Sample:
    if name not in SPECS:
        raise KeyError(f"{name} is not in WARMLOOP_METRICS")
    return Sample(name, tuple(sorted(labels.items())), float(value))


def render(samples: Iterable[Sample]) -> str:
    """The Prometheus text format, HELP and TYPE from the catalogue."""
    by_name: dict[str, list[Sample]] = defaultdict(list)
    for s in samples:
        by_name[s.name].append(s)
    lines: list[str] = []
    for name in sorted(by_name):
        spec = SPECS[name]
        lines += [f"# HELP {name} {spec.help}", f"# TYPE {name} {spec.type}"]
        for s in sorted(by_name[name], key=lambda s: s.labels):
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in s.labels)
            lines.append(f"{name}{{{inner}}} {_num(s.value)}" if inner
                         else f"{name} {_num(s.value)}")
    return "\n".join(lines) + "\n"


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _num(v: float) -> str:
    return str(int(v)) if float(v).is_integer() else repr(float(v))


# ---- the observer -------------------------------------------------------------------------

@dataclass
class _RunningJob:
    profile: str
    started_at: datetime
    wall_cap_s: float | None


@dataclass
class Observer:
    """Reads the registry and Temporal and keeps the samples of its last collection.

    ``client`` is made on first use (in the serving loop), so the observer starts, and
    reports ``warmloop_observer_up{source="temporal"} 0``, while Temporal is away."""

    redis: aioredis.Redis
    client_factory: Callable[[], Any]
    engine_ttl_s: float = 5.0
    clock: Callable[[], float] = time.time
    samples: list[Sample] = field(default_factory=list)
    _client: Client | None = None
    _caps: dict[str, tuple[datetime, float | None]] = field(default_factory=dict)
    """run id -> (the job's first start, its wall cap): a run's input never changes."""

    async def collect(self) -> list[Sample]:
        start = time.perf_counter()
        out: list[Sample] = []
        try:
            out += await self.registry_samples()
            out.append(sample("warmloop_observer_up", 1, source="redis"))
        except Exception as e:  # noqa: BLE001 - a source away is reported, not raised
            log.warning("observer_redis_failed", error=str(e))
            out.append(sample("warmloop_observer_up", 0, source="redis"))
        try:
            client = await self._temporal()
            out += await self.job_samples(client)
            out += await self.approval_samples(client)
            out.append(sample("warmloop_observer_up", 1, source="temporal"))
        except Exception as e:  # noqa: BLE001
            log.warning("observer_temporal_failed", error=str(e))
            out.append(sample("warmloop_observer_up", 0, source="temporal"))
        out.append(sample("warmloop_observer_collect_seconds", time.perf_counter() - start))
        self.samples = out
        return out

    async def _temporal(self) -> Client:
        if self._client is None:
            self._client = await self.client_factory()
        return self._client

    async def registry_samples(self) -> list[Sample]:
        from warmloop.activities.holds import hold_stats
        from warmloop.activities.registry import EngineRegistry

        now = self.clock()
        live = await EngineRegistry(self.redis, ttl_s=self.engine_ttl_s).live(now=now)
        out = [sample("warmloop_registry_live_engines", len(live))]
        for hb in live:
            e = hb.engine_id
            out += [
                sample("warmloop_registry_engine_up", 1, engine=e, model=hb.model),
                sample("warmloop_engine_heartbeat_age_seconds", max(0.0, now - hb.at), engine=e),
                sample("warmloop_engine_running", hb.running, engine=e),
                sample("warmloop_engine_waiting", hb.waiting, engine=e),
                sample("warmloop_engine_kv_usage", hb.kv_usage, engine=e),
                sample("warmloop_engine_kv_capacity_tokens", hb.kv_capacity_tokens, engine=e),
                sample("warmloop_engine_held_tokens", hb.held_tokens, engine=e),
                sample("warmloop_engine_batch_active", hb.batch_active, engine=e),
                sample("warmloop_engine_batch_waiting", hb.batch_waiting, engine=e),
            ]
            if hb.batch_limit is not None:
                out.append(sample("warmloop_engine_batch_limit", hb.batch_limit, engine=e))
            if hb.interactive_ttft_p95_ms is not None:
                out.append(sample("warmloop_engine_interactive_ttft_p95_ms",
                                  hb.interactive_ttft_p95_ms, engine=e))
            stats = await hold_stats(self.redis, e)
            out += [sample("warmloop_hold_events_total", stats.get(ev, 0), engine=e, event=ev)
                    for ev in HOLD_EVENTS]
        return out

    async def job_samples(self, client: Client) -> list[Sample]:
        now = datetime.fromtimestamp(self.clock(), tz=UTC)
        jobs = await self.running_jobs(client)
        running: dict[str, int] = defaultdict(int)
        past: dict[str, int] = defaultdict(int)
        oldest: dict[str, float] = {}
        for job in jobs:
            age = (now - job.started_at).total_seconds()
            running[job.profile] += 1
            oldest[job.profile] = max(oldest.get(job.profile, 0.0), age)
            past[job.profile] += job.wall_cap_s is not None and age > job.wall_cap_s
        out = []
        for profile, n in running.items():
            out += [sample("warmloop_jobs_running", n, profile=profile),
                    sample("warmloop_jobs_past_wall_cap", past[profile], profile=profile),
                    sample("warmloop_job_oldest_age_seconds", oldest[profile], profile=profile)]
        return out

    async def running_jobs(self, client: Client) -> list[_RunningJob]:
        from warmloop.workflows.agent_job import SA_PROFILE

        out: list[_RunningJob] = []
        seen: set[str] = set()
        async for wf in client.list_workflows(
                "WorkflowType = 'AgentJob' AND ExecutionStatus = 'Running'"):
            seen.add(wf.run_id)
            profile = wf.typed_search_attributes.get(SA_PROFILE) or "unknown"
            if wf.run_id not in self._caps:
                self._caps[wf.run_id] = await self._start_and_cap(client, wf, profile)
            started, cap = self._caps[wf.run_id]
            out.append(_RunningJob(profile, started, cap))
        for run_id in set(self._caps) - seen:  # ended runs
            del self._caps[run_id]
        return out

    async def _start_and_cap(self, client: Client, wf: Any, profile: str
                             ) -> tuple[datetime, float | None]:
        """The job's first start (carried across continue-as-new) and its wall cap (its
        own limits, else its profile's), from the run's input: the first history event.
        Visibility's start time alone would restart the clock at every continue-as-new."""
        from temporalio.api.common.v1 import WorkflowExecution
        from temporalio.api.workflowservice.v1 import GetWorkflowExecutionHistoryRequest

        from warmloop.workflows.contracts import JobInput
        from warmloop.workflows.profiles import get_profile

        started: datetime = wf.start_time
        limits = None
        try:
            history = await client.workflow_service.get_workflow_execution_history(
                GetWorkflowExecutionHistoryRequest(
                    namespace=client.namespace, maximum_page_size=1,
                    execution=WorkflowExecution(workflow_id=wf.id, run_id=wf.run_id)))
            attrs = history.history.events[0].workflow_execution_started_event_attributes
            [job] = await client.data_converter.decode(attrs.input.payloads, [JobInput])
            limits = job.limits
            if job.carry is not None:
                started = job.carry.started_at
        except Exception as e:  # noqa: BLE001 - fall back on the profile's cap
            log.warning("observer_job_input_unreadable", job_id=wf.id, error=str(e))
        if limits is None:
            try:
                limits = get_profile(profile).limits
            except Exception:  # noqa: BLE001 - a profile this observer has not loaded
                return started, None
        if started.tzinfo is None:
            started = started.replace(tzinfo=UTC)
        return started, limits.max_wall_time_s

    async def approval_samples(self, client: Client) -> list[Sample]:
        from warmloop.workers.approvals import list_pending

        now = datetime.fromtimestamp(self.clock(), tz=UTC)
        groups: dict[tuple[str, str], list[Any]] = defaultdict(list)
        for p in await list_pending(client):
            groups[(p.profile or "unknown", p.kind)].append(p)
        out = []
        for (profile, kind), ps in groups.items():
            out += [
                sample("warmloop_approvals_pending", len(ps), profile=profile, kind=kind),
                sample("warmloop_approval_oldest_age_seconds",
                       max((now - _utc(p.requested_at)).total_seconds() for p in ps),
                       profile=profile, kind=kind),
                sample("warmloop_approval_deadline_seconds",
                       min((_utc(p.deadline) - now).total_seconds() for p in ps),
                       profile=profile, kind=kind),
            ]
        return out

    async def run(self, interval_s: float) -> None:
        while True:
            try:
                await self.collect()
            except Exception:  # noqa: BLE001 - the next round tries again
                log.exception("observer_collect_failed")
            await asyncio.sleep(interval_s)


def _utc(t: datetime) -> datetime:
    return t if t.tzinfo is not None else t.replace(tzinfo=UTC)


# ---- the servers --------------------------------------------------------------------------

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"


def observer_app(observer: Observer, interval_s: float) -> Any:
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    async def metrics(_: Request) -> Response:
        return Response(render(observer.samples), media_type=CONTENT_TYPE)

    async def healthz(_: Request) -> Response:
        return PlainTextResponse("ok")

    async def lifespan(_: Any) -> Any:
        task = asyncio.ensure_future(observer.run(interval_s))
        try:
            yield
        finally:
            task.cancel()

    return Starlette(routes=[Route("/metrics", metrics), Route("/healthz", healthz)],
                     lifespan=lifespan)


def relay_app(upstreams: list[str], timeout_s: float = 5.0, transport: Any = None) -> Any:
    """Serves the pages of ``upstreams`` (loopback /metrics URLs) as one page. A page that
    cannot be read is left out and counted in ``/healthz`` (503 when none can be), so a
    dead worker shows as a failing probe, not as a silently empty page."""
    import httpx
    from starlette.applications import Starlette
    from starlette.requests import Request
    from starlette.responses import PlainTextResponse, Response
    from starlette.routing import Route

    http = httpx.AsyncClient(timeout=timeout_s, transport=transport)

    async def pages() -> tuple[list[str], list[str]]:
        texts, failed = [], []
        for url in upstreams:
            try:
                r = await http.get(url)
                r.raise_for_status()
                texts.append(r.text if r.text.endswith("\n") else r.text + "\n")
            except httpx.HTTPError as e:
                failed.append(f"{url}: {e}")
        return texts, failed

    async def metrics(_: Request) -> Response:
        texts, _failed = await pages()
        return Response("".join(texts), media_type=CONTENT_TYPE,
                        status_code=200 if texts else 503)

    async def healthz(_: Request) -> Response:
        texts, failed = await pages()
        return PlainTextResponse("\n".join(failed) or "ok", status_code=200 if texts else 503)

    return Starlette(routes=[Route("/metrics", metrics), Route("/healthz", healthz)])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m warmloop.workers.observability",
                                     description=(__doc__ or "").split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    obs = sub.add_parser("observe", help="serve the registry's and Temporal's facts")
    obs.add_argument("--host", default="127.0.0.1")
    obs.add_argument("--port", type=int, default=9480)
    obs.add_argument("--interval", type=float, default=15.0, help="seconds between reads")
    rel = sub.add_parser("relay", help="serve loopback /metrics pages on another address")
    rel.add_argument("--host", default="127.0.0.1")
    rel.add_argument("--port", type=int, default=9465)
    rel.add_argument("--upstream", action="append", required=True,
                     help="a /metrics URL to relay (repeat for several)")
    args = parser.parse_args(argv)

    import uvicorn

    from warmloop.workers.logging import configure_logging
    from warmloop.workers.settings import Settings

    settings: Settings = Settings()
    configure_logging(settings.log_format, settings.log_level)
    if args.command == "relay":
        uvicorn.run(relay_app(args.upstream), host=args.host, port=args.port,
                    log_level="warning")
        return

    from warmloop.workers.clients import build_redis, connect
    from warmloop.workers.plugins import PluginError, load_plugins

    try:  # the profiles' wall caps
        load_plugins(plugins=settings.plugins, profile_paths=settings.profile_paths,
                     toolsets=False)
    except PluginError as e:
        raise SystemExit(f"error: {e}") from None
    observer = Observer(redis=build_redis(settings), client_factory=lambda: connect(settings),
                        engine_ttl_s=settings.engine_ttl_s)
    uvicorn.run(observer_app(observer, args.interval), host=args.host, port=args.port,
                log_level="warning")


if __name__ == "__main__":
    main()
