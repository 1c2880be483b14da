"""Per-step routing on the real stack: failover when a job's engine dies, the cache-bust
detector against a real engine, and the prefix directory's predictions checked against
the engines' own ``cached_tokens``."""

from __future__ import annotations

import asyncio
import dataclasses
import signal
import time
import uuid
from collections.abc import Iterator
from datetime import datetime

import httpx
import pytest
import redis.asyncio as aioredis
from temporalio.client import Client, WorkflowHandle
from temporalio.testing import ActivityEnvironment

from tests.integration.cli import warmloop
from tests.polling import eventually
from warmloop.activities.cachebust import (
    BUST_COUNTS,
    BUST_RECENT,
    CacheBust,
    CacheBustDetector,
    bust_report,
)
from warmloop.activities.directory import JOB_CHAIN, PROFILE_CHAIN, PrefixDirectory
from warmloop.activities.inference import InferenceActivities
from warmloop.activities.registry import EngineRegistry
from warmloop.activities.transcripts import TranscriptStore
from warmloop.infra.stack import Stack
from warmloop.workers.clients import build_s3
from warmloop.workers.demo import bundled_tickets
from warmloop.workers.inference_worker import probe_engine
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.contracts import (
    AGENT_TASK_QUEUE,
    ChatMessage,
    FunctionCall,
    GenerateRequest,
    GenerateResult,
    JobInput,
    JobResult,
    JobState,
    StepRecord,
    ToolCall,
)
from warmloop.workflows.profiles import REGISTRY, get_profile

pytestmark = pytest.mark.integration

TRIAGE = get_profile("ticket-triage")
# Neither tool ends the job or waits for a human: a job offered only these runs to its
# step cap, so it is still running when its engine is killed.
NO_FINISH = ["search_kb", "lookup_customer"]
# ... and no per-tool cap ends it before its step cap either.
UNCAPPED = {t.name: 10_000 for t in TRIAGE.tools}



async def _live_engines(redis: aioredis.Redis, settings: Settings) -> set[str]:
    return {e.engine_id for e in await EngineRegistry(redis, ttl_s=settings.engine_ttl_s).live()}


# ---- 1. failover ----------------------------------------------------------------------


async def test_a_job_survives_its_engine_and_worker_being_killed_mid_job(
    client: Client, stack: Stack, settings: Settings, redis: aioredis.Redis
) -> None:
    all_engines = {e.id for e in settings.engine_endpoints}
    if len(all_engines) < 2:
        pytest.skip("failover needs at least two engines")
    assert await _live_engines(redis, settings) == all_engines, "fleet not whole at start"

    max_steps = 8
    job = JobInput(profile="ticket-triage", task=bundled_tickets()[4], tools=NO_FINISH,
                   limits=JobLimits(max_steps=max_steps, max_tool_calls=UNCAPPED),
                   step_pickup_timeout_s=5)
    handle = await client.start_workflow(AgentJob.run, job, id=f"failover-{uuid.uuid4().hex[:8]}",
                                         task_queue=AGENT_TASK_QUEUE)
    killed: str | None = None
    try:
        async def progressed() -> tuple[int, str] | None:
            st = await handle.query(AgentJob.status)
            return (st.step, st.engine_id) if st.step >= 2 and st.engine_id else None

        done_at_kill, killed = await eventually(progressed, attempts=1200, interval_s=0.05)
        t_kill = time.monotonic()
        assert await asyncio.to_thread(stack.stop_part, f"engine-{killed}", signal.SIGKILL)
        assert await asyncio.to_thread(stack.stop_part, f"inference-worker-{killed}",
                                       signal.SIGKILL)
        print(f"killed engine {killed} and its worker after {done_at_kill} steps")
        res = await asyncio.wait_for(handle.result(), timeout=300)
        print(f"job ended {res.state} {time.monotonic() - t_kill:.1f}s after the kill: "
              + ", ".join(f"{s.step}:{s.engine_id}/{s.route_reason}/{s.cached_tokens}"
                          for s in res.steps))

        survivor_ids = all_engines - {killed}
        assert res.state in (JobState.FINISHED, JobState.LOOP_CAP), res.reason
        assert res.state == JobState.FINISHED or res.reason == f"step cap of {max_steps} reached", (
            res.reason)
        assert [s.step for s in res.steps] == list(range(1, max_steps + 1)), res.steps
        # The step in flight at the kill may have finished on the dead engine just before
        # it died; every step after it was routed after the kill and must run elsewhere.
        after = [s for s in res.steps if s.step > done_at_kill + 1]
        assert len(after) >= 2, f"job too far along at the kill ({done_at_kill} steps)"
        assert all(s.engine_id in survivor_ids for s in after), res.steps
        moved = [s for s in res.steps if s.step > done_at_kill and s.engine_id != killed]
        assert moved, res.steps
        first = moved[0]
        # It left its engine by failover (the dead engine's queue timed out) or because
        # the dead engine had left the registry: never "sticky" to an engine it never used.
        assert (any(s.route_reason == "failover" for s in res.steps)
                or first.route_reason in ("least_loaded", "prefix")), res.steps
        if first.route_reason == "failover":
            assert first.retries >= 1
        new_engine = first.engine_id
        on_new = [s for s in res.steps if s.step > first.step]
        assert all(s.engine_id == new_engine for s in on_new), res.steps
        assert all(s.route_reason == "sticky" for s in on_new), res.steps
        # The transcript moved with the job and the new engine cached it from then on.
        assert all(s.cached_tokens > 0 for s in on_new), res.steps
        assert all(s.cached_tokens <= s.prompt_tokens for s in res.steps)
        assert sum(1 for m in res.transcript if m.role == "assistant") == max_steps
    finally:
        if killed is not None:
            started = await asyncio.to_thread(Stack(settings).up)
            print(f"restarted {started}")

            async def fleet_whole() -> bool:
                return await _live_engines(redis, settings) == all_engines

            await eventually(fleet_whole, attempts=600, interval_s=0.5)
            out = await asyncio.to_thread(warmloop, "engines", "--json")
            assert out.returncode == 0, out.stderr
            assert f'"engine_id": "{killed}"' in out.stdout


# ---- 2. cache-bust detector -------------------------------------------------------------


@pytest.fixture
def test_profiles() -> Iterator[tuple[str, str]]:
    """Two throwaway variants of ticket-triage: one will get a timestamped system prompt
    (re-registered per job), one stays as it is (the control)."""
    tag = uuid.uuid4().hex[:8]
    stamped, control = f"bust-{tag}", f"nobust-{tag}"
    REGISTRY.add(dataclasses.replace(TRIAGE, name=control), source="test")
    try:
        yield stamped, control
    finally:
        REGISTRY.remove(stamped)
        REGISTRY.remove(control)


def _stamp(name: str) -> None:
    """What a template rendering ``now()`` into the system prompt does, per job."""
    REGISTRY.remove(name)
    REGISTRY.add(dataclasses.replace(
        TRIAGE, name=name, system_prompt=f"Now: {datetime.now().isoformat()}\n"
        + TRIAGE.system_prompt), source="test")


def _tool_turn(call_id: str, customer: str, answer: str) -> list[ChatMessage]:
    call = ToolCall(id=call_id, function=FunctionCall(
        name="lookup_customer", arguments=f'{{"customer_id":"{customer}"}}'))
    return [ChatMessage(role="assistant", tool_calls=[call]),
            ChatMessage(role="tool", tool_call_id=call_id, content=answer)]


async def _forget(redis: aioredis.Redis, profiles: tuple[str, ...], jobs: list[str]) -> None:
    """Remove what the test's synthetic profiles left in Redis, so `warmloop doctor`
    does not report the busts this test provoked on purpose."""
    await redis.hdel(BUST_COUNTS, *[f"{p}|{k}" for p in profiles
                                    for k in ("stable_prefix", "job_prefix")])
    for raw in await redis.lrange(BUST_RECENT, 0, -1):
        text = raw.decode() if isinstance(raw, bytes) else str(raw)
        if CacheBust.model_validate_json(text).profile in profiles:
            await redis.lrem(BUST_RECENT, 0, text)
    await redis.delete(*[PROFILE_CHAIN.format(p) for p in profiles],
                       *[JOB_CHAIN.format(j) for j in jobs])


async def test_a_timestamp_in_the_system_prompt_fires_the_cache_bust_detector(
    stack: Stack, settings: Settings, redis: aioredis.Redis,
    test_profiles: tuple[str, str],
) -> None:
    stamped, control = test_profiles
    engine = settings.engine_endpoints[0]
    tickets = bundled_tickets()
    seen: list[CacheBust] = []
    directory = PrefixDirectory(redis)
    tag = uuid.uuid4().hex[:6]
    jobs: list[str] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0)) as http:
        hb = await probe_engine(http, engine)
        assert hb.healthy and hb.block_size > 1, hb
        acts = InferenceActivities(
            engine_id=engine.id, base_url=engine.url, model=engine.model, http=http,
            transcripts=TranscriptStore(build_s3(settings), settings.s3_bucket),
            directory=directory,
            registry=EngineRegistry(redis, ttl_s=settings.engine_ttl_s),
            detector=CacheBustDetector(redis, directory, on_bust=seen.append),
            engine_info=lambda: hb,
        )
        env = ActivityEnvironment()

        async def step(profile: str, job: str, n: int, ticket: int, *, base_len: int = 0,
                       new: list[ChatMessage] | None = None) -> GenerateResult:
            if job not in jobs:
                jobs.append(job)
            req = GenerateRequest(
                job_id=job, step=n, profile=profile, task=tickets[ticket], base_len=base_len,
                new_messages=new or [], tail=f"Budget: {9 - n} steps left.",
                tools=NO_FINISH, max_tokens=24)
            res: GenerateResult = await env.run(acts.generate, req)
            # the step's directory and bust records are written after it returns
            assert await acts.drain() == 0
            assert res.engine_id == engine.id and res.prompt_tokens > 0
            return res

        def busts(job: str) -> list[CacheBust]:
            return [b for b in seen if b.job_id == job]

        try:
            # Across jobs: a timestamp at the start of the system prompt changes block 0.
            s1, s2 = f"st-{tag}-1", f"st-{tag}-2"
            _stamp(stamped)
            await step(stamped, s1, 1, 0)
            assert busts(s1) == []  # the profile's first job sets the reference
            _stamp(stamped)
            await step(stamped, s2, 1, 1)
            assert [(b.kind, b.block, b.step, b.profile) for b in busts(s2)] == [
                ("stable_prefix", 0, 1, stamped)]
            assert busts(s2)[0].token_offset == 0

            # The control (same prompt for every job, different tickets): nothing.
            c1, c2 = f"ctl-{tag}-1", f"ctl-{tag}-2"
            await step(control, c1, 1, 0)
            second = await step(control, c2, 1, 1)
            assert busts(c1) == [] and busts(c2) == []
            # ... and its stable prefix really was shared: the engine had it cached.
            assert second.cached_tokens >= hb.block_size

            # Within a job: an append-only step 2 extends step 1, no bust.
            a = f"app-{tag}"
            await step(control, a, 1, 2, new=_tool_turn("c1", "C101", "plan: pro. " * 60))
            res2 = await step(control, a, 2, 2, base_len=2,
                              new=_tool_turn("c2", "C102", "plan: free. " * 10))
            assert busts(a) == []
            assert res2.cached_tokens >= res2.prompt_tokens // 2, res2

            # A step 2 that rewrites the stored transcript from its start: job_prefix.
            w = f"rw-{tag}"
            first = await step(control, w, 1, 3,
                               new=_tool_turn("c1", "C103", "plan: pro. " * 120))
            await step(control, w, 2, 3, base_len=0,
                       new=_tool_turn("c1", "C103", "region: EU. " * 120)
                       + _tool_turn("c2", "C104", "plan: free."))
            [bust] = busts(w)
            assert (bust.kind, bust.step, bust.profile) == ("job_prefix", 2, control)
            # The difference lies after the system prompt and tools, inside what step 1
            # left reusable (its prompt minus the tail).
            stable = _common(await _render(http, settings, user="a", tools=NO_FINISH),
                             await _render(http, settings, user="b", tools=NO_FINISH))
            assert stable // hb.block_size <= bust.block < first.prompt_tokens // hb.block_size

            # What was recorded in Redis matches what the detector returned.
            counts, recent = await bust_report(redis)
            assert counts.get((stamped, "stable_prefix")) == 1
            assert (control, "stable_prefix") not in counts
            assert counts.get((control, "job_prefix")) == 1
            mine = {(b.job_id, b.kind, b.block) for b in recent if b.profile in test_profiles}
            assert mine == {(b.job_id, b.kind, b.block) for b in seen}
        finally:
            await _forget(redis, test_profiles, jobs)


# ---- 3. prefix directory accuracy -------------------------------------------------------


async def _run_jobs(client: Client, n: int, max_steps: int) -> list[JobResult]:
    tickets = bundled_tickets()
    tag = uuid.uuid4().hex[:6]
    handles: list[WorkflowHandle[AgentJob, JobResult]] = [
        await client.start_workflow(
            AgentJob.run,
            JobInput(profile="ticket-triage", task=tickets[10 + i], tools=NO_FINISH,
                     limits=JobLimits(max_steps=max_steps, max_tool_calls=UNCAPPED)),
            id=f"dir-{tag}-{i}", task_queue=AGENT_TASK_QUEUE)
        for i in range(n)
    ]
    return list(await asyncio.wait_for(asyncio.gather(*(h.result() for h in handles)),
                                       timeout=300))


async def _render(http: httpx.AsyncClient, settings: Settings, *, user: str,
                  tools: list[str] | None) -> list[int]:
    """Token ids of a ticket-triage prompt (system prompt, tools, one user message) as
    engine e0's chat template renders it."""
    engine = settings.engine_endpoints[0]
    r = await http.post(engine.url + "/tokenize", json={
        "model": engine.model, "add_generation_prompt": False,
        "messages": [{"role": "system", "content": TRIAGE.system_prompt},
                     {"role": "user", "content": user}],
        "tools": TRIAGE.tool_schemas(tools)})
    r.raise_for_status()
    return list(r.json()["tokens"])


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


async def _prefix_records_skipped(settings: Settings) -> float:
    """The inference workers' count of steps whose directory records were skipped."""
    total = 0.0
    async with httpx.AsyncClient(timeout=5.0) as http:
        for engine in settings.engine_endpoints:
            port = settings.inference_metrics_port(engine.id)
            assert port is not None
            body = (await http.get(f"http://127.0.0.1:{port}/metrics")).text
            total += sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
                         if line.startswith("warmloop_prefix_records_skipped"))
    return total


async def test_the_prefix_directory_predicts_cached_tokens_of_sticky_steps(
    client: Client, settings: Settings, redis: aioredis.Redis
) -> None:
    before = await PrefixDirectory(redis).accuracy()
    skipped_before = await _prefix_records_skipped(settings)
    # The random model ends some jobs early (invalid output): run more jobs, up to three
    # rounds, until four steps have stuck to their job's engine.
    results: list[JobResult] = []
    for _ in range(3):
        results += await _run_jobs(client, n=3, max_steps=4)
        sticky = [s for r in results for s in r.steps
                  if s.step > 1 and s.route_reason == "sticky"]
        if len(sticky) >= 4:
            break
    ids = {r.job_id for r in results}
    block = max(e.block_size for e in await EngineRegistry(
        redis, ttl_s=settings.engine_ttl_s).live())
    steps: list[StepRecord] = [s for r in results for s in r.steps]
    for r in results:
        assert r.state in (JobState.LOOP_CAP, JobState.INVALID_OUTPUT), r.reason
        assert [s.step for s in r.steps] == list(range(1, len(r.steps) + 1))
    # every routed step carries the router's prediction
    assert all(s.predicted_cached_tokens is not None for s in steps), steps
    assert len(sticky) >= 4, [(s.step, s.route_reason) for s in steps]
    close = [s for s in sticky
             if abs((s.predicted_cached_tokens or 0) - s.cached_tokens) <= block]
    print(f"{len(close)}/{len(sticky)} sticky steps predicted within a block: "
          + ", ".join(f"{s.predicted_cached_tokens}/{s.cached_tokens}" for s in sticky))
    assert len(close) >= 0.8 * len(sticky), sticky
    # a sticky step's prefix is warm, and the directory knew it
    assert all(s.cached_tokens > 0 and (s.predicted_cached_tokens or 0) > 0 for s in sticky)

    # Every step's record is written (after its step returned), or counted as skipped (a
    # Redis blip on a loaded host); skips are the exception, never the rule.
    async def accounted() -> tuple[float, float] | None:
        recorded = (await PrefixDirectory(redis).accuracy()).get("steps", 0) - before.get(
            "steps", 0)
        skipped = await _prefix_records_skipped(settings) - skipped_before
        return (recorded, skipped) if recorded + skipped >= len(steps) else None

    recorded, skipped = await eventually(accounted)
    assert skipped <= len(steps) // 4, (recorded, skipped, len(steps))

    counts, recent = await bust_report(redis)
    ours = [b for b in recent if b.job_id in ids]
    # append-only transcripts: no step of these jobs rewrote its own prefix
    assert [b for b in ours if b.kind == "job_prefix"] == []
    # a stable-prefix bust of these jobs can only come from the tool set differing from
    # that of the profile's previous job (a known false positive), never from the system
    # prompt, which every ticket-triage job shares
    async with httpx.AsyncClient(timeout=10.0) as http:
        # where the tool schemas start: the same system prompt, different tool sets
        tools_at = _common(await _render(http, settings, user="a", tools=NO_FINISH),
                           await _render(http, settings, user="a", tools=None))
    assert all(b.block >= tools_at // block for b in ours if b.kind == "stable_prefix"), ours

    out = await asyncio.to_thread(warmloop, "doctor")
    print(out.stdout)
    assert "prefix directory:" in out.stdout, out.stdout + out.stderr
    assert "no routed steps yet" not in out.stdout
    assert "Traceback" not in out.stderr
    # the embedded server is tuned: the probe's short timer fires when due
    assert "temporal timers: a 0.2 s timer fired" in out.stdout, out.stdout
    assert "late;" not in out.stdout
    if counts:
        # doctor fails the check while any bust is on record, and names it
        assert out.returncode == 1 and "cache busts" in out.stdout
    else:
        assert out.returncode == 0, out.stdout + out.stderr
        assert "cache busts: none seen" in out.stdout


async def test_batch_jobs_under_way_are_counted_per_engine_and_expire(
    stack: Stack, settings: Settings, redis: aioredis.Redis
) -> None:
    """The count a new batch job's placement balances on (real Redis)."""
    from warmloop.activities.registry import BATCH_JOB_RESIDENT_S, BATCH_JOBS_KEY

    registry = EngineRegistry(redis, ttl_s=settings.engine_ttl_s)
    engines = ["test-bj-a", "test-bj-b"]
    await redis.delete(*[BATCH_JOBS_KEY.format(e) for e in engines])
    now = time.time()
    try:
        for step in range(3):  # one job's steps count once
            await registry.batch_job_routed("test-bj-a", "job-1", now=now + step)
        await registry.batch_job_routed("test-bj-a", "job-2", now=now)
        await registry.batch_job_routed("test-bj-b", "job-3", now=now - BATCH_JOB_RESIDENT_S - 1)
        assert await registry.batch_jobs(engines, now=now + 3) == {"test-bj-a": 2, "test-bj-b": 0}
        # job-2's last step there is now too old: it has finished or moved
        later = now + BATCH_JOB_RESIDENT_S + 1
        assert await registry.batch_jobs(engines, now=later) == {"test-bj-a": 1, "test-bj-b": 0}
    finally:
        await redis.delete(*[BATCH_JOBS_KEY.format(e) for e in engines])
