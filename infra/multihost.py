"""The multi-host test bed: the stack's parts on separate "hosts" of one machine.

Each host is a Linux network namespace with one address on a private /24 (default
10.231.7.0/24); a hub namespace holds the bridge that joins them. The /24 exists only
inside these namespaces: nothing is added to the root namespace (no address, route or
link), and the hosts have no route anywhere but the /24, so no part can reach, or be
reached from, the outside.

=========  ===========  =====================================================
namespace  address      runs
=========  ===========  =====================================================
wl-svc     10.231.7.2   Temporal, Redis, S3 (moto), the inbox/approvals
                        service, the gateway
wl-e0      10.231.7.10  engine e0 (vLLM) and its inference worker
wl-e1      10.231.7.11  engine e1 and its inference worker
wl-agent   10.231.7.20  the agent worker
wl-client  10.231.7.30  the driver: submits jobs, decides the approval, runs
                        the batch (and the launcher's health checks)
=========  ===========  =====================================================

Every part is configured only with the others' addresses (``WARMLOOP_*``; the
environment's own WARMLOOP_* settings are not used), and servers bind their host's
address, not loopback, so a part that assumed localhost would find nothing there.
Loopback stays in use only inside one host: an engine publishes its KV events to its
inference worker on 127.0.0.1 (``settings.check_kv_events_endpoint`` allows it), and
the workers' metrics pages. Both engines use the same port and the same KV-events
endpoint, each on its own host. One exception, forced by the Temporal dev server: its
frontend listens on every interface of wl-svc (``_temporal_on_every_interface``).

``python -m warmloop.infra.multihost run --jobs 20`` creates the network, starts the
parts (``infra/stack.py``'s command builders, each wrapped in ``ip netns exec``), runs
the jobs from ``wl-client``, writes ``.warmloop/multihost/report.json``, prints the
summary, and tears everything down (processes and namespaces), also after a failure.
Namespaces left by a crashed run are removed first (logged); a run in progress (its
lock held) is never touched. Needs root and ``ip netns``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field
from rich.console import Console
from rich.table import Table

from warmloop.infra.stack import Part, Stack, StackError, settings_env
from warmloop.workers.settings import EngineEndpoint, Settings
from warmloop.workflows.contracts import JobResult, JobState

# ---- the network -----------------------------------------------------------------------

SUBNET_PREFIX = "10.231.7"
PREFIX_LEN = 24
HUB_NS = "wl-hub"
BRIDGE = "wlbr0"
ENGINE_PORT = 8100
KV_EVENTS_ENDPOINT = "tcp://127.0.0.1:5557"
"""Every engine's, each on its own host's loopback (engine and worker share the host)."""
S3_KEY_ID = "warmloop-multihost"
"""Explicit S3 credentials for the moto server (any key works there): the placeholder
keys of ``build_s3`` are for a loopback endpoint only, and this one is not."""
IGNORED_ENV_PREFIX = "WARMLOOP_MULTIHOST_UNUSED_"
"""Settings are built with this prefix so the caller's WARMLOOP_* variables play no part."""


@dataclass(frozen=True)
class Host:
    """One "machine": a network namespace, its address and the parts it runs."""

    ns: str
    address: str
    parts: tuple[str, ...]


@dataclass(frozen=True)
class Topology:
    services: Host
    engines: tuple[Host, ...]
    agent: Host
    client: Host

    @property
    def hosts(self) -> tuple[Host, ...]:
        return (self.services, *self.engines, self.agent, self.client)

    @property
    def subnet(self) -> str:
        return f"{SUBNET_PREFIX}.0/{PREFIX_LEN}"

    def host_of(self, part: str) -> Host:
        for h in self.hosts:
            if part in h.parts:
                return h
        raise KeyError(f"no host of the multi-host test bed runs part {part!r}")

    def engine_ids(self) -> list[str]:
        return [h.ns.removeprefix("wl-") for h in self.engines]


def default_topology(engines: int = 2) -> Topology:
    if not 1 <= engines <= 8:
        raise ValueError("the test bed runs 1 to 8 engines")
    engine_hosts = tuple(
        Host(f"wl-e{i}", f"{SUBNET_PREFIX}.{10 + i}", (f"engine-e{i}", f"inference-worker-e{i}"))
        for i in range(engines))
    return Topology(
        services=Host("wl-svc", f"{SUBNET_PREFIX}.2",
                      ("temporal", "redis", "s3", "inbox", "gateway")),
        engines=engine_hosts,
        agent=Host("wl-agent", f"{SUBNET_PREFIX}.20", ("agent-worker",)),
        client=Host("wl-client", f"{SUBNET_PREFIX}.30", ()),
    )


class NetworkError(RuntimeError):
    """The namespaces could not be created or removed, or another run holds them."""


def unavailable_reason() -> str | None:
    """Why the test bed cannot run here (not root, no ``ip netns``), or None."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return "the multi-host test bed needs root (it creates network namespaces)"
    if shutil.which("ip") is None:
        return "the multi-host test bed needs iproute2's `ip` (ip netns)"
    # A namespace made and removed at once: `ip netns list` alone passes in containers
    # that may not create one.
    probe = f"wl-probe-{os.getpid()}"
    out = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if out.returncode != 0:
        return f"`ip netns` is unavailable here: {out.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, text=True)
    return None


def _ip(*args: str) -> str:
    out = subprocess.run(["ip", *args], capture_output=True, text=True)
    if out.returncode != 0:
        raise NetworkError(f"ip {' '.join(args)}: {out.stderr.strip()}")
    return out.stdout


def existing_namespaces() -> set[str]:
    return {line.split()[0] for line in _ip("netns", "list").splitlines() if line.strip()}


def _pid_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


class Network:
    """The namespaces, the bridge and the veth pairs; ``remove`` ends every process
    still inside the host namespaces (only ours live there) and deletes them."""

    def __init__(self, topology: Topology, log: Callable[[str], None]) -> None:
        self.topology = topology
        self.log = log

    @property
    def namespaces(self) -> list[str]:
        return [h.ns for h in self.topology.hosts] + [HUB_NS]

    def create(self) -> None:
        stale = existing_namespaces() & set(self.namespaces)
        if stale:
            self.log(f"namespaces left by an earlier run that did not finish: "
                     f"{', '.join(sorted(stale))}; removing them first")
            self.remove()
        try:
            for ns in self.namespaces:
                _ip("netns", "add", ns)
            _ip("-n", HUB_NS, "link", "add", BRIDGE, "type", "bridge")
            _ip("-n", HUB_NS, "link", "set", BRIDGE, "up")
            for h in self.topology.hosts:
                # The pair is made in the hub, its peer placed straight into the host:
                # the root namespace never holds either end.
                _ip("-n", HUB_NS, "link", "add", h.ns, "type", "veth",
                    "peer", "name", "eth0", "netns", h.ns)
                _ip("-n", HUB_NS, "link", "set", h.ns, "master", BRIDGE, "up")
                _ip("-n", h.ns, "addr", "add", f"{h.address}/{PREFIX_LEN}", "dev", "eth0")
                _ip("-n", h.ns, "link", "set", "eth0", "up")
                _ip("-n", h.ns, "link", "set", "lo", "up")
        except NetworkError:
            self.remove()
            raise
        self.log(f"network {self.topology.subnet} up: "
                 + ", ".join(f"{h.ns}={h.address}" for h in self.topology.hosts))

    def pids(self) -> list[int]:
        present = existing_namespaces()
        out: list[int] = []
        for ns in self.namespaces:
            if ns in present:
                out += [int(p) for p in _ip("netns", "pids", ns).split() if p.isdigit()]
        return out

    def remove(self, grace_s: float = 10.0) -> None:
        pids = self.pids()
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while any(_pid_alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.2)
        for pid in self.pids():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        present = existing_namespaces()
        for ns in self.namespaces:
            if ns in present:
                _ip("netns", "del", ns)
        if pids:
            self.log(f"ended {len(pids)} process(es) left in the namespaces")
        self.log("namespaces removed")

    @contextlib.contextmanager
    def running(self) -> Iterator[Network]:
        self.create()
        try:
            yield self
        finally:
            self.remove()


@contextlib.contextmanager
def exclusive(state_dir: Path) -> Iterator[None]:
    """One run at a time: a second one would tear down the first one's namespaces."""
    state_dir.mkdir(parents=True, exist_ok=True)
    with open(state_dir / "multihost.lock", "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise NetworkError(f"another multi-host run holds {state_dir / 'multihost.lock'}; "
                               "wait for it to end") from None
        yield


# ---- the parts -----------------------------------------------------------------------


def multihost_settings(topology: Topology, state_dir: Path) -> Settings:
    """The one configuration every part gets: the others' addresses, nothing else."""
    svc = topology.services.address
    engines = [EngineEndpoint(id=eid, url=f"http://{h.address}:{ENGINE_PORT}",
                              kv_events=KV_EVENTS_ENDPOINT)
               for eid, h in zip(topology.engine_ids(), topology.engines, strict=True)]
    return Settings(
        _env_prefix=IGNORED_ENV_PREFIX,  # type: ignore[call-arg]
        state_dir=state_dir,
        temporal_address=f"{svc}:7233",
        redis_url=f"redis://{svc}:6390/0",
        s3_endpoint_url=f"http://{svc}:9010",
        s3_access_key_id=S3_KEY_ID,
        s3_secret_access_key=S3_KEY_ID,  # type: ignore[arg-type]
        approvals_url=f"http://{svc}:8300",
        engines=engines,
        log_format="console",
    )


class MultiHostStack(Stack):
    """``Stack`` with each part started on its host: its command is the embedded
    stack's, run under ``ip netns exec <host>``; servers bind their host's address
    (the settings' addresses; ``host`` for the inbox and gateway)."""

    def __init__(self, settings: Settings, topology: Topology, *,
                 log: Callable[[str], None]) -> None:
        super().__init__(settings, log=log, host=topology.services.address)
        self.topology = topology

    def _placed(self, part: Part) -> Part:
        ns = self.topology.host_of(part.name).ns
        return dataclasses.replace(part, argv=["ip", "netns", "exec", ns, *part.argv])

    def infra_parts(self) -> list[Part]:
        return [self._placed(_temporal_on_every_interface(p) if p.name == "temporal" else p)
                for p in super().infra_parts()]

    def engine_parts(self) -> list[Part]:
        # The settings name the engines (their addresses), which the embedded stack
        # takes for engines someone else runs; here the test bed runs them.
        return [self._placed(self.engine_part(i, e))
                for i, e in enumerate(self.settings.engine_endpoints)]

    def worker_parts(self) -> list[Part]:
        return [self._placed(p) for p in super().worker_parts()]

    def build_model(self) -> None:
        """The embedded stack's model build, for the model these engines serve."""
        values = self.settings.model_dump(exclude={"engines"})
        Stack(Settings(_env_prefix=IGNORED_ENV_PREFIX, **values),  # type: ignore[call-arg]
              log=self.log).build_model()


TEMPORAL_PROCESS = "temporal"
"""The one process allowed to listen on every interface (of its own host): see
``_temporal_on_every_interface``."""


def _temporal_on_every_interface(part: Part) -> Part:
    """The Temporal dev server bound to 0.0.0.0 on its host, its Web UI to the host's
    address.

    Found by this test bed: ``temporal server start-dev --ip <address>`` (CLI 1.9.1,
    server 1.32) binds its history, matching and worker services to ``<address>`` but
    registers them in its static membership as 127.0.0.1:<port> (the CLI's devserver
    hard-codes ``localhost = "127.0.0.1"`` there), so with any address but loopback or
    0.0.0.0 every StartWorkflowExecution fails with "dial tcp 127.0.0.1:<port>:
    connection refused". 0.0.0.0 covers loopback as well; on wl-svc that is reachable
    only from wl-svc itself, and the other hosts still reach it only by the configured
    address. The embedded stack (loopback) is not affected."""
    argv = list(part.argv)
    i = argv.index("--ip")
    address = argv[i + 1]
    argv[i + 1] = "0.0.0.0"
    return dataclasses.replace(part, argv=[*argv, "--ui-ip", address])


def fresh_state(settings: Settings) -> None:
    """Start from an empty Temporal database and Redis: jobs and keys of an earlier run
    would otherwise resume on (and load) the new one. The model and identities stay."""
    for pattern in ("temporal.db*", "appendonly.aof", "dump.rdb"):
        for f in settings.state_dir.glob(pattern):
            f.unlink()
    shutil.rmtree(settings.state_dir / "appendonlydir", ignore_errors=True)


_SS_LINE = re.compile(r"^\S+\s+\d+\s+\d+\s+(?P<local>\S+)\s+\S+"
                      r"(?:\s+users:\(\(\"(?P<proc>[^\"]+)\")?")


def listeners(ns: str) -> list[str]:
    """TCP sockets listening in namespace ``ns``: ``address:port (process)``."""
    out = subprocess.run(["ip", "netns", "exec", ns, "ss", "-ltnHp"], capture_output=True,
                         text=True)
    found = []
    for line in out.stdout.splitlines():
        m = _SS_LINE.match(line.strip())
        if m:
            found.append(f"{m['local']} ({m['proc'] or '?'})")
    return sorted(set(found))


# ---- the report ----------------------------------------------------------------------

NAMED_END_STATES = frozenset(s.value for s in JobState if s is not JobState.RUNNING)
NOT_ENDED = "NOT_ENDED"
"""A job that had not ended when the run's time was up (never a named end state)."""


class StepRow(BaseModel):
    step: int
    engine: str
    route: str
    tool: str | None
    valid: bool
    prompt_tokens: int
    cached_tokens: int
    completion_tokens: int
    ttft_ms: float


class ApprovalRow(BaseModel):
    job_id: str
    approval_id: str
    kind: str = ""
    outcome: str = ""
    decided_by: str = ""
    comment: str = ""
    via: str = ""
    """The approvals service the decision went through."""


class JobRow(BaseModel):
    job_id: str
    kind: Literal["interactive", "approval", "batch"]
    profile: str
    state: str
    reason: str = ""
    steps: list[StepRow] = Field(default_factory=list)
    approvals: list[ApprovalRow] = Field(default_factory=list)

    @classmethod
    def of(cls, kind: Literal["interactive", "approval", "batch"], res: JobResult) -> JobRow:
        return cls(
            job_id=res.job_id, kind=kind, profile=res.profile, state=res.state.value,
            reason=res.reason,
            steps=[StepRow(step=s.step, engine=s.engine_id, route=s.route_reason, tool=s.tool,
                           valid=s.valid, prompt_tokens=s.prompt_tokens,
                           cached_tokens=s.cached_tokens, completion_tokens=s.completion_tokens,
                           ttft_ms=round(s.ttft_ms, 1)) for s in res.steps],
            approvals=[ApprovalRow(job_id=res.job_id, approval_id=a.approval.approval_id,
                                   kind=a.approval.kind, outcome=a.outcome,
                                   decided_by=a.decided_by, comment=a.comment)
                       for a in res.approvals])


class BatchRow(BaseModel):
    batch_id: str
    source: str
    state: str
    reason: str = ""
    records: int = 0
    done: int = 0
    failed: int = 0
    bad: int = 0
    by_state: dict[str, int] = Field(default_factory=dict)


class HostRow(BaseModel):
    namespace: str
    address: str
    parts: list[str]
    listeners: list[str] = Field(default_factory=list)


class EngineRow(BaseModel):
    id: str
    url: str
    namespace: str
    kv_events: str | None


class MultiHostReport(BaseModel):
    run_id: str
    subnet: str
    hosts: list[HostRow]
    engines: list[EngineRow]
    jobs: list[JobRow] = Field(default_factory=list)
    approval: ApprovalRow | None = None
    """The approval decided by a verified person (bob) through the approvals service."""
    stand_in_approvals: list[ApprovalRow] = Field(default_factory=list)
    """Approvals the tiny model's random calls asked for, decided the same way."""
    batch: BatchRow | None = None
    timings_s: dict[str, float] = Field(default_factory=dict)
    problems: list[str] = Field(default_factory=list)

    def check(self) -> list[str]:
        """What the run must show; the list of what it did not (empty: it passed)."""
        problems = []
        named = [j for j in self.jobs if j.state in NAMED_END_STATES]
        if len(named) != len(self.jobs):
            problems.append(f"{len(self.jobs) - len(named)} of {len(self.jobs)} jobs did not "
                            "end in a named state")
        engines = {e.id for e in self.engines}
        steps = [s for j in self.jobs for s in j.steps]
        if not steps:
            problems.append("no steps ran")
        if strays := {s.engine for s in steps} - engines:
            problems.append(f"steps on engines outside the test bed: {sorted(strays)}")
        if len(engines) > 1 and len({s.engine for s in steps}) < 2:
            problems.append("every step ran on one engine")
        if not any(s.cached_tokens > 0 for j in self.jobs for s in j.steps[1:]):
            problems.append("no step after a job's first read cached tokens")
        if self.approval is None or self.approval.decided_by != "bob":
            problems.append("the payment approval was not decided by the verified bob")
        if self.batch is None or self.batch.state != "COMPLETED" or (
                self.batch.done != self.batch.records):
            problems.append("the batch did not complete every record")
        problems += [f"{ns}: {listener} listens on every interface"
                     for ns, listener in self.wildcard_listeners()]
        return problems

    def wildcard_listeners(self) -> list[tuple[str, str]]:
        """Sockets listening on every interface of their host, but the Temporal dev
        server's (``_temporal_on_every_interface``)."""
        found = []
        for h in self.hosts:
            for listener in h.listeners:
                address, _, rest = listener.partition(" ")
                if (address.rsplit(":", 1)[0] in ("0.0.0.0", "*", "[::]")
                        and rest != f"({TEMPORAL_PROCESS})"):
                    found.append((h.namespace, listener))
        return found


def summary(report: MultiHostReport, console: Console) -> None:
    """Print the per-job table and the run's figures."""
    table = Table(title=f"multi-host run {report.run_id}: {len(report.jobs)} jobs")
    for col in ("job", "kind", "profile", "state", "steps", "engine per step",
                "cached tokens per step"):
        table.add_column(col, justify="right" if col == "steps" else "left")
    for j in report.jobs:
        table.add_row(j.job_id, j.kind, j.profile, j.state, str(len(j.steps)),
                      " ".join(s.engine for s in j.steps),
                      " ".join(str(s.cached_tokens) for s in j.steps))
    console.print(table)
    steps = [s for j in report.jobs for s in j.steps]
    later = [s for j in report.jobs for s in j.steps[1:]]
    per_engine = Counter(s.engine for s in steps)
    prompt = sum(s.prompt_tokens for s in steps)
    cached = sum(s.cached_tokens for s in steps)
    named = sum(j.state in NAMED_END_STATES for j in report.jobs)
    figures = Table(title="figures")
    figures.add_column("figure")
    figures.add_column("value", justify="right")
    rows: list[tuple[str, str]] = [
        ("jobs in named end states", f"{named}/{len(report.jobs)}"),
        ("by state", ", ".join(f"{k} {v}" for k, v in
                               sorted(Counter(j.state for j in report.jobs).items()))),
        ("steps per engine", ", ".join(
            f"{e.id}@{e.namespace} {per_engine.get(e.id, 0)}" for e in report.engines)),
        ("prompt tokens from cache", f"{cached:,}/{prompt:,} "
                                     f"({cached / prompt if prompt else 0:.1%})"),
        ("steps after a job's first with cached tokens",
         f"{sum(s.cached_tokens > 0 for s in later)}/{len(later)}"),
    ]
    if report.approval is not None:
        a = report.approval
        rows.append(("verified approval", f"{a.job_id} {a.approval_id}: {a.outcome} by "
                                          f"{a.decided_by} via {a.via}"))
    rows.append(("stand-in approvals (same service)", str(len(report.stand_in_approvals))))
    if report.batch is not None:
        b = report.batch
        rows.append(("batch", f"{b.batch_id} {b.state}: {b.done}/{b.records} records "
                              f"({', '.join(f'{k} {v}' for k, v in b.by_state.items())})"))
    rows.append(("wall time", ", ".join(f"{k} {v:.0f}s" for k, v in report.timings_s.items())))
    rows.append(("result", "PASS" if not report.problems else
                 "FAIL: " + "; ".join(report.problems)))
    for name, value in rows:
        figures.add_row(name, value)
    console.print(figures)


# ---- the driver (runs on wl-client) --------------------------------------------------


@dataclass(frozen=True)
class JobPlan:
    tickets: int
    invoices: int
    batch_records: int
    approval_jobs: int = 1

    @classmethod
    def for_jobs(cls, n: int) -> JobPlan:
        """``n`` jobs: 30% batch records, one payment that waits for a finance lead, the
        rest interactive ticket-triage and invoice-reconciliation jobs (2:1)."""
        if n < 4:
            raise ValueError("give at least 4 jobs (interactive, approval, batch)")
        batch = max(1, round(n * 0.3))
        rest = n - batch - 1
        return cls(tickets=rest - rest // 3, invoices=rest // 3, batch_records=batch)


class ApprovalsService:
    """The approvals service's HTTP API as one verified person (their bearer token):
    what `warmloop approvals / view / approve` call."""

    def __init__(self, http: Any, url: str, token: str) -> None:
        self.http, self.url, self.token = http, url.rstrip("/"), token

    async def _call(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        r = await self.http.request(method, self.url + path, json=body,
                                    headers={"Authorization": f"Bearer {self.token}"})
        if r.status_code >= 400:
            raise ApprovalError(f"{method} {path}: {r.status_code} {r.text[:200]}")
        return r.json()

    async def pending(self) -> list[Any]:
        from warmloop.workflows.contracts import PendingApproval

        return [PendingApproval.model_validate(p) for p in await self._call("GET",
                                                                           "/api/approvals")]

    @staticmethod
    def _path(job_id: str, approval_id: str, action: str) -> str:
        from urllib.parse import quote

        return (f"/api/approvals/{quote(job_id, safe='')}/{quote(approval_id, safe='')}/"
                f"{action}")

    async def view(self, job_id: str, approval_id: str) -> None:
        await self._call("POST", self._path(job_id, approval_id, "viewed"))

    async def decide(self, job_id: str, approval_id: str, *, approve: bool,
                     comment: str) -> Any:
        return await self._call("POST", self._path(job_id, approval_id, "decide"),
                                {"approve": approve, "comment": comment})


class ApprovalError(RuntimeError):
    """The approvals service refused a call (the message is its answer)."""


STAND_IN_ORDER = ("demo-bot", "carol", "bob", "alice", "dave")
"""Dev users tried, in order, for approvals the random model asks for (a two-person
payment needs a second, different one)."""


async def drive(settings: Settings, topology: Topology, n_jobs: int, report: MultiHostReport,
                log: Callable[[str], None], timeout_s: float) -> None:
    """Run the jobs from this host (wl-client) and fill ``report`` with how they ended."""
    import httpx

    from warmloop.workers.clients import build_s3, connect
    from warmloop.workers.demo import bundled_tasks
    from warmloop.workflows.agent_job import AgentJob
    from warmloop.workflows.batch_run import BatchResult
    from warmloop.workflows.contracts import (
        AGENT_TASK_QUEUE,
        FunctionCall,
        JobInput,
        ReplayScript,
        ReplayStep,
        ToolCall,
    )

    plan = JobPlan.for_jobs(n_jobs)
    run = report.run_id
    client = await connect(settings)
    tokens = json.loads((settings.state_dir / "auth" / "dev-tokens.json").read_text())
    roles = {u: set(tokens[u]["roles"]) for u in STAND_IN_ORDER}
    deadline = time.monotonic() + timeout_s

    # Interactive jobs, as a user's client would start them.
    tickets, invoices = bundled_tasks("ticket-triage"), bundled_tasks("invoice-reconciliation")
    started: list[tuple[Literal["interactive", "approval", "batch"], Any]] = []
    for i in range(plan.tickets):
        started.append(("interactive", await client.start_workflow(
            AgentJob.run, JobInput(profile="ticket-triage", task=tickets[i % len(tickets)],
                                   max_steps=5),
            id=f"mh-{run}-ticket-{i:02d}", task_queue=AGENT_TASK_QUEUE)))
    for i in range(plan.invoices):
        started.append(("interactive", await client.start_workflow(
            AgentJob.run, JobInput(profile="invoice-reconciliation",
                                   task=invoices[i % len(invoices)], max_steps=5),
            id=f"mh-{run}-invoice-{i:02d}", task_queue=AGENT_TASK_QUEUE)))

    # A payment over 5,000 (recorded calls, generated on the real engines): it waits for a
    # finance lead, whom only the approvals service can turn into a signed decision.
    def call(name: str, args: dict[str, Any], n: int) -> ToolCall:
        return ToolCall(id=f"call-{n}", function=FunctionCall(name=name,
                                                              arguments=json.dumps(args)))

    script = ReplayScript(ask_approvals=True, steps=[
        ReplayStep(call=call("approve_payment", {"invoice_id": "INV7301", "amount": 9000}, 1),
                   result="payment scheduled", output_tokens=8),
        ReplayStep(call=call("finish", {"outcome": "paid"}, 2), result="done", output_tokens=8),
    ])
    payment_id = f"mh-{run}-payment"
    started.append(("approval", await client.start_workflow(
        AgentJob.run, JobInput(profile="invoice-reconciliation", replay=script,
                               task={"invoice_id": "INV7301", "vendor_id": "V101",
                                     "po_number": "PO7301"},
                               hold_policy="never", submitted_by="erin"),
        id=payment_id, task_queue=AGENT_TASK_QUEUE)))

    # The batch: its source in S3 (no host reads another's files), started by the CLI.
    s3 = build_s3(settings)
    key = f"multihost/{run}/tickets.jsonl"
    body = "".join(json.dumps(tickets[(plan.tickets + i) % len(tickets)]) + "\n"
                   for i in range(plan.batch_records))
    await asyncio.to_thread(s3.put_object, Bucket=settings.s3_bucket, Key=key,
                            Body=body.encode())
    batch_id, source = f"mh-{run}-batch", f"s3://{settings.s3_bucket}/{key}"
    cli = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "warmloop.workers.cli", "batch", "run", source,
        "--profile", "ticket-triage", "--window", "3", "--max-steps", "4",
        "--batch-id", batch_id, stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT, env={**os.environ, "COLUMNS": "200"})
    cli_out, _ = await cli.communicate()
    if cli.returncode != 0:
        raise RuntimeError(f"warmloop batch run failed: {cli_out.decode()[-500:]}")
    log(f"{len(started)} jobs and batch {batch_id} ({plan.batch_records} records) started")

    done = asyncio.Event()
    async with httpx.AsyncClient(timeout=30.0) as http:
        services = {u: ApprovalsService(http, settings.approvals_url, tokens[u]["token"])
                    for u in STAND_IN_ORDER}

        async def bob_decides() -> None:
            """Bob, a finance lead, finds the payment in his pending list, opens it and
            approves it: the service verifies his token and signs the decision."""
            bob = services["bob"]
            while not done.is_set():
                try:
                    mine = [p for p in await bob.pending() if p.job_id == payment_id]
                    if mine:
                        p = mine[0]
                        await bob.view(p.job_id, p.approval_id)
                        await bob.decide(p.job_id, p.approval_id, approve=True,
                                         comment="matches PO7301 (multi-host run)")
                        report.approval = ApprovalRow(
                            job_id=p.job_id, approval_id=p.approval_id, kind=p.kind,
                            via=settings.approvals_url)
                        log(f"bob approved {p.approval_id} of {p.job_id} via "
                            f"{settings.approvals_url}")
                        return
                except (ApprovalError, httpx.HTTPError) as e:
                    log(f"bob: the approvals service answered {e}; asking again")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), timeout=0.5)

        async def stand_in() -> None:
            """Approve what the random model asks for, through the same service, as the
            first dev user whose roles the rule names (and who has not approved it)."""
            while not done.is_set():
                with contextlib.suppress(ApprovalError, httpx.HTTPError):
                    for p in await services["demo-bot"].pending():
                        if p.job_id == payment_id:
                            continue
                        who = next((u for u in STAND_IN_ORDER if roles[u] & set(p.approvers)
                                    and u not in p.approved_by), None)
                        if who is None:
                            continue
                        with contextlib.suppress(ApprovalError):
                            await services[who].decide(p.job_id, p.approval_id, approve=True,
                                                       comment="stand-in approver")
                            report.stand_in_approvals.append(ApprovalRow(
                                job_id=p.job_id, approval_id=p.approval_id, kind=p.kind,
                                outcome="approved", decided_by=who,
                                via=settings.approvals_url))
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(done.wait(), timeout=1.0)

        async def batch_and_children() -> tuple[Any, list[tuple[str, JobResult]]]:
            res = await client.get_workflow_handle(batch_id, result_type=BatchResult).result()
            children = []
            for line in range(1, res.records + 1):
                child = f"{batch_id}-L{line}"
                children.append((child, await client.get_workflow_handle(
                    child, result_type=JobResult).result()))
            return res, children

        approvers = [asyncio.create_task(bob_decides()), asyncio.create_task(stand_in())]
        job_tasks = {h.id: (kind, asyncio.ensure_future(h.result())) for kind, h in started}
        batch_task = asyncio.ensure_future(batch_and_children())
        waiting = [t for _, t in job_tasks.values()] + [batch_task]
        _, late = await asyncio.wait(waiting, timeout=max(1.0, deadline - time.monotonic()))
        done.set()
        for t in late:
            t.cancel()
        for t in approvers:
            with contextlib.suppress(Exception):
                await t
        if approvers[0].done() and not approvers[0].cancelled() and approvers[0].exception():
            log(f"bob's approval failed: {approvers[0].exception()}")

    for job_id, (kind, task) in job_tasks.items():
        if task.done() and not task.cancelled() and task.exception() is None:
            report.jobs.append(JobRow.of(kind, task.result()))
        else:
            why = ("still running when the run's time was up" if not task.done() or
                   task.cancelled() else f"the workflow failed: {task.exception()}")
            report.jobs.append(JobRow(job_id=job_id, kind=kind, profile="?", state=NOT_ENDED,
                                      reason=why))
    if batch_task.done() and not batch_task.cancelled() and batch_task.exception() is None:
        res, children = batch_task.result()
        report.batch = BatchRow(batch_id=batch_id, source=source, state=str(res.state),
                                reason=res.reason, records=res.records, done=res.done,
                                failed=res.failed, bad=res.bad, by_state=res.by_state)
        report.jobs += [JobRow.of("batch", r) for _, r in children]
    else:
        report.batch = BatchRow(batch_id=batch_id, source=source, state=NOT_ENDED)
        report.jobs += [JobRow(job_id=f"{batch_id}-L{line}", kind="batch", profile="?",
                               state=NOT_ENDED, reason="the batch had not ended")
                        for line in range(1, plan.batch_records + 1)]
    payment = next((j for j in report.jobs if j.job_id == payment_id), None)
    if report.approval is not None and payment is not None and payment.approvals:
        recorded = payment.approvals[0]
        report.approval = report.approval.model_copy(update={
            "outcome": recorded.outcome, "decided_by": recorded.decided_by,
            "comment": recorded.comment})


def inside(n_jobs: int, engines: int, state_dir: Path, report_path: Path,
           timeout_s: float) -> int:
    """On wl-client: start the parts on their hosts, run the jobs, report, stop them."""
    started_at = time.monotonic()

    def log(msg: str) -> None:
        print(f"[multihost +{time.monotonic() - started_at:5.1f}s] {msg}", file=sys.stderr,
              flush=True)

    topology = default_topology(engines)
    settings = multihost_settings(topology, state_dir)
    # Everything this process starts (the CLI) reads the same settings.
    os.environ.update(settings_env(settings))
    report = MultiHostReport(
        run_id=uuid.uuid4().hex[:6], subnet=topology.subnet,
        hosts=[HostRow(namespace=h.ns, address=h.address, parts=list(h.parts))
               for h in topology.hosts],
        engines=[EngineRow(id=e.id, url=e.url, namespace=topology.host_of(f"engine-{e.id}").ns,
                           kv_events=e.kv_events) for e in settings.engine_endpoints])
    stack = MultiHostStack(settings, topology, log=log)
    fresh_state(settings)
    try:
        t0 = time.monotonic()
        try:
            stack.up()
        except StackError as e:
            log(f"the stack did not come up: {e}")
            report.problems = [f"stack did not come up: {str(e).splitlines()[0]}"]
            _write(report, report_path)
            return 2
        report.timings_s["stack_up"] = round(time.monotonic() - t0, 1)
        for row in report.hosts:
            row.listeners = listeners(row.namespace)
        t0 = time.monotonic()
        try:
            asyncio.run(drive(settings, topology, n_jobs, report, log, timeout_s))
        except Exception as e:  # noqa: BLE001 - reported with what did run
            log(f"the driver failed: {e!r}")
            report.problems.append(f"the driver failed: {e!r}")
        report.timings_s["jobs"] = round(time.monotonic() - t0, 1)
        report.problems += report.check()
    finally:
        t0 = time.monotonic()
        stack.down()
        report.timings_s["stop"] = round(time.monotonic() - t0, 1)
        _write(report, report_path)
    return 0 if not report.problems else 1


def _write(report: MultiHostReport, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report.model_dump_json(indent=2) + "\n")


# ---- the launcher (root namespace) ---------------------------------------------------

DEFAULT_STATE_DIR = Path(".warmloop/multihost")


def run(n_jobs: int = 20, *, engines: int = 2, state_dir: Path = DEFAULT_STATE_DIR,
        report_path: Path | None = None, jobs_timeout_s: float = 420.0,
        total_timeout_s: float = 900.0) -> int:
    """Create the network, run everything on it, remove it. Returns the driver's exit
    status (0: every check passed; 1: a check failed; 2: the stack did not come up);
    the report is at ``report_path`` either way. Raises NetworkError when the network
    cannot be made (or another run holds it)."""
    if (reason := unavailable_reason()) is not None:
        raise NetworkError(reason)
    state_dir = state_dir.resolve()
    report_path = (report_path or state_dir / "report.json").resolve()
    report_path.unlink(missing_ok=True)
    began = time.monotonic()

    def log(msg: str) -> None:
        print(f"[multihost] {msg}", file=sys.stderr, flush=True)

    topology = default_topology(engines)
    with exclusive(state_dir), Network(topology, log).running():
        network_s = time.monotonic() - began
        cmd = ["ip", "netns", "exec", topology.client.ns, sys.executable, "-m",
               "warmloop.infra.multihost", "inside", "--jobs", str(n_jobs),
               "--engines", str(engines), "--state-dir", str(state_dir),
               "--report", str(report_path), "--timeout", str(jobs_timeout_s)]
        try:
            rc = subprocess.run(cmd, timeout=total_timeout_s).returncode
        except subprocess.TimeoutExpired:
            log(f"the run passed {total_timeout_s:.0f}s; stopping it")
            rc = 124
    if report_path.exists():
        report = MultiHostReport.model_validate_json(report_path.read_text())
        report.timings_s["network"] = round(network_s, 1)
        report.timings_s["total"] = round(time.monotonic() - began, 1)
        _write(report, report_path)
        summary(report, Console(width=200))
        log(f"report: {report_path}")
    return rc


def _interrupt(signum: int, frame: object) -> None:
    """SIGTERM (a CI job's timeout) unwinds like Ctrl-C, so the namespaces still go."""
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m warmloop.infra.multihost",
                                     description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    for name in ("run", "inside"):
        p = sub.add_parser(name, help="run the multi-host test" if name == "run" else
                           "internal: the driver, on wl-client")
        p.add_argument("--jobs", type=int, default=20)
        p.add_argument("--engines", type=int, default=2)
        p.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR)
        p.add_argument("--report", type=Path, default=None)
        p.add_argument("--timeout", type=float, default=420.0,
                       help="seconds the jobs may take once the stack is up")
    args = parser.parse_args(argv)
    if args.command == "inside":
        report = args.report or args.state_dir.resolve() / "report.json"
        raise SystemExit(inside(args.jobs, args.engines, args.state_dir.resolve(), report,
                                args.timeout))
    signal.signal(signal.SIGTERM, _interrupt)
    try:
        raise SystemExit(run(args.jobs, engines=args.engines, state_dir=args.state_dir,
                             report_path=args.report, jobs_timeout_s=args.timeout))
    except NetworkError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(1) from None
    except KeyboardInterrupt:
        print("interrupted; the namespaces and their processes are gone", file=sys.stderr)
        raise SystemExit(130) from None


if __name__ == "__main__":
    main()
