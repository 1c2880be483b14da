"""`make bench-faults`: a batch of agent jobs under one injected fault at a time.

Each scenario runs ``--jobs`` jobs of both bundled profiles (``ticket-triage`` and
``invoice-reconciliation``, every tool offered: side-effect tools and calls that wait
for a human included) on the bench's own embedded stack, injects one fault while they
run and reports, per scenario:

* named end states: jobs whose workflow completed with a ``JobResult`` in a terminal
  ``JobState``; a workflow failure, a job never started, or a job still running
  ``--deadline-s`` after the fault was cleared is not named;
* applied twice: ledger identities applied more than once (see ``EffectWatch``);
* transcripts lost: ended jobs whose transcript can be read neither inline in the result
  nor at its ``transcript_key`` in S3, or is shorter than its steps need;
* dead workers: the stack's worker processes (agent worker, inference workers) not alive
  at the scenario's end, by their pid files. A fault is cleared by restarting *only* the
  part it took down, so a worker that died on its own stays dead and is counted;
* recover_s: from clearing the fault (the restart starts, or SIGCONT) until a probe job,
  submitted right then, has finished (it queues behind the batch's own steps, so this is
  "the fleet serves a new job again", not an idle latency).

A stand-in approver decides pending approvals a few seconds after it first sees them,
through the ``decide`` Update with an allowed approver (one in four rejected, so REJECTED
occurs too), except in ``temporal_restart``, where they are left pending across the
restart and decided after it. The model has random weights: jobs call random valid
tools, and ``--max-steps`` keeps each scenario to a few minutes. Between scenarios the
stack is brought back to healthy (``Stack.up``). The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import signal
import time
import uuid
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import RedisError
from rich.console import Console
from rich.table import Table
from temporalio.client import (
    Client,
    WorkflowFailureError,
    WorkflowQueryFailedError,
    WorkflowUpdateFailedError,
)
from temporalio.common import WorkflowIDReusePolicy
from temporalio.service import RPCError

from bench.common import bench_settings, bench_stack, run_main
from warmloop.infra.stack import Stack
from warmloop.workers.approvals import PENDING_QUERY, ApprovalRefused, dev_approver
from warmloop.workers.clients import build_s3
from warmloop.workers.demo import bundled_tasks
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.batch_run import BatchInput, BatchResult, BatchRun
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    TERMINAL_STATES,
    JobInput,
    JobResult,
)

SCENARIOS = ["agent_worker_kill", "inference_worker_kill", "engine_kill", "engine_stall",
             "redis_kill", "redis_stall", "s3_restart_mid", "s3_restart_page",
             "temporal_restart", "cancel"]
PROFILES = ["ticket-triage", "invoice-reconciliation"]
WORKERS = ["agent-worker", "inference-worker-e0", "inference-worker-e1"]
PROBE_TOOLS = ["lookup_customer", "search_kb"]
"""The probe job never waits for a human: its time is the fleet's, not the approver's."""
EFFECT_PATTERN = "warmloop:effect:"
"""The ledger's record keys (``EffectLedger.key``); ``warmloop:effects:`` (its counters)
does not match ``warmloop:effect:*``."""


def log(console: Console, text: str) -> None:
    console.print(f"  {text}", highlight=False)


# ---- processes of the stack -----------------------------------------------------------------


def part_pid(stack: Stack, name: str) -> int | None:
    """The live pid of a part, from the stack's pid file (a zombie is not alive)."""
    try:
        pid = int((stack.run_dir / f"{name}.pid").read_text())
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, ValueError, IndexError):
        return None
    return None if state == "Z" else pid


def restart_part(stack: Stack, name: str) -> None:
    """Start only ``name`` again and wait until it is ready. ``Stack.up`` would also
    revive any other part that died by itself, which would hide a worker the fault
    killed as a side effect; this restarts only what the scenario took down."""
    part = next(p for p in stack.all_parts() if p.name == name)
    stack._start(part)
    stack._wait([part])


def dead_workers(stack: Stack) -> list[str]:
    return [w for w in WORKERS if part_pid(stack, w) is None]


# ---- side effects applied -------------------------------------------------------------------


class EffectWatch:
    """Counts real applications of side effects per ledger identity.

    An effect is applied exactly when ``EffectLedger.apply_once`` wins its ``SET NX`` on
    the identity's key (the toolset's ``effect`` is applied by that write; a repeat reads
    the record and writes nothing). Redis reports every successful SET as a keyspace
    notification (``notify-keyspace-events K$``), and a failed ``SET NX`` as none, so
    subscribing to ``__keyspace@0__:warmloop:effect:*`` observes each application as it
    happens, from outside the product.

    When Redis restarts (its ``run_id`` changes) the watch starts a new epoch and sets
    the notification option again (a restart loses it). The embedded Redis keeps its
    keys across a restart (an append-only file fsynced every second), so a key may be
    one application seen in two epochs. Notifications are cross-checked with scans:
    ``snapshot`` (right before Redis is killed, and at the scenario's end) marks every
    key of the scenario's jobs present in the current epoch. A key's applications are
    its notifications over all epochs, plus one for each epoch where it was scanned
    without a notification and had not been seen in an earlier epoch (an application in
    the instant between a restarted Redis accepting writes and the watch resubscribing;
    a key the append-only file brought back is not one). More than one is "applied
    twice".
    """

    def __init__(self, url: str, prefix: str) -> None:
        self._url = url
        self._prefix = prefix
        self._epoch = 0
        self._run_id: str | None = None
        self._sets: Counter[tuple[int, str]] = Counter()
        self._scanned: set[tuple[int, str]] = set()
        self._stop = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.subscribed = asyncio.Event()

    async def __aenter__(self) -> EffectWatch:
        self._task = asyncio.create_task(self._run())
        await asyncio.wait_for(self.subscribed.wait(), timeout=30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._stop.set()
        if self._task is not None:
            await self._task

    async def _run(self) -> None:
        channel = f"__keyspace@0__:{EFFECT_PATTERN}{self._prefix}*"
        while not self._stop.is_set():
            r = aioredis.Redis.from_url(self._url, socket_connect_timeout=1.0)
            try:
                run_id = str((await r.info("server"))["run_id"])
                if self._run_id is not None and run_id != self._run_id:
                    self._epoch += 1
                self._run_id = run_id
                await r.config_set("notify-keyspace-events", "K$")
                async with r.pubsub() as ps:
                    await ps.psubscribe(channel)
                    self.subscribed.set()
                    while not self._stop.is_set():
                        msg = await ps.get_message(ignore_subscribe_messages=True, timeout=0.5)
                        if msg and msg["data"] in (b"set", "set"):
                            ch = msg["channel"]
                            ch = ch.decode() if isinstance(ch, bytes) else ch
                            self._sets[(self._epoch, ch.split(":", 1)[1])] += 1
            except (RedisError, OSError):
                await asyncio.sleep(0.1)
            finally:
                with contextlib.suppress(RedisError, OSError):
                    await r.aclose()

    async def snapshot(self, timeout_s: float = 10.0) -> None:
        """Mark the scenario's keys now in Redis as applied in the current epoch."""
        r = aioredis.Redis.from_url(self._url, socket_timeout=timeout_s,
                                    socket_connect_timeout=2.0)
        try:
            async for key in r.scan_iter(match=f"{EFFECT_PATTERN}{self._prefix}*", count=500):
                self._scanned.add((self._epoch, key.decode() if isinstance(key, bytes) else key))
        finally:
            await r.aclose()

    def applications(self) -> dict[str, int]:
        keys = {k for _, k in self._sets} | {k for _, k in self._scanned}
        out: dict[str, int] = {}
        for key in keys:
            n, seen = 0, False
            for e in range(self._epoch + 1):
                sets = self._sets[(e, key)]
                n += sets
                if not sets and (e, key) in self._scanned and not seen:
                    n += 1  # applied unobserved (a resubscribe gap), seen only by the scan
                seen = seen or sets > 0 or (e, key) in self._scanned
            out[key] = n
        return out


# ---- jobs, approvals, results ----------------------------------------------------------------


@dataclass
class Run:
    """What one scenario shares with its fault."""

    name: str
    prefix: str
    stack: Stack
    settings: Settings
    client: Client
    watch: EffectWatch
    console: Console
    args: argparse.Namespace
    job_ids: list[str] = field(default_factory=list)
    hold_approvals: asyncio.Event = field(default_factory=asyncio.Event)
    """Set: the approver leaves approvals pending (temporal_restart)."""
    pending_seen: int = 0
    notes: list[str] = field(default_factory=list)
    batches: list[str] = field(default_factory=list)


def tasks_for(n: int) -> list[tuple[str, dict[str, Any]]]:
    """``n`` tasks, alternating the two bundled profiles over their bundled records."""
    pools = {p: bundled_tasks(p) for p in PROFILES}
    return [(PROFILES[i % 2], pools[PROFILES[i % 2]][(i // 2) % len(pools[PROFILES[i % 2]])])
            for i in range(n)]


async def retry_rpc(fn: Callable[[], Awaitable[Any]], until: float) -> Any:
    """``fn`` tried again while Temporal is unreachable (a restarting server)."""
    while True:
        try:
            return await fn()
        except RPCError:
            if time.monotonic() > until:
                raise
            await asyncio.sleep(1.0)


async def submit_jobs(run: Run) -> None:
    for i, (profile, task) in enumerate(tasks_for(run.args.jobs)):
        jid = f"{run.prefix}-{i:03d}"
        await run.client.start_workflow(
            AgentJob.run, JobInput(profile=profile, task=task, max_steps=run.args.max_steps),
            id=jid, task_queue=AGENT_TASK_QUEUE,
            id_reuse_policy=WorkflowIDReusePolicy.REJECT_DUPLICATE)
        run.job_ids.append(jid)


async def approver(run: Run, stop: asyncio.Event) -> None:
    """Decide this scenario's pending approvals ``--approve-after-s`` after first seeing
    them (the jobs found by the pending-approval search attribute, as ``warmloop
    approvals`` does; details by the ``pending_approvals`` query)."""
    first_seen: dict[str, float] = {}
    decided = 0
    bot = dev_approver(run.settings)
    query = f"{PENDING_QUERY} AND WorkflowId STARTS_WITH '{run.prefix}'"
    while not stop.is_set():
        with contextlib.suppress(RPCError, WorkflowQueryFailedError, WorkflowUpdateFailedError,
                                 asyncio.TimeoutError):
            async for wf in run.client.list_workflows(query):
                h = run.client.get_workflow_handle(wf.id, result_type=JobResult)
                for p in await h.query(AgentJob.pending_approvals):
                    if p.approval_id not in first_seen:
                        first_seen[p.approval_id] = time.monotonic()
                        run.pending_seen += 1
                    if run.hold_approvals.is_set() or \
                            time.monotonic() - first_seen[p.approval_id] < run.args.approve_after_s:
                        continue
                    decided += 1
                    with contextlib.suppress(WorkflowUpdateFailedError, ApprovalRefused):
                        await asyncio.wait_for(bot.decide(
                            run.client, wf.id, p.approval_id, approve=decided % 4 != 0,
                            comment="bench-faults approver"), 30)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(stop.wait(), timeout=1.0)


async def pending_approvals(run: Run) -> int:
    query = f"{PENDING_QUERY} AND WorkflowId STARTS_WITH '{run.prefix}'"
    n = 0
    async for wf in run.client.list_workflows(query):
        h = run.client.get_workflow_handle(wf.id, result_type=JobResult)
        with contextlib.suppress(WorkflowQueryFailedError):
            n += len(await h.query(AgentJob.pending_approvals))
    return n


async def result_of(client: Client, job_id: str, until: float,
                    result_type: type[Any] = JobResult) -> Any:
    """The workflow's result (a ``JobResult`` unless said), or why there is none as a
    string (a failure, never started, or still running at ``until``)."""
    handle = client.get_workflow_handle(job_id, result_type=result_type)
    while True:
        left = until - time.monotonic()
        if left <= 0:
            return "still running at the deadline"
        try:
            return await asyncio.wait_for(handle.result(), timeout=left)
        except WorkflowFailureError as e:
            return f"workflow failure: {e.cause or e}"
        except TimeoutError:
            return "still running at the deadline"
        except RPCError as e:
            if "not found" in str(e).lower():
                return "never started"
            await asyncio.sleep(1.0)  # Temporal restarting: ask again


def transcript_readable(s3: Any, bucket: str, res: JobResult) -> bool:
    """The transcript is inline, or at ``transcript_key``, and at least as long as the
    result says (``transcript_messages``) and its steps need (one message each)."""
    need = max(res.transcript_messages, len(res.steps))
    if res.transcript:
        return len(res.transcript) >= need
    if need == 0:
        return True
    if not res.transcript_key:
        return False
    try:
        body = s3.get_object(Bucket=bucket, Key=res.transcript_key)["Body"].read()
        return len(json.loads(body)) >= need
    except Exception:
        return False


async def probe(run: Run, t_clear: float) -> float | None:
    """Seconds from ``t_clear`` until a job submitted now (retried while Temporal is down)
    has finished in a named state; None when it did not within the deadline."""
    until = t_clear + run.args.deadline_s
    jid = f"{run.prefix}-probe"
    try:
        await retry_rpc(lambda: run.client.start_workflow(
            AgentJob.run, JobInput(profile="ticket-triage", task=bundled_tasks()[0],
                                   tools=PROBE_TOOLS, max_steps=2),
            id=jid, task_queue=AGENT_TASK_QUEUE), until)
    except RPCError as e:
        run.notes.append(f"probe not submitted: {e}")
        return None
    res = await result_of(run.client, jid, until)
    if isinstance(res, str):
        run.notes.append(f"probe: {res}")
        return None
    return time.monotonic() - t_clear


# ---- the faults --------------------------------------------------------------------------------
# Each runs while the jobs do, and returns the monotonic time its fault was cleared.


async def settle(run: Run) -> None:
    """Let the batch get going, so that the fault hits jobs mid-way: until a fifth of
    the jobs have ended, or ``--fault-after-s`` has passed, whichever comes first."""
    until = time.monotonic() + run.args.fault_after_s
    query = f"WorkflowId STARTS_WITH '{run.prefix}' AND ExecutionStatus != 'Running'"
    while time.monotonic() < until:
        with contextlib.suppress(RPCError):
            closed = (await run.client.count_workflows(query)).count
            if closed >= max(1, len(run.job_ids) // 5):
                log(run.console, f"{closed} jobs ended; injecting the fault")
                return
        await asyncio.sleep(1.0)
    log(run.console, f"{run.args.fault_after_s:.0f}s passed; injecting the fault")


async def kill_and_restart(run: Run, part: str, down_s: float = 0.0) -> float:
    await settle(run)
    pid = run.stack.stop_part(part, signal.SIGKILL)
    log(run.console, f"SIGKILL {part} (pid {pid})")
    if down_s:
        await asyncio.sleep(down_s)
    t_clear = time.monotonic()
    log(run.console, f"restarting {part}")
    await asyncio.to_thread(restart_part, run.stack, part)
    return t_clear


async def stall(run: Run, part: str, seconds: float, *, group: bool) -> float:
    await settle(run)
    pid = part_pid(run.stack, part)
    if pid is None:
        raise RuntimeError(f"{part} is not running")
    send = os.killpg if group else os.kill
    send(pid, signal.SIGSTOP)
    log(run.console, f"SIGSTOP {part} (pid {pid}{' group' if group else ''}) for {seconds:.0f}s")
    try:
        await asyncio.sleep(seconds)
    finally:
        send(pid, signal.SIGCONT)
    log(run.console, f"SIGCONT {part}")
    return time.monotonic()


async def fault_redis_kill(run: Run) -> float:
    await settle(run)
    await run.watch.snapshot()  # the effects this Redis holds, before it loses them
    pid = run.stack.stop_part("redis", signal.SIGKILL)
    log(run.console, f"SIGKILL redis (pid {pid}); down for {run.args.redis_down_s:.0f}s")
    await asyncio.sleep(run.args.redis_down_s)
    t_clear = time.monotonic()
    await asyncio.to_thread(restart_part, run.stack, "redis")
    log(run.console, "redis restarted (empty)")
    return t_clear


async def fault_s3_page(run: Run) -> float:
    """Restart S3 as soon as a batch's second page has children running."""
    handle = run.client.get_workflow_handle(run.batches[0], result_type=BatchResult)
    until = time.monotonic() + 600
    while time.monotonic() < until:
        with contextlib.suppress(RPCError, WorkflowQueryFailedError):
            p = await handle.query(BatchRun.progress)
            if p.pages >= 1 and p.running > 0:
                log(run.console, f"batch {p.batch_id}: page {p.pages + 1} started "
                    f"({p.running} children running, {p.done} done)")
                break
        await asyncio.sleep(0.2)
    else:
        run.notes.append("no page boundary seen: S3 restarted anyway")
    run.stack.stop_part("s3", signal.SIGKILL)
    t_clear = time.monotonic()
    await asyncio.to_thread(restart_part, run.stack, "s3")
    log(run.console, "s3 restarted (empty, bucket created again)")
    return t_clear


async def fault_s3_mid(run: Run) -> float:
    return await kill_and_restart(run, "s3")


async def fault_temporal(run: Run) -> float:
    """Hold the approver, wait for approvals pending (up to 90 s), restart Temporal,
    then let the approver decide."""
    run.hold_approvals.set()
    await settle(run)
    until = time.monotonic() + 90
    pending = 0
    while time.monotonic() < until:
        with contextlib.suppress(RPCError):
            pending = await pending_approvals(run)
        if pending >= 2:
            break
        await asyncio.sleep(1.0)
    log(run.console, f"{pending} approvals pending; SIGKILL temporal")
    run.notes.append(f"{pending} approvals pending at the restart")
    run.stack.stop_part("temporal", signal.SIGKILL)
    await asyncio.sleep(2.0)
    t_clear = time.monotonic()
    await asyncio.to_thread(restart_part, run.stack, "temporal")
    log(run.console, "temporal restarted on its database")
    await asyncio.sleep(run.args.approve_after_s)
    run.hold_approvals.clear()
    return t_clear


async def fault_cancel(run: Run) -> float:
    """Cancel 10 jobs: half while a model step (``generate``) is pending, half while a
    tool call (``run_tool``) is, as Temporal's pending activities show; a job caught in
    neither within ``--cancel-window-s`` is cancelled as it is, and noted."""
    await settle(run)
    want = {"generate": 5, "run_tool": 5}
    caught: Counter[str] = Counter()
    done: set[str] = set()
    until = time.monotonic() + run.args.cancel_window_s
    while sum(want.values()) > sum(caught.values()) and time.monotonic() < until:
        for jid in run.job_ids:
            if jid in done or sum(caught.values()) >= sum(want.values()):
                continue
            h = run.client.get_workflow_handle(jid)
            try:
                desc = await h.describe()
            except RPCError:
                continue
            if desc.status is None or desc.status.name != "RUNNING":
                done.add(jid)
                continue
            kinds = {a.activity_type.name for a in desc.raw_description.pending_activities}
            for kind in ("run_tool", "generate"):
                if kind in kinds and caught[kind] < want[kind]:
                    await h.cancel()
                    caught[kind] += 1
                    done.add(jid)
                    break
    left = sum(want.values()) - sum(caught.values())
    for jid in [j for j in run.job_ids if j not in done][:left]:
        await run.client.get_workflow_handle(jid).cancel()
        caught["other"] += 1
    run.notes.append("cancelled: " + ", ".join(f"{k} {v}" for k, v in caught.items()))
    return time.monotonic()


FAULTS: dict[str, Callable[[Run], Awaitable[float]]] = {
    "agent_worker_kill": lambda r: kill_and_restart(r, "agent-worker"),
    "inference_worker_kill": lambda r: kill_and_restart(r, "inference-worker-e1"),
    "engine_kill": lambda r: kill_and_restart(r, "engine-e1"),
    "engine_stall": lambda r: stall(r, "engine-e1", r.args.engine_stall_s, group=True),
    "redis_kill": fault_redis_kill,
    "redis_stall": lambda r: stall(r, "redis", r.args.redis_stall_s, group=False),
    "s3_restart_mid": fault_s3_mid,
    "s3_restart_page": fault_s3_page,
    "temporal_restart": fault_temporal,
    "cancel": fault_cancel,
}


# ---- a scenario ------------------------------------------------------------------------------


async def submit_batches(run: Run) -> None:
    """The jobs as one ``BatchRun`` per profile, from local JSONL files (an S3 source
    would be lost with S3's memory, which is not what this scenario tests)."""
    per = {p: [t for q, t in tasks_for(run.args.jobs) if q == p] for p in PROFILES}
    for profile, tasks in per.items():
        src = run.settings.state_dir / f"{run.prefix}-{profile}.jsonl"
        src.write_text("".join(json.dumps(t) + "\n" for t in tasks))
        bid = f"{run.prefix}-{profile}"
        await run.client.start_workflow(
            BatchRun.run, BatchInput(profile=profile, source=str(src.resolve()),
                                     window=run.args.page_size, page_size=run.args.page_size,
                                     max_steps=run.args.max_steps),
            id=bid, task_queue=AGENT_TASK_QUEUE)
        run.batches.append(bid)
        run.job_ids += [f"{bid}-L{line}" for line in range(1, len(tasks) + 1)]


async def scenario(name: str, stack: Stack, settings: Settings, client: Client,
                   console: Console, args: argparse.Namespace, tag: str) -> dict[str, Any]:
    console.print(f"[bold]scenario {name}[/bold]: {args.jobs} jobs")
    await asyncio.to_thread(stack.up)  # healthy again after the previous scenario
    s3 = build_s3(settings)
    prefix = f"faults-{tag}-{name.replace('_', '-')}"
    async with EffectWatch(settings.redis_url, prefix) as watch:
        run = Run(name=name, prefix=prefix, stack=stack, settings=settings, client=client,
                  watch=watch, console=console, args=args)
        stop = asyncio.Event()
        t0 = time.monotonic()
        if name == "s3_restart_page":
            await submit_batches(run)
        else:
            await submit_jobs(run)
        approving = asyncio.create_task(approver(run, stop))
        t_clear = await FAULTS[name](run)
        log(console, f"fault cleared at +{t_clear - t0:.0f}s; probing")
        recover_s = await probe(run, t_clear)
        until = t_clear + args.deadline_s
        # a batch's later pages start their children only after the earlier pages end:
        # its children are read once it has ended (a missing one then never started)
        for bid in run.batches:
            bres = await result_of(client, bid, until, BatchResult)
            if isinstance(bres, str):
                run.notes.append(f"batch {bid}: {bres}")
            else:
                lost = sum(1 for k in bres.result_keys if not _s3_has(s3, settings, k))
                run.notes.append(f"batch {bid.rsplit('-', 1)[-1]}: {bres.state.value}, "
                                 f"{bres.done} done, {bres.failed} failed, result pages "
                                 f"lost from S3 {lost}/{len(bres.result_keys)}")
        results = await asyncio.gather(*(result_of(client, j, until) for j in run.job_ids))
        stop.set()
        await approving
        await watch.snapshot()
    ended = [r for r in results if isinstance(r, JobResult) and r.state in TERMINAL_STATES]
    apps = watch.applications()
    out = {
        "jobs": len(run.job_ids),
        "named_end_states": len(ended),
        "applied_twice": sum(1 for n in apps.values() if n > 1),
        "transcripts_lost": sum(1 for r in ended
                                if not transcript_readable(s3, settings.s3_bucket, r)),
        "dead_workers": len(dead := dead_workers(stack)),
        "recover_s": None if recover_s is None else round(recover_s, 1),
    }
    states = Counter(r.state.value if isinstance(r, JobResult) else r for r in results)
    gone = sum(1 for r in ended if r.transcript_key and not _s3_has(s3, settings,
                                                                 r.transcript_key))
    if gone:  # inline in the result, so not lost; S3's copy is gone (an S3 restart)
        run.notes.append(f"{gone} transcripts' S3 copies missing (kept inline)")
    run.notes.append(f"end states {dict(states)}; {len(apps)} effects applied; "
                     f"{run.pending_seen} approvals seen; {time.monotonic() - t0:.0f}s")
    if dead:
        run.notes.append(f"dead: {', '.join(dead)}")
    for n in run.notes:
        log(console, n)
    log(console, json.dumps(out))
    return {"figures": out, "notes": run.notes}


def _s3_has(s3: Any, settings: Settings, key: str) -> bool:
    try:
        s3.head_object(Bucket=settings.s3_bucket, Key=key)
        return True
    except Exception:
        return False


async def main_async(args: argparse.Namespace, console: Console) -> dict[str, Any]:
    settings = bench_settings("faults", engines=2,
                              kv_cache_bytes=args.kv_cache_bytes)
    stack = Stack(settings, log=lambda m: console.print(f"  {m}", highlight=False))
    tag = uuid.uuid4().hex[:6]
    out: dict[str, dict[str, Any]] = {}
    async with bench_stack(settings, console, keep=args.keep_stack) as fleet:
        for name in args.scenarios:
            out[name] = await scenario(name, stack, settings, fleet.client, console, args, tag)
        await asyncio.to_thread(stack.up)  # leave it healthy for --keep-stack
    table = Table(title=f"bench-faults: {args.jobs} jobs per scenario, max {args.max_steps} "
                  "steps (target: all named, 0, 0, 0)")
    for c in ("scenario", "named end states / jobs", "applied twice", "transcripts lost",
              "dead workers", "recover s"):
        table.add_column(c, justify="right")
    for name, r in out.items():
        f = r["figures"]
        table.add_row(name, f"{f['named_end_states']} / {f['jobs']}", str(f["applied_twice"]),
                      str(f["transcripts_lost"]), str(f["dead_workers"]),
                      "-" if f["recover_s"] is None else f"{f['recover_s']:.1f}")
    console.print(table)
    return {"scenarios": {k: v["figures"] for k, v in out.items()}}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=60)
    p.add_argument("--max-steps", type=int, default=6)
    p.add_argument("--scenarios", nargs="+", default=SCENARIOS, choices=SCENARIOS)
    p.add_argument("--fault-after-s", type=float, default=45.0,
                   help="the fault comes a fifth of the jobs ended or this long after the "
                   "batch's submission, whichever is first")
    p.add_argument("--approve-after-s", type=float, default=3.0)
    p.add_argument("--deadline-s", type=float, default=600.0,
                   help="jobs still running this long after the fault is cleared are not named")
    p.add_argument("--engine-stall-s", type=float, default=30.0)
    p.add_argument("--redis-down-s", type=float, default=30.0)
    p.add_argument("--redis-stall-s", type=float, default=20.0)
    p.add_argument("--cancel-window-s", type=float, default=60.0)
    p.add_argument("--page-size", type=int, default=10,
                   help="records per BatchRun page (s3_restart_page); also its window")
    p.add_argument("--kv-cache-bytes", type=int, default=32 * 1024 * 1024)
    p.add_argument("--keep-stack", action="store_true")
    run_main(p, main_async, argv, console=Console(width=120))


if __name__ == "__main__":
    main()
