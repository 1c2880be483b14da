"""Tenants kept apart below the workflow: the engines' cache_salt on every request of a
tenant's job (steps, prewarms, hold touches), the prefix directory and the router per
tenant, the keys in Redis and S3, and the quota at submit and before a step goes to an
engine. The real engines' side (0 cached tokens across tenants) is
tests/integration/test_tenants.py."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import boto3
import httpx
import pytest
import redis.asyncio as aioredis
from moto import mock_aws
from temporalio.client import WorkflowExecutionStatus
from temporalio.exceptions import ApplicationError, WorkflowAlreadyStartedError
from temporalio.service import RPCError, RPCStatusCode
from temporalio.testing import ActivityEnvironment

from tests.unit.engine_fakes import (
    PROMPT_IDS,
    FakeS3,
    RedisServer,
    engine,
    generate,
    inference,
    nowhere_redis,
    step_request,
)
from warmloop.activities.directory import KvEventApplier, PrefixDirectory, prompt_chain
from warmloop.activities.holds import HoldManager
from warmloop.activities.registry import (
    TENANT_START_CLAIM_S,
    TENANT_STARTS,
    TENANT_TOKENS,
    EngineHeartbeat,
    EngineRegistry,
    TenantUsage,
    step_key,
)
from warmloop.activities.routing import RoutingActivities
from warmloop.activities.storage import StorageActivities, transcript_key
from warmloop.activities.transcripts import TranscriptStore, read_message
from warmloop.workers.jobs import InvalidJobError, JobClient, QuotaExceededError
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import SEARCH_ATTRIBUTES
from warmloop.workflows.contracts import (
    ChatMessage,
    JobInput,
    JobState,
    RouteRequest,
    StoreTranscriptRequest,
)
from warmloop.workflows.holding import HoldConfig
from warmloop.workflows.profiles import get_profile
from warmloop.workflows.routing import block_hashes, prefix_family
from warmloop.workflows.tenants import (
    DEFAULT_TENANT,
    HOUR_S,
    TENANT_QUOTA_EXCEEDED,
    TenantQuota,
    cache_salt,
    hour_window,
    job_workflow_id,
    namespaced_id_problem,
    over_jobs,
    over_tokens,
    s3_prefix,
    scoped,
    split_job_id,
    tenant_of,
    tenant_problem,
)

TRIAGE = "ticket-triage"
SALT_FORBIDDEN = set("@/\\\0")


# ---- names, ids, salts -------------------------------------------------------------------


def test_tenant_names_are_checked() -> None:
    assert tenant_problem("acme") is None and tenant_problem("team_7-eu") is None
    for bad in ("", "Acme", "a/b", "a@b", "-x", "a.b", "x" * 64):
        assert tenant_problem(bad), bad


def test_a_job_id_is_namespaced_by_its_tenant_and_the_default_keeps_bare_ids() -> None:
    assert job_workflow_id(DEFAULT_TENANT, "ticket-1") == "ticket-1"
    assert job_workflow_id("acme", "ticket-1") == "acme/ticket-1"
    assert split_job_id("acme/ticket-1") == ("acme", "ticket-1")
    assert split_job_id("ticket-1") == (DEFAULT_TENANT, "ticket-1")
    assert tenant_of("acme/x") == "acme" and tenant_of("x") == DEFAULT_TENANT
    assert namespaced_id_problem("acme/ticket-1") is None
    assert namespaced_id_problem("default/ticket-1")  # the default tenant has no prefix
    assert namespaced_id_problem("Acme/ticket-1")
    assert namespaced_id_problem("acme/a/b")  # the job part is a bare id: no second /
    assert namespaced_id_problem("acme/")


def test_the_default_tenant_changes_nothing() -> None:
    assert cache_salt(DEFAULT_TENANT) is None
    assert scoped(DEFAULT_TENANT, TRIAGE) == TRIAGE
    assert s3_prefix(DEFAULT_TENANT) == ""
    assert JobInput(profile=TRIAGE, task={}).tenant == DEFAULT_TENANT
    # a default-tenant job's payloads are as before tenants (older workers read them)
    for model in (JobInput(profile=TRIAGE, task={}),
                  RouteRequest(job_id="j", step=1, profile=TRIAGE),
                  step_request()):
        assert "tenant" not in json.loads(model.model_dump_json())
        acme = model.model_copy(update={"tenant": "acme"})
        assert json.loads(acme.model_dump_json())["tenant"] == "acme"
        assert type(model).model_validate_json(acme.model_dump_json()).tenant == "acme"


def test_salts_differ_per_tenant_and_are_valid_vllm_salts() -> None:
    a, b = cache_salt("acme"), cache_salt("globex")
    assert a and b and a != b and a == cache_salt("acme")
    for s in (a, b):
        assert len(s) <= 128 and not (set(s) & SALT_FORBIDDEN)
        assert "acme" not in s and "globex" not in s  # names no tenant to the engines
    assert scoped("acme", TRIAGE) != scoped("globex", TRIAGE) != TRIAGE
    assert s3_prefix("acme") == "tenants/acme/"


def test_quota_checks() -> None:
    q = TenantQuota(max_jobs_in_flight=2, tokens_per_hour=1000)
    assert over_jobs("acme", q, 1) is None
    why = over_jobs("acme", q, 2)
    assert why and "max_jobs_in_flight" in why and "acme" in why
    assert over_jobs("acme", None, 99) is None and over_jobs("acme", TenantQuota(), 99) is None
    now = 10 * HOUR_S + 600.0  # ten minutes into an hour
    assert over_tokens("acme", q, 999, now) is None
    refused = over_tokens("acme", q, 1000, now)
    assert refused is not None
    why, wait = refused
    assert "tokens_per_hour" in why and "1,000" in why
    assert HOUR_S - 600 <= wait <= HOUR_S - 600 + 2
    assert hour_window(now) == 10 and hour_window(now + HOUR_S) == 11
    with pytest.raises(ValueError):
        TenantQuota(max_jobs_in_flight=0)


def test_settings_read_the_tenants_quotas(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARMLOOP_TENANTS", json.dumps(
        {"acme": {"max_jobs_in_flight": 3}, "globex": {"tokens_per_hour": 50_000}}))
    s = Settings()
    assert s.tenants == {"acme": TenantQuota(max_jobs_in_flight=3),
                         "globex": TenantQuota(tokens_per_hour=50_000)}
    monkeypatch.delenv("WARMLOOP_TENANTS")
    assert Settings().tenants == {}  # no tenant has a quota unless named
    bads: list[dict[str, dict[str, int]]] = [
        {"Not A Tenant": {}}, {"acme": {"tokens_per_hour": 0}}, {"acme": {"max_jobs": 1}}]
    for bad in bads:
        monkeypatch.setenv("WARMLOOP_TENANTS", json.dumps(bad))
        with pytest.raises(ValueError):
            Settings()


def test_the_tenant_search_attribute_is_registered_with_the_others() -> None:
    assert SEARCH_ATTRIBUTES["WarmloopTenant"] == "Keyword"
    assert JobState.QUOTA_EXHAUSTED.value == "QUOTA_EXHAUSTED"


# ---- engine requests ---------------------------------------------------------------------


async def test_a_tenants_steps_carry_its_cache_salt_and_the_default_none() -> None:
    sent: list[httpx.Request] = []
    inf = inference(engine(requests=sent))
    await generate(inf, step_request(tenant="acme"))
    await generate(inf, step_request(step=1).model_copy(update={"job_id": "j2"}))
    chats = [json.loads(r.content) for r in sent if r.url.path == "/v1/chat/completions"]
    assert chats[0]["cache_salt"] == cache_salt("acme")
    assert "cache_salt" not in chats[1]  # byte for byte as before tenants


async def test_a_prewarm_carries_the_salt_too() -> None:
    sent: list[httpx.Request] = []
    inf = inference(engine(requests=sent))
    req = step_request(tenant="acme").model_copy(update={"max_tokens": 1, "tail": ""})
    await asyncio.wait_for(ActivityEnvironment().run(inf.prewarm, req), 10)
    [chat] = [json.loads(r.content) for r in sent if r.url.path == "/v1/chat/completions"]
    assert chat["cache_salt"] == cache_salt("acme")


def _hold_manager(touches: list[dict[str, Any]]) -> HoldManager:
    def handle(request: httpx.Request) -> httpx.Response:
        body = json.loads(request.content)
        touches.append(body)
        n = len(body["prompt"])
        return httpx.Response(200, json={"usage": {
            "prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": n - 1}}})

    hb = EngineHeartbeat(engine_id="e0", task_queue="engine.e0", model="tiny", url="u",
                         healthy=True, at=0, kv_usage=0.3, kv_capacity_tokens=16384,
                         block_size=128)
    return HoldManager(engine_id="e0", base_url="http://engine", model="tiny",
                       http=httpx.AsyncClient(transport=httpx.MockTransport(handle)),
                       redis=nowhere_redis(), pauses=None,  # type: ignore[arg-type]
                       engine_info=lambda: hb, config=HoldConfig())


async def test_a_hold_keeps_the_tenants_own_blocks_warm() -> None:
    touches: list[dict[str, Any]] = []
    m = _hold_manager(touches)
    for job, salt in (("acme/j1", cache_salt("acme")), ("j2", None)):
        await m.after_step(job_id=job, profile=get_profile(TRIAGE), kind="tool:search_kb",
                           prefix_tokens=list(range(257)), policy="always_hold",
                           interactive=True, salt=salt)
    for h in m.holds.values():
        h.next_touch = 0
    await m.tick()
    by_len = sorted(touches, key=lambda b: "cache_salt" in b)
    assert "cache_salt" not in by_len[0]  # the default tenant's touch, as before
    assert by_len[1]["cache_salt"] == cache_salt("acme")


# ---- the prefix directory ------------------------------------------------------------------


def test_a_salted_prompt_chain_shares_no_hash_with_another_tenants() -> None:
    plain = prompt_chain(PROMPT_IDS, 16, tail_tokens=0)
    a = prompt_chain(PROMPT_IDS, 16, tail_tokens=0, salt=cache_salt("acme"))
    b = prompt_chain(PROMPT_IDS, 16, tail_tokens=0, salt=cache_salt("globex"))
    assert plain.hashes == block_hashes(PROMPT_IDS, 16)  # the default: unchanged
    assert not (set(a.hashes) & set(b.hashes)) and not (set(a.hashes) & set(plain.hashes))
    assert a.reusable_blocks == plain.reusable_blocks


class _Dir:
    def __init__(self) -> None:
        self.stored: list[str] = []

    async def store_blocks(self, engine_id: str, hashes: Any, now: float) -> None:
        self.stored += list(hashes)

    async def remove_blocks(self, engine_id: str, hashes: Any) -> None:
        pass

    async def clear_engine(self, engine_id: str) -> None:
        pass


async def test_kv_events_of_a_salted_prompt_map_onto_its_tenants_chain() -> None:
    """vLLM publishes a salted first block with its salt in ``extra_keys``; the directory
    then names the blocks as the salted chain the router computes for the tenant."""
    tokens = list(range(48))
    salt = cache_salt("acme")
    d = _Dir()
    applier = KvEventApplier(d, "e0")  # type: ignore[arg-type]
    await applier.apply([{"type": "BlockStored", "block_hashes": [b"s1", b"s2"],
                          "parent_block_hash": None, "token_ids": tokens[:32],
                          "block_size": 16, "medium": "GPU", "extra_keys": [[salt], None]},
                         {"type": "BlockStored", "block_hashes": [b"s3"],
                          "parent_block_hash": b"s2", "token_ids": tokens[32:48],
                          "block_size": 16, "medium": "GPU"},
                         # the same tokens unsalted (the default tenant): its own chain
                         {"type": "BlockStored", "block_hashes": [b"u1"],
                          "parent_block_hash": None, "token_ids": tokens[:16],
                          "block_size": 16, "medium": "GPU"}])
    assert d.stored == [*block_hashes(tokens, 16, salt=salt or ""),
                        block_hashes(tokens[:16], 16)[0]]
    # a first block whose extra keys are not one salt (a LoRA, images) cannot be named
    d2 = _Dir()
    await KvEventApplier(d2, "e0").apply([  # type: ignore[arg-type]
        {"type": "BlockStored", "block_hashes": [b"l1"], "parent_block_hash": None,
         "token_ids": tokens[:16], "block_size": 16, "extra_keys": [["lora-a", salt]]}])
    assert d2.stored == []


# ---- Redis: routing, usage -----------------------------------------------------------------


@pytest.fixture
def redis(client: aioredis.Redis) -> aioredis.Redis:
    """Here, the processes' own client of a server of the test's own (conftest's
    ``client``; its ``redis`` shares a server across the module)."""
    return client


def hb(engine_id: str, *, running: int = 0) -> EngineHeartbeat:
    return EngineHeartbeat(engine_id=engine_id, task_queue=f"engine.{engine_id}", model="tiny",
                           url=f"http://{engine_id}", healthy=True, running=running,
                           block_size=16, at=time.time())


def route(tenant: str, job: str = "j1", step: int = 1, **kw: Any) -> RouteRequest:
    return RouteRequest(job_id=job_workflow_id(tenant, job), step=step, profile=TRIAGE,
                        tenant=tenant, **kw)


async def run_route(acts: RoutingActivities, req: RouteRequest) -> Any:
    return await asyncio.wait_for(ActivityEnvironment().run(acts.route_step, req), 30)


async def _fleet(redis: aioredis.Redis) -> tuple[EngineRegistry, PrefixDirectory]:
    registry = EngineRegistry(redis, ttl_s=5)
    await registry.heartbeat(hb("e0"))
    await registry.heartbeat(hb("e1"))
    return registry, PrefixDirectory(redis)


async def test_a_new_job_is_routed_on_its_own_tenants_prefix_and_never_anothers(
        redis: aioredis.Redis) -> None:
    registry, directory = await _fleet(redis)
    stable = block_hashes(list(range(640)), 16, salt=cache_salt("acme") or "")
    await directory.set_profile_chain(scoped("acme", prefix_family(TRIAGE, None)), stable, 16)
    await directory.store_blocks("e1", stable, time.time())  # acme's prefix is warm on e1
    acts = RoutingActivities(registry, redis, directory=directory)
    mine = await run_route(acts, route("acme"))
    assert (mine.engine_id, mine.reason) == ("e1", "prefix")
    assert mine.expected_cached_tokens == 640
    for other in ("globex", DEFAULT_TENANT):  # nothing of theirs is warm anywhere
        theirs = await run_route(acts, route(other, job=f"{other}-1"))
        assert theirs.expected_cached_tokens == 0 and theirs.reason == "least_loaded"


async def test_another_tenants_step_in_flight_does_not_warm_a_prefix(
        redis: aioredis.Redis) -> None:
    registry, directory = await _fleet(redis)
    for t in ("acme", "globex"):
        chain = block_hashes(list(range(320)), 16, salt=cache_salt(t) or "")
        await directory.set_profile_chain(scoped(t, prefix_family(TRIAGE, None)), chain, 16)
    # an acme step of the same profile is being prefilled on e0 right now
    await registry.step_routed("e0", step_key("acme/j9", 1, scoped("acme", TRIAGE)))
    await registry.heartbeat(hb("e1", running=1))  # e1 a little busier
    acts = RoutingActivities(registry, redis, directory=directory)
    globex = await run_route(acts, route("globex"))
    assert globex.expected_cached_tokens == 0  # acme's prefill is not globex's prefix
    acme = await run_route(acts, route("acme", job="j2"))
    assert (acme.engine_id, acme.expected_cached_tokens) == ("e0", 320)
    # the step routed is recorded under the tenant's own profile name
    keys = await registry.in_flight_steps(["e0"])
    assert step_key("acme/j2", 1, scoped("acme", TRIAGE)) in keys["e0"]


async def test_a_tenants_tokens_are_counted_per_hour_by_the_generate_path(
        redis: aioredis.Redis) -> None:
    usage = TenantUsage(redis)
    inf = inference(engine(), usage=usage)
    await generate(inf, step_request(tenant="acme"))
    await generate(inf, step_request(tenant="acme", step=2))
    await generate(inf, step_request(tenant="globex"))
    # USAGE: 300 prompt + 12 completion tokens a step
    assert await usage.used("acme") == 624 and await usage.used("globex") == 312
    key = TENANT_TOKENS.format("acme", hour_window(time.time()))
    assert 0 < await redis.ttl(key) <= 2 * HOUR_S  # the window's key expires by itself


async def test_a_step_is_refused_once_its_tenant_spent_its_hour(
        redis: aioredis.Redis) -> None:
    registry, directory = await _fleet(redis)
    usage = TenantUsage(redis)
    acts = RoutingActivities(registry, redis, directory=directory, usage=usage,
                             quotas={"acme": TenantQuota(tokens_per_hour=1000)})
    assert (await run_route(acts, route("acme"))).engine_id  # nothing spent yet
    await usage.add("acme", 1000)
    with pytest.raises(ApplicationError) as err:
        await run_route(acts, route("acme", step=2))
    e = err.value
    assert e.type == TENANT_QUOTA_EXCEEDED and e.non_retryable
    assert "tokens_per_hour" in e.message and "acme" in e.message
    wait = e.details[0]["retry_after_s"]
    assert 0 < wait <= HOUR_S + 2
    # other tenants (quota or none) go on
    assert (await run_route(acts, route("globex"))).engine_id
    assert (await run_route(acts, route(DEFAULT_TENANT, job="d1"))).engine_id


async def test_the_quota_fails_open_while_redis_is_away(server: RedisServer,
                                                        redis: aioredis.Redis) -> None:
    registry, directory = await _fleet(redis)
    usage = TenantUsage(redis)
    acts = RoutingActivities(registry, redis, directory=directory, usage=usage,
                             quotas={"acme": TenantQuota(tokens_per_hour=10)})
    await run_route(acts, route(DEFAULT_TENANT, job="d1"))  # the registry snapshot
    await usage.add("acme", 10)
    server.kill()
    routed = await run_route(acts, route("acme", step=2))  # by the snapshot, not refused
    assert routed.engine_id in ("e0", "e1")
    # and the generate path serves on without its usage count
    inf = inference(engine(), usage=TenantUsage(nowhere_redis()))
    assert (await generate(inf, step_request(tenant="acme"))).prompt_tokens == 300


async def test_starts_claimed_at_once_for_a_tenants_last_slots_let_that_many_in(
        redis: aioredis.Redis) -> None:
    """Forty submits write their start at once for a five-slot tenant: the count and
    the write are one step on the server, so exactly five get in (a WATCH loop that
    wrote unguarded after its retries let 18 in)."""
    usage = TenantUsage(redis)

    async def claim(i: int) -> bool:
        return (await usage.claim_start("acme", f"acme/j{i}", limit=5, running=set())).admitted

    claimed = await asyncio.gather(*(claim(i) for i in range(40)))
    assert sum(claimed) == 5
    winners = {f"acme/j{i}" for i, ok in enumerate(claimed) if ok}
    assert set(await usage.recent_starts("acme")) == winners
    # a refusal says on what count
    refused = await usage.claim_start("acme", "acme/late", limit=5, running=set())
    assert not refused.admitted and refused.in_flight == 5
    # a start is not counted against itself, and a repeated submit's record stands
    again = await usage.claim_start("acme", sorted(winners)[0], limit=5, running=set())
    assert again.admitted and again.recorded_before and again.in_flight == 4
    # running jobs visibility shows are counted once, recorded or not
    shown = await usage.claim_start("acme", "acme/x", limit=7,
                                    running={*sorted(winners)[:2], "acme/old-1"})
    assert shown.admitted and shown.in_flight == 6
    # another tenant's starts are its own
    assert (await usage.claim_start("globex", "globex/j0", limit=1, running=set())).admitted
    await usage.drop_start("acme", "acme/x")
    assert "acme/x" not in await usage.recent_starts("acme")


async def test_ended_old_and_unreadable_starts_are_dropped_by_the_next_claim(
        redis: aioredis.Redis) -> None:
    usage = TenantUsage(redis)
    key = TENANT_STARTS.format("acme")
    await redis.hset(key, mapping={"acme/old": repr(time.time() - TENANT_START_CLAIM_S - 1),
                                   "acme/garbled": "not a time",
                                   "acme/ended": repr(time.time()),
                                   "acme/recent": repr(time.time())})
    claim = await usage.claim_start("acme", "acme/new", limit=2, running=set(),
                                    ended={"acme/ended"})
    assert claim.admitted and claim.in_flight == 1  # acme/recent
    assert set(await redis.hkeys(key)) == {b"acme/recent", b"acme/new"}
    assert 0 < await redis.ttl(key) <= TENANT_START_CLAIM_S + 60  # expires by itself


# ---- S3 ---------------------------------------------------------------------------------


def test_a_tenants_s3_keys_live_under_its_prefix_and_the_defaults_do_not_move() -> None:
    assert transcript_key("j1") == "transcripts/j1.json"
    assert transcript_key("acme/j1") == "tenants/acme/transcripts/j1.json"
    assert TranscriptStore.key("j1", 3) == "transcript-messages/j1/000003.json"
    assert TranscriptStore.key("acme/j1", 3) == "tenants/acme/transcript-messages/j1/000003.json"


async def test_a_tenants_transcript_is_stored_and_read_under_its_prefix() -> None:
    with mock_aws():
        s3 = boto3.client("s3", region_name="us-east-1")
        s3.create_bucket(Bucket="wl-tenants")
        storage, env = StorageActivities(s3, "wl-tenants"), ActivityEnvironment()
        msgs = [ChatMessage(role="user", content=f"m{i}") for i in range(3)]
        key = await env.run(storage.store_transcript, StoreTranscriptRequest(
            job_id="acme/j1", transcript=msgs[:2], base_len=0, complete=False))
        key = await env.run(storage.store_transcript, StoreTranscriptRequest(
            job_id="acme/j1", transcript=msgs[2:], base_len=2, complete=True))
        assert key == "tenants/acme/transcripts/j1.json"
        assert storage.load_transcript(key) == msgs
        listed = {o["Key"] for o in s3.list_objects_v2(Bucket="wl-tenants")["Contents"]}
        assert all(k.startswith("tenants/acme/") for k in listed), listed
        assert json.loads(read_message(s3, "wl-tenants", "acme/j1", 1))["content"] == "m1"


async def test_the_inference_worker_stores_a_tenants_messages_under_its_prefix() -> None:
    s3 = FakeS3()
    inf = inference(engine())
    inf._transcripts = TranscriptStore(s3, "bucket")
    req = step_request(tenant="acme").model_copy(update={
        "job_id": "acme/j1", "new_messages": [ChatMessage(role="user", content="hi")]})
    await generate(inf, req)
    assert list(s3.objects) == ["tenants/acme/transcript-messages/j1/000000.json"]


# ---- submit ---------------------------------------------------------------------------------


class FakeTemporal:
    """The calls a submit makes: list the tenant's running jobs, start one; and describe
    a recorded start that visibility does not show (``statuses``: unknown ids are
    NOT_FOUND)."""

    def __init__(self, running: int = 0) -> None:
        self.running = running
        self.queries: list[str] = []
        self.started: list[dict[str, Any]] = []
        self.fail: BaseException | None = None
        """What the next start raises (then cleared)."""
        self.statuses: dict[str, Any] = {}

    def get_workflow_handle(self, workflow_id: str) -> Any:
        async def describe() -> Any:
            if workflow_id not in self.statuses:
                raise RPCError("not found", RPCStatusCode.NOT_FOUND, b"")
            return SimpleNamespace(status=self.statuses[workflow_id])

        return SimpleNamespace(describe=describe)

    async def _running(self) -> AsyncIterator[Any]:
        for i in range(self.running):
            yield SimpleNamespace(id=f"running-{i}")

    def list_workflows(self, query: str | None = None, **kw: Any) -> AsyncIterator[Any]:
        self.queries.append(query or "")
        return self._running()

    async def start_workflow(self, workflow: Any, arg: Any, **kw: Any) -> Any:
        if self.fail is not None:
            fail, self.fail = self.fail, None
            raise fail
        self.started.append({"input": arg, **kw})
        return object()


class StubUsage:
    def __init__(self, used: int | None) -> None:
        self._used = used

    async def used(self, tenant: str, now: float | None = None) -> int:
        if self._used is None:
            raise ConnectionError("redis away")
        return self._used


TASK = {"ticket_id": "T1001", "customer_id": "C100", "subject": "s", "body": "b"}


def _attrs(started: dict[str, Any]) -> dict[str, Any]:
    return {p.key.name: p.value for p in started["search_attributes"]}


async def test_submit_namespaces_the_job_and_tags_it_with_its_tenant() -> None:
    temporal = FakeTemporal()
    jobs = JobClient(temporal)  # type: ignore[arg-type]
    wid = await jobs.submit(TRIAGE, TASK, job_id="t-1", tenant="acme")
    assert wid == "acme/t-1"
    [started] = temporal.started
    assert started["id"] == "acme/t-1" and started["input"].tenant == "acme"
    assert _attrs(started) == {"WarmloopTenant": "acme"}
    default = await jobs.submit(TRIAGE, TASK, job_id="t-2")
    assert default == "t-2" and _attrs(temporal.started[1]) == {"WarmloopTenant": "default"}
    assert temporal.queries == []  # no quota: nothing counted
    with pytest.raises(InvalidJobError):
        await jobs.submit(TRIAGE, TASK, tenant="Not/A/Tenant")


async def test_submit_refuses_a_tenant_at_its_jobs_in_flight() -> None:
    temporal = FakeTemporal(running=2)
    jobs = JobClient(temporal, tenants={"acme": TenantQuota(max_jobs_in_flight=2)})  # type: ignore[arg-type]
    with pytest.raises(QuotaExceededError) as err:
        await jobs.submit(TRIAGE, TASK, tenant="acme")
    assert "max_jobs_in_flight" in str(err.value) and "acme" in str(err.value)
    assert temporal.started == []
    [query] = temporal.queries
    assert "WarmloopTenant = 'acme'" in query and "ExecutionStatus = 'Running'" in query
    assert "WorkflowType = 'AgentJob'" in query
    temporal.running = 1
    assert await jobs.submit(TRIAGE, TASK, tenant="acme", job_id="x") == "acme/x"
    assert await jobs.submit(TRIAGE, TASK, tenant="globex", job_id="x") == "globex/x"


async def test_a_failed_start_drops_its_record_and_a_repeated_id_keeps_the_first(
        redis: aioredis.Redis) -> None:
    """A start that fails frees the slot it recorded; a submit repeating a started job's
    id (Temporal: already started) leaves that job's record, which still counts."""
    temporal = FakeTemporal()
    usage = TenantUsage(redis)
    jobs = JobClient(temporal, tenants={"acme": TenantQuota(max_jobs_in_flight=2)},  # type: ignore[arg-type]
                     usage=usage)
    temporal.fail = RPCError("unavailable", RPCStatusCode.UNAVAILABLE, b"")
    with pytest.raises(RPCError):
        await jobs.submit(TRIAGE, TASK, tenant="acme", job_id="a")
    assert await usage.recent_starts("acme") == {}
    assert await jobs.submit(TRIAGE, TASK, tenant="acme", job_id="b") == "acme/b"
    temporal.fail = WorkflowAlreadyStartedError("acme/b", "AgentJob")
    with pytest.raises(WorkflowAlreadyStartedError):
        await jobs.submit(TRIAGE, TASK, tenant="acme", job_id="b")
    assert set(await usage.recent_starts("acme")) == {"acme/b"}


async def test_submit_refuses_a_tenant_that_spent_its_hour_and_fails_open_without_redis(
        ) -> None:
    quota = {"acme": TenantQuota(tokens_per_hour=1000)}
    temporal = FakeTemporal()
    spent = JobClient(temporal, tenants=quota, usage=StubUsage(1000))  # type: ignore[arg-type]
    with pytest.raises(QuotaExceededError) as err:
        await spent.submit(TRIAGE, TASK, tenant="acme")
    assert "tokens_per_hour" in str(err.value)
    away = JobClient(temporal, tenants=quota, usage=StubUsage(None))  # type: ignore[arg-type]
    assert await away.submit(TRIAGE, TASK, tenant="acme", job_id="y") == "acme/y"


async def test_a_prewarm_is_skipped_while_the_engine_reports_a_queue() -> None:
    from warmloop.workflows.holding import PREWARM_SKIPPED
    sent: list[httpx.Request] = []
    hb = EngineHeartbeat(engine_id="e0", task_queue="engine.e0", model="tiny", url="u",
                         healthy=True, at=0, waiting=3)
    inf = inference(engine(requests=sent), engine_info=lambda: hb)
    req = step_request().model_copy(update={"max_tokens": 1, "tail": ""})
    skipped = await asyncio.wait_for(ActivityEnvironment().run(inf.prewarm, req), 10)
    assert skipped.finish_reason == PREWARM_SKIPPED
    assert not [r for r in sent if r.url.path == "/v1/chat/completions"]
    hb.waiting = 0  # the queue drained: the next prewarm goes
    warmed = await asyncio.wait_for(ActivityEnvironment().run(inf.prewarm, req), 10)
    assert warmed.finish_reason != PREWARM_SKIPPED
    assert [r for r in sent if r.url.path == "/v1/chat/completions"]


async def test_start_batch_namespaces_the_batch_and_bounds_it_by_its_tenants_quota() -> None:
    """A tenant's batch is ``<tenant>/<batch id>``, tagged with its tenant; its
    ``max_jobs_in_flight`` bounds the batch's windows (an explicit window over it is
    refused); a spent hour refuses the batch; its jobs in flight are not counted (a
    batch starts its jobs itself, within its window)."""
    temporal = FakeTemporal(running=5)
    quota = {"acme": TenantQuota(max_jobs_in_flight=4),
             "spent": TenantQuota(tokens_per_hour=1000)}
    jobs = JobClient(temporal, tenants=quota, usage=StubUsage(1000))  # type: ignore[arg-type]
    bid = await jobs.start_batch(TRIAGE, "s3://b/k.jsonl", batch_id="nightly", tenant="acme")
    assert bid == "acme/nightly"
    [started] = temporal.started
    assert started["id"] == "acme/nightly" and _attrs(started) == {"WarmloopTenant": "acme"}
    inp = started["input"]
    assert (inp.tenant, inp.max_window) == ("acme", 4)
    assert temporal.queries == []
    assert await jobs.start_batch(TRIAGE, "s3://b/k.jsonl", batch_id="w", tenant="acme",
                                  window=4) == "acme/w"
    with pytest.raises(InvalidJobError,
                       match="window 5 is over tenant acme's max_jobs_in_flight 4"):
        await jobs.start_batch(TRIAGE, "s3://b/k.jsonl", tenant="acme", window=5)
    with pytest.raises(QuotaExceededError, match="tokens_per_hour"):
        await jobs.start_batch(TRIAGE, "s3://b/k.jsonl", tenant="spent")
    # no quota: as asked, under the bare id
    assert await jobs.start_batch(TRIAGE, "s3://b/k.jsonl", batch_id="d", max_window=128) == "d"
    assert (temporal.started[-1]["input"].max_window, _attrs(temporal.started[-1])) == (
        128, {"WarmloopTenant": "default"})
    for bad in ({"tenant": "Not/A/Tenant"}, {"batch_id": "a/b"}, {"page_size": 0},
                {"carry": {"pages": 1}}):
        with pytest.raises(InvalidJobError):
            await jobs.start_batch(TRIAGE, "s3://b/k.jsonl", **bad)  # type: ignore[arg-type]
    with pytest.raises(InvalidJobError, match="unknown"):
        await jobs.start_batch("no-such-profile", "s3://b/k.jsonl")
    assert len(temporal.started) == 3


async def test_a_batch_job_waits_for_its_tenants_slot_and_hour(redis: aioredis.Redis) -> None:
    """``claim_job_slot``: granted at once without a quota or with room (the start
    recorded, so a racing claim counts it); refused while the tenant's jobs in flight
    are at its limit (retried after the poll interval) or its hour's tokens are spent
    (after the hour's end); with Redis away, tokens unchecked and slots visibility's."""
    from warmloop.activities.tenant_slots import TenantSlotActivities
    from warmloop.workflows.tenants import TENANT_SLOT_WAIT, JobSlotRequest

    temporal = FakeTemporal(running=1)
    usage = TenantUsage(redis)
    acts = TenantSlotActivities(usage, {"acme": TenantQuota(max_jobs_in_flight=2),
                                        "spent": TenantQuota(tokens_per_hour=1000)},
                                poll_s=3.0)
    env = ActivityEnvironment(client=temporal)  # type: ignore[arg-type]

    def claim(tenant: str, wid: str) -> Any:
        return env.run(acts.claim_job_slot, JobSlotRequest(tenant=tenant, workflow_id=wid))

    assert (await claim("globex", "globex/b-L1")).in_flight is None  # no quota here
    assert (await claim("acme", "acme/b-L1")).in_flight == 1
    assert set(await usage.recent_starts("acme")) == {"acme/b-L1"}
    temporal.statuses["acme/b-L1"] = WorkflowExecutionStatus.RUNNING
    with pytest.raises(ApplicationError) as err:  # 1 running + 1 just started
        await claim("acme", "acme/b-L2")
    e = err.value
    assert e.type == TENANT_SLOT_WAIT and not e.non_retryable
    assert e.next_retry_delay is not None and e.next_retry_delay.total_seconds() == 3.0
    assert "max_jobs_in_flight quota is 2" in e.message and "waits" in e.message
    assert (await claim("acme", "acme/b-L1")).in_flight == 1  # a retried grant stands
    temporal.statuses["acme/b-L1"] = WorkflowExecutionStatus.COMPLETED  # a slot freed
    assert (await claim("acme", "acme/b-L2")).in_flight == 1
    assert set(await usage.recent_starts("acme")) == {"acme/b-L2"}
    await usage.add("spent", 1000)
    with pytest.raises(ApplicationError) as err:
        await claim("spent", "spent/b-L1")
    wait = err.value.next_retry_delay
    assert err.value.type == TENANT_SLOT_WAIT and "tokens_per_hour" in err.value.message
    assert wait is not None and 0 < wait.total_seconds() <= HOUR_S + 2
    away = TenantSlotActivities(StubUsage(None), {"spent": TenantQuota(tokens_per_hour=1)})  # type: ignore[arg-type]
    granted = await env.run(away.claim_job_slot, JobSlotRequest(tenant="spent", workflow_id="w"))
    assert granted.in_flight is None  # tokens unknown: let through, no slot counted
    with pytest.raises(ValueError, match="poll_s"):
        TenantSlotActivities(usage, {}, poll_s=0)


# ---- listing jobs ---------------------------------------------------------------------


def test_a_job_listing_query_filters_by_tenant_profile_and_running() -> None:
    from warmloop.workers.jobs import jobs_query

    one = "ExecutionStatus != 'ContinuedAsNew'"  # a workflow once, not each of its runs
    assert jobs_query() == f"WorkflowType = 'AgentJob' AND {one}"
    assert jobs_query(tenant="acme", profile="ticket-triage", running=True) == (
        f"WorkflowType = 'AgentJob' AND {one} AND WarmloopTenant = 'acme' AND "
        "WarmloopProfile = 'ticket-triage' AND ExecutionStatus = 'Running'")
    assert jobs_query(tenant="acme", workflow="BatchRun") == (
        f"WorkflowType = 'BatchRun' AND {one} AND WarmloopTenant = 'acme'")
    for bad in ({"tenant": "acme' OR WorkflowType != 'x"}, {"profile": "p' OR 1=1 --"},
                {"tenant": "Not A Tenant"}, {"profile": ""}):
        with pytest.raises(InvalidJobError):
            jobs_query(**bad)  # type: ignore[arg-type]


async def test_jobs_are_listed_from_visibility_with_their_tenant_profile_and_state() -> None:
    """What visibility says of each job, in its order, cut at the limit; a job whose
    attributes are not set yet (its first workflow task has not run) is listed with its
    tenant from its id."""
    from datetime import UTC, datetime

    from temporalio.common import SearchAttributePair, TypedSearchAttributes

    from warmloop.workflows.agent_job import SA_PROFILE, SA_STATE, SA_TENANT

    t0 = datetime(2026, 12, 6, 12, 0, tzinfo=UTC)
    rows = [
        SimpleNamespace(id="acme/j2", status=WorkflowExecutionStatus.RUNNING, start_time=t0,
                        close_time=None, typed_search_attributes=TypedSearchAttributes([
                            SearchAttributePair(SA_TENANT, "acme"),
                            SearchAttributePair(SA_PROFILE, "ticket-triage"),
                            SearchAttributePair(SA_STATE, "RUNNING")])),
        SimpleNamespace(id="acme/j1", status=WorkflowExecutionStatus.TERMINATED,
                        start_time=t0, close_time=t0,
                        typed_search_attributes=TypedSearchAttributes([])),
        SimpleNamespace(id="acme/j0", status=WorkflowExecutionStatus.COMPLETED,
                        start_time=t0, close_time=t0,
                        typed_search_attributes=TypedSearchAttributes([])),
    ]

    class Visibility:
        query = ""

        async def _rows(self) -> AsyncIterator[Any]:
            for r in rows:
                yield r

        def list_workflows(self, query: str, **kw: Any) -> AsyncIterator[Any]:
            self.query = query
            return self._rows()

    temporal = Visibility()
    listed = await JobClient(temporal).list_jobs(tenant="acme", limit=2)  # type: ignore[arg-type]
    assert "WarmloopTenant = 'acme'" in temporal.query
    assert [(j.job_id, j.tenant, j.profile, j.state, j.status) for j in listed] == [
        ("acme/j2", "acme", "ticket-triage", "RUNNING", "RUNNING"),
        ("acme/j1", "acme", None, None, "TERMINATED")]
    with pytest.raises(InvalidJobError, match="limit"):
        await JobClient(temporal).list_jobs(limit=0)  # type: ignore[arg-type]
    batches = await JobClient(temporal).list_batches(tenant="acme")  # type: ignore[arg-type]
    assert "WorkflowType = 'BatchRun'" in temporal.query
    assert [(b.batch_id, b.tenant, b.status) for b in batches] == [
        ("acme/j2", "acme", "RUNNING"), ("acme/j1", "acme", "TERMINATED"),
        ("acme/j0", "acme", "COMPLETED")]
