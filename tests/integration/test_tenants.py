"""Tenants kept apart on the real engines: the same profile submitted by two tenants
shares no cached block (0 cached tokens across tenants on first contact) while each
tenant's own jobs hit their prefix as usual, routing sends a tenant's new job where
its own prefix is warm, and a tenant at its quota is refused at submit."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from temporalio.client import Client
from temporalio.exceptions import WorkflowAlreadyStartedError
from temporalio.service import RPCError

from tests.polling import eventually
from warmloop.activities.directory import JOB_CHAIN, PROFILE_CHAIN
from warmloop.activities.registry import TENANT_TOKENS, EngineRegistry, TenantUsage
from warmloop.activities.tenant_slots import running_jobs_query
from warmloop.infra.stack import Stack
from warmloop.workers.demo import bundled_tickets
from warmloop.workers.jobs import JobClient, QuotaExceededError
from warmloop.workers.settings import Settings
from warmloop.workflows.budgets import JobLimits
from warmloop.workflows.contracts import JobResult, JobState, StepRecord
from warmloop.workflows.profiles import get_profile
from warmloop.workflows.routing import prefix_family
from warmloop.workflows.tenants import TenantQuota, cache_salt, hour_window, scoped

pytestmark = pytest.mark.integration

TRIAGE = get_profile("ticket-triage")
# Neither tool ends the job or waits for a human: each job runs to its step cap.
NO_FINISH = ["search_kb", "lookup_customer"]
UNCAPPED = {t.name: 10_000 for t in TRIAGE.tools}
STEPS = 4


def _describe(res: JobResult) -> str:
    return ", ".join(f"{s.step}:{s.engine_id}/{s.route_reason}/{s.cached_tokens}"
                     f"/{s.prompt_tokens}" for s in res.steps)


async def _job(jobs: JobClient, tenant: str, name: str, ticket: int,
               engine_id: str | None = None) -> JobResult:
    wid = await jobs.submit(
        "ticket-triage", bundled_tickets()[ticket], job_id=name, tenant=tenant,
        tools=NO_FINISH, limits=JobLimits(max_steps=STEPS, max_tool_calls=UNCAPPED),
        engine_id=engine_id)
    assert wid == f"{tenant}/{name}"
    res = await asyncio.wait_for(jobs.result(wid), timeout=300)
    assert res.state in (JobState.LOOP_CAP, JobState.INVALID_OUTPUT), res.reason
    print(f"{wid}: {_describe(res)}")
    return res


def _hit_share(steps: list[StepRecord]) -> float:
    prompt = sum(s.prompt_tokens for s in steps)
    return sum(s.cached_tokens for s in steps) / prompt if prompt else 0.0


async def _forget(redis: aioredis.Redis, tenants: list[str], jobs: list[str]) -> None:
    """What the test's tenants left in Redis (their stable prefixes, job chains, usage)."""
    family = prefix_family("ticket-triage", NO_FINISH)
    await redis.delete(*[PROFILE_CHAIN.format(scoped(t, family)) for t in tenants],
                       *[JOB_CHAIN.format(j) for j in jobs])


async def test_the_engine_caches_a_salted_prompt_for_its_salt_only(
    stack: Stack, settings: Settings,
) -> None:
    """vLLM itself, below warmloop: the same prompt under another tenant's salt finds
    nothing cached, under its own salt everything but the last partial block."""
    engine = settings.engine_endpoints[0]
    tag = uuid.uuid4().hex
    prompt = f"Tenant probe {tag}. " + "The quick brown fox jumps over the lazy dog. " * 40

    async with httpx.AsyncClient(timeout=60.0) as http:
        async def cached(salt: str | None) -> tuple[int, int]:
            body: dict[str, Any] = {"model": engine.model, "prompt": prompt, "max_tokens": 1,
                                    "temperature": 0}
            if salt is not None:
                body["cache_salt"] = salt
            r = await http.post(engine.url + "/v1/completions", json=body)
            r.raise_for_status()
            usage = r.json()["usage"]
            return (int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0),
                    int(usage["prompt_tokens"]))

        a, b = cache_salt(f"pa-{tag[:8]}"), cache_salt(f"pb-{tag[:8]}")
        assert (await cached(a))[0] == 0  # first contact
        again, n = await cached(a)
        assert again > 0 and again >= n // 2, (again, n)  # its own salt: cached
        assert (await cached(b))[0] == 0  # another tenant: nothing, though it is all there
        assert (await cached(None))[0] == 0  # nor for the unsalted default tenant


async def test_two_tenants_with_one_profile_share_no_cache_and_keep_their_hit_rates(
    client: Client, stack: Stack, settings: Settings, redis: aioredis.Redis,
) -> None:
    engines = [e.id for e in settings.engine_endpoints]
    tag = uuid.uuid4().hex[:6]
    ta, tb = f"ta-{tag}", f"tb-{tag}"
    jobs = JobClient(client)
    names: list[str] = []
    try:
        # First contact, both tenants on the same engine, one after the other: the
        # second finds the first's prefix (the same system prompt and tools) in the
        # engine, and must not be served from it.
        a1 = await _job(jobs, ta, "a1", 0, engine_id=engines[0])
        b1 = await _job(jobs, tb, "b1", 1, engine_id=engines[0])
        names += [a1.job_id, b1.job_id]
        assert a1.steps[0].cached_tokens == 0, _describe(a1)
        assert b1.steps[0].cached_tokens == 0, _describe(b1)
        # S3 keys under each tenant's prefix; the WarmloopTenant search attribute set
        assert a1.transcript_key == f"tenants/{ta}/transcripts/a1.json", a1.transcript_key
        desc = await client.get_workflow_handle(a1.job_id).describe()
        tenant_attr = {p.key.name: p.value for p in desc.typed_search_attributes}
        assert tenant_attr.get("WarmloopTenant") == ta, tenant_attr

        # Within each tenant: its second job finds the tenant's own stable prefix
        a2 = await _job(jobs, ta, "a2", 2, engine_id=engines[0])
        b2 = await _job(jobs, tb, "b2", 3, engine_id=engines[0])
        names += [a2.job_id, b2.job_id]
        block = max(e.block_size for e in await EngineRegistry(
            redis, ttl_s=settings.engine_ttl_s).live())
        for second in (a2, b2):
            assert second.steps[0].cached_tokens >= block, _describe(second)
        # ... and every job's later steps its own transcript, at normal hit rates
        for res in (a1, b1, a2, b2):
            later = res.steps[1:]
            assert later and all(s.cached_tokens > 0 for s in later), _describe(res)
            assert _hit_share(later) >= 0.5, (_hit_share(later), _describe(res))
        print(f"hit share after the first step: {ta} "
              f"{_hit_share(a1.steps[1:] + a2.steps):.2f}, {tb} "
              f"{_hit_share(b1.steps[1:] + b2.steps):.2f}; first contact: 0 and 0")

        if len(engines) < 2:
            return
        # Routing per tenant: a third tenant warm on the other engine only. A new job of
        # each goes where its own tenant's prefix is, never on another tenant's.
        tc = f"tc-{tag}"
        c1 = await _job(jobs, tc, "c1", 4, engine_id=engines[1])
        names.append(c1.job_id)
        assert c1.steps[0].cached_tokens == 0, _describe(c1)
        a3, c2 = await asyncio.gather(_job(jobs, ta, "a3", 5), _job(jobs, tc, "c2", 6))
        names += [a3.job_id, c2.job_id]
        for res, home in ((a3, engines[0]), (c2, engines[1])):
            first = res.steps[0]
            assert (first.engine_id, first.route_reason) == (home, "prefix"), _describe(res)
            assert first.cached_tokens >= block and (first.predicted_cached_tokens or 0) > 0
    finally:
        await _forget(redis, [ta, tb, f"tc-{tag}"], names)


async def test_a_tenant_at_its_quota_is_refused_at_submit(
    client: Client, stack: Stack, redis: aioredis.Redis,
) -> None:
    tag = uuid.uuid4().hex[:6]
    tq, tt = f"tq-{tag}", f"tt-{tag}"
    jobs = JobClient(client, tenants={tq: TenantQuota(max_jobs_in_flight=1),
                                      tt: TenantQuota(tokens_per_hour=1000)},
                     usage=TenantUsage(redis))
    task = bundled_tickets()[7]
    long = JobLimits(max_steps=60, max_tool_calls=UNCAPPED)
    wid = await jobs.submit("ticket-triage", task, job_id="q1", tenant=tq, tools=NO_FINISH,
                            limits=long)
    try:
        async def counted() -> bool:
            return (await client.count_workflows(running_jobs_query(tq))).count >= 1

        await eventually(counted, attempts=200, interval_s=0.1)
        with pytest.raises(QuotaExceededError) as err:
            await jobs.submit("ticket-triage", task, job_id="q2", tenant=tq, tools=NO_FINISH)
        assert "max_jobs_in_flight" in str(err.value) and tq in str(err.value)
        # another tenant is not held back by it
        other = await jobs.submit("ticket-triage", task, job_id="o1", tenant=f"to-{tag}",
                                  tools=NO_FINISH, limits=JobLimits(max_steps=1))
        await asyncio.wait_for(jobs.result(other), timeout=120)
    finally:
        with contextlib.suppress(RPCError):  # it may have ended already
            await jobs.cancel(wid)
        res = await asyncio.wait_for(jobs.result(wid), timeout=120)
        assert res.state in (JobState.CANCELLED, JobState.LOOP_CAP, JobState.INVALID_OUTPUT)

    # tokens per hour: the tenant's hour is spent (as the inference workers count it)
    key = TENANT_TOKENS.format(tt, hour_window(time.time()))
    await TenantUsage(redis).add(tt, 1000)
    try:
        with pytest.raises(QuotaExceededError) as err:
            await jobs.submit("ticket-triage", task, job_id="t1", tenant=tt, tools=NO_FINISH)
        assert "tokens_per_hour" in str(err.value) and tt in str(err.value)
    finally:
        await redis.delete(key)


async def _cancel_all(jobs: JobClient, wids: list[str]) -> None:
    for wid in wids:
        with contextlib.suppress(RPCError):  # it may have ended already
            await jobs.cancel(wid)
    for wid in wids:
        res = await asyncio.wait_for(jobs.result(wid), timeout=120)
        assert res.state in (JobState.CANCELLED, JobState.LOOP_CAP, JobState.INVALID_OUTPUT)


async def test_submits_racing_for_a_tenants_last_slot_start_one_job(
    client: Client, stack: Stack, redis: aioredis.Redis,
) -> None:
    """Visibility shows a start a little after it: two submits at once each saw the
    tenant's last slot free and both started. The starts recorded in Redis let one."""
    tag = uuid.uuid4().hex[:6]
    tenants = [f"tr{i}-{tag}" for i in range(3)]
    jobs = JobClient(client, tenants={t: TenantQuota(max_jobs_in_flight=1) for t in tenants},
                     usage=TenantUsage(redis))
    task = bundled_tickets()[3]
    long = JobLimits(max_steps=60, max_tool_calls=UNCAPPED)
    started: list[str] = []
    try:
        for t in tenants:
            outcomes = await asyncio.gather(
                *(jobs.submit("ticket-triage", task, job_id=f"r{i}", tenant=t, tools=NO_FINISH,
                              limits=long) for i in range(2)),
                return_exceptions=True)
            started += [o for o in outcomes if isinstance(o, str)]
            refused = [o for o in outcomes if isinstance(o, QuotaExceededError)]
            assert len(refused) == 1 and len(outcomes) == 2, outcomes
            assert "max_jobs_in_flight" in str(refused[0]) and t in str(refused[0])
        assert len(started) == len(tenants)
    finally:
        await _cancel_all(jobs, started)


async def test_a_tenants_ended_or_failed_starts_hold_no_slot(
    client: Client, stack: Stack, redis: aioredis.Redis,
) -> None:
    """A recorded start whose job has ended frees its slot at once, not when its record
    expires; a repeated id keeps the job's record; without Redis the quota is
    visibility's alone."""
    tag = uuid.uuid4().hex[:6]
    t = f"te-{tag}"
    usage = TenantUsage(redis)
    jobs = JobClient(client, tenants={t: TenantQuota(max_jobs_in_flight=1)}, usage=usage)
    task = bundled_tickets()[5]
    first = await jobs.submit("ticket-triage", task, job_id="e1", tenant=t, tools=NO_FINISH,
                              limits=JobLimits(max_steps=1, max_tool_calls=UNCAPPED))
    assert first in await usage.recent_starts(t)
    await asyncio.wait_for(jobs.result(first), timeout=120)
    # ended: its record stands, and Temporal says it is closed
    second = await jobs.submit("ticket-triage", task, job_id="e2", tenant=t, tools=NO_FINISH,
                               limits=JobLimits(max_steps=60, max_tool_calls=UNCAPPED))
    try:
        # the ended job's record went with that count; the new job's stands
        assert set(await usage.recent_starts(t)) == {second}
        with pytest.raises(QuotaExceededError):
            await jobs.submit("ticket-triage", task, job_id="e3", tenant=t, tools=NO_FINISH)
        # a refusal records nothing (the set of ids, not its text: the random tenant
        # name itself may hold "e3")
        assert set(await usage.recent_starts(t)) == {second}
    finally:
        await _cancel_all(jobs, [second])
    # a submit repeating a job's id is refused by Temporal, and the job's record stands
    with pytest.raises(WorkflowAlreadyStartedError):
        await jobs.submit("ticket-triage", task, job_id="e2", tenant=t, tools=NO_FINISH)
    assert second in await usage.recent_starts(t)
    # the next submit's count finds it ended (Temporal says so) and drops it
    third = await jobs.submit("ticket-triage", task, job_id="e5", tenant=t, tools=NO_FINISH,
                              limits=JobLimits(max_steps=1, max_tool_calls=UNCAPPED))
    assert second not in await usage.recent_starts(t)
    await asyncio.wait_for(jobs.result(third), timeout=120)
    # Redis away: submits are checked against visibility alone, not refused
    away = aioredis.Redis(host="127.0.0.1", port=1, socket_connect_timeout=0.5)
    alone = JobClient(client, tenants={t: TenantQuota(max_jobs_in_flight=1)},
                      usage=TenantUsage(away))
    try:
        wid = await alone.submit("ticket-triage", task, job_id="e4", tenant=t, tools=NO_FINISH,
                                 limits=JobLimits(max_steps=1, max_tool_calls=UNCAPPED))
        await asyncio.wait_for(alone.result(wid), timeout=120)
    finally:
        await away.aclose()


async def test_warmloop_jobs_lists_a_tenants_jobs_with_their_profile_and_state(
    client: Client, stack: Stack,
) -> None:
    """``warmloop jobs --tenant``: the tenant's jobs (and no other tenant's), the
    running one first, each with its profile and its terminal state once ended;
    ``--running`` shows the one still running."""
    import json

    from tests.integration.cli import warmloop

    tag = uuid.uuid4().hex[:6]
    tenant = f"tl-{tag}"
    jobs = JobClient(client)
    task = bundled_tickets()[7]
    done = await jobs.submit("ticket-triage", task, job_id="one", tenant=tenant,
                             tools=NO_FINISH, limits=JobLimits(max_steps=1))
    ended = await asyncio.wait_for(jobs.result(done), timeout=120)
    await jobs.submit("ticket-triage", task, job_id="other", tenant=f"tx-{tag}",
                      tools=NO_FINISH, limits=JobLimits(max_steps=1))
    # a review job offered only escalate: it waits for a reviewer until cancelled
    live = await jobs.submit("synthetic-review", {"case_id": "S0001", "text": "a case"},
                             job_id="two", tenant=tenant, tools=["escalate"],
                             limits=JobLimits(max_steps=4))
    try:
        async def listed(*args: str) -> list[dict[str, Any]] | None:
            out = await asyncio.to_thread(warmloop, "jobs", "--tenant", tenant, "--json", *args)
            assert out.returncode == 0, out.stderr
            rows = [json.loads(line) for line in out.stdout.splitlines()]
            # visibility lags: until both show, and the ended one's state is set
            states = {r["job_id"]: r["state"] for r in rows}
            return rows if states.get(done) == ended.state.value and live in states else None

        rows = await eventually(listed, attempts=100, interval_s=0.2)
        assert [r["job_id"] for r in rows] == [live, done]  # running first; no other tenant's
        assert [r["profile"] for r in rows] == ["synthetic-review", "ticket-triage"]
        assert {r["tenant"] for r in rows} == {tenant}
        running = await asyncio.to_thread(warmloop, "jobs", "--tenant", tenant, "--running",
                                          "--json")
        assert [json.loads(line)["job_id"] for line in running.stdout.splitlines()] == [live]
        bad = await asyncio.to_thread(warmloop, "jobs", "--tenant", "No Such'")
        assert bad.returncode != 0 and "tenant" in (bad.stderr + bad.stdout).lower()
    finally:
        await _cancel_all(jobs, [live])
