"""The OpenAI-compatible gateway (warmloop.workers.gateway) with engines behind
``httpx.MockTransport`` and a throwaway redis-server; the real engines are in
tests/integration/test_gateway.py."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
from starlette.applications import Starlette

import warmloop.activities.holds as worker_holds
import warmloop.workers.gateway.core as gateway_core
import warmloop.workers.gateway.fleet as gateway_fleet
import warmloop.workers.gateway.holds as gateway_holds
import warmloop.workers.gateway.routing as gateway_routing
import warmloop.workflows.routing as workflow_routing
from tests.polling import eventually
from tests.unit.engine_fakes import CutStream, RedisServer, free_port
from warmloop.activities.admission import BATCH_SLOTS_KEY, BatchAdmission, SharedBatchSlots
from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.holds import HoldManager
from warmloop.activities.pauses import PauseStats
from warmloop.activities.registry import (
    GATEWAY_FORGET_S,
    GATEWAY_HELD_KEY,
    GATEWAY_SET,
    EngineHeartbeat,
    EngineRegistry,
    GatewayHeld,
    RedisOutage,
)
from warmloop.workers.gateway.app import create_gateway_app, server_config
from warmloop.workers.gateway.calls import BadCall, api_key_scope, gateway_salt, parse_call
from warmloop.workers.gateway.config import GatewayConfig
from warmloop.workers.gateway.core import Gateway, job_key
from warmloop.workers.gateway.fleet import FleetView
from warmloop.workers.gateway.holds import GATEWAY_HOLDS_KEY, REPLY_KIND, GatewayHolds, kind_profile
from warmloop.workers.gateway.relay import EventRelay
from warmloop.workers.gateway.sessions import Chain, PromptIndex, SessionTable
from warmloop.workers.gateway.tasks import stop_task
from warmloop.workers.gateway.upstream import RawUpstream
from warmloop.workers.settings import Settings
from warmloop.workflows.contracts import Lane
from warmloop.workflows.holding import HoldConfig
from warmloop.workflows.lanes import VLLM_PRIORITY, AdmissionConfig
from warmloop.workflows.tenants import cache_salt

BLOCK = 4
SYSTEM = "You answer tickets. " + " ".join(f"Rule {i}: be brief." for i in range(40))


# ---- fake engines ------------------------------------------------------------------------


def sse(*events: dict[str, Any] | str) -> bytes:
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n"
                   for e in events).encode()


def tokens(text: str) -> list[int]:
    """The fake tokenizer: one token per character."""
    return [ord(c) % 5000 for c in text]


def chat_text(body: dict[str, Any]) -> str:
    return json.dumps([body.get("tools"), body["messages"]], sort_keys=True)


@dataclass
class FakeEngine:
    """One engine: answers chat completions (streamed or not), completions (touches)
    and /tokenize; ``mode`` scripts a failure."""

    engine_id: str
    mode: str = "ok"
    """ok | refuse (connection refused) | 503 | cut (dies after one event)."""
    tool: str | None = None
    """Answer with a call of this tool instead of text."""
    seen: list[dict[str, Any]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    gate: asyncio.Event | None = None
    """Set: chat calls wait for it before they are answered (a call in progress)."""
    arrived: int = 0
    """Chat calls that reached the gate."""

    def stream_bytes(self, body: dict[str, Any]) -> bytes:
        head = {"id": "c1", "object": "chat.completion.chunk", "model": "tiny",
                "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                             "finish_reason": None}]}
        if self.tool:
            parts = [{"choices": [{"index": 0, "delta": {"tool_calls": [{
                "index": 0, "id": "call-1", "type": "function",
                "function": {"name": self.tool, "arguments": "{}"}}]}, "finish_reason": None}]},
                {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}]
        else:
            parts = [{"choices": [{"index": 0, "delta": {"content": w}, "finish_reason": None}]}
                     for w in ("hello", " there")]
            parts.append({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]})
        usage = ({"choices": [], "usage": self.usage(body)}
                 if (body.get("stream_options") or {}).get("include_usage") else None)
        return sse(head, *parts, *([usage] if usage else []), "[DONE]")

    def usage(self, body: dict[str, Any]) -> dict[str, Any]:
        n = len(tokens(chat_text(body))) if "messages" in body else 10
        return {"prompt_tokens": n, "completion_tokens": 2, "total_tokens": n + 2,
                "prompt_tokens_details": {"cached_tokens": 8 * (len(self.seen) > 1)}}

    def answer(self, request: httpx.Request) -> httpx.Response:
        self.paths.append(request.url.path)
        if self.mode == "refuse":
            raise httpx.ConnectError("connection refused", request=request)
        body = json.loads(request.content)
        if request.url.path == "/tokenize":
            text = body["prompt"] if "prompt" in body else chat_text(body)
            return httpx.Response(200, json={"tokens": tokens(text)})
        if request.url.path == "/v1/completions":  # a hold's touch
            n = len(body["prompt"])
            return httpx.Response(200, json={"usage": {
                "prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": n - 1}}})
        self.seen.append(body)
        self.raw.append(request.content)
        if self.mode == "503":
            return httpx.Response(503, json={"error": "starting"})
        if not body.get("stream"):
            return httpx.Response(200, json=self.completion(body))
        data = self.stream_bytes(body)
        headers = {"content-type": "text/event-stream"}
        if self.mode == "cut":
            return httpx.Response(200, stream=CutStream(data.split(b"\n\n")[0] + b"\n\n"),
                                  headers=headers)
        return httpx.Response(200, stream=httpx.ByteStream(data), headers=headers)

    def completion(self, body: dict[str, Any]) -> dict[str, Any]:
        message: dict[str, Any] = {"role": "assistant", "content": "hello there"}
        if self.tool:
            message = {"role": "assistant", "content": None, "tool_calls": [{
                "id": "call-1", "type": "function",
                "function": {"name": self.tool, "arguments": "{}"}}]}
        return {"id": "c1", "object": "chat.completion", "model": "tiny",
                "choices": [{"index": 0, "message": message,
                             "finish_reason": "tool_calls" if self.tool else "stop"}],
                "usage": self.usage(body)}


class Fleet:
    """Fake engines by host (``http://e0``), behind one MockTransport."""

    def __init__(self, *ids: str) -> None:
        self.engines = {i: FakeEngine(i) for i in ids}

    def __getitem__(self, engine_id: str) -> FakeEngine:
        return self.engines[engine_id]

    def transport(self) -> httpx.MockTransport:
        async def answer(r: httpx.Request) -> httpx.Response:
            engine = self.engines[r.url.host]
            if engine.gate is not None and r.url.path == "/v1/chat/completions":
                engine.arrived += 1
                await engine.gate.wait()
            return engine.answer(r)
        return httpx.MockTransport(answer)

    def served_by(self) -> list[str]:
        return [e for e, fake in self.engines.items() for _ in fake.seen]


# ---- fixtures ------------------------------------------------------------------------------


async def heartbeat(redis: aioredis.Redis, engine_id: str, **kw: Any) -> None:
    hb = EngineHeartbeat(engine_id=engine_id, task_queue=f"engine.{engine_id}", model="tiny",
                         url=f"http://{engine_id}", healthy=True, block_size=BLOCK,
                         kv_capacity_tokens=100_000, kv_usage=0.2, at=time.time(), **kw)
    await EngineRegistry(redis, ttl_s=60).heartbeat(hb)


@dataclass
class Rig:
    app: Starlette
    gateway: Gateway
    client: httpx.AsyncClient
    fleet: Fleet
    redis: aioredis.Redis

    async def chat(self, messages: list[dict[str, Any]], *, headers: dict[str, str] | None = None,
                   **body: Any) -> httpx.Response:
        r = await self.client.post("/v1/chat/completions", headers=headers or {},
                                   json={"model": "tiny", "messages": messages, **body})
        await self.gateway.idle()
        return r


Make = Callable[..., Any]


@pytest.fixture
async def make(redis: aioredis.Redis, module_server: RedisServer
               ) -> AsyncIterator[Make]:
    """Builds a started gateway over fake engines ``ids`` (each heartbeating)."""
    rigs: list[Rig] = []

    async def build(*ids: str, config: GatewayConfig | None = None,
                    holding: HoldConfig | None = None, instance: str | None = None,
                    **settings_extra: Any) -> Rig:
        fleet = Fleet(*ids)
        for i in ids:
            await heartbeat(redis, i)
        settings = Settings(redis_url=module_server.url, engine_ttl_s=60,
                            holding=holding or HoldConfig(), **settings_extra)
        http = httpx.AsyncClient(transport=fleet.transport())
        app = create_gateway_app(settings, redis=redis, http=http,
                                 config=config or GatewayConfig(refresh_s=0.05,
                                                                learn_delay_s=0),
                                 instance=instance)
        gateway: Gateway = app.state.gateway
        await gateway.start()
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                   base_url="http://gateway")
        rig = Rig(app, gateway, client, fleet, redis)
        rigs.append(rig)
        return rig

    yield build
    for rig in rigs:
        await rig.client.aclose()
        await rig.gateway.stop()


def conversation(user: str = "My app crashes.", *turns: str) -> list[dict[str, Any]]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    for t in turns:
        messages += [{"role": "assistant", "content": "hello there"},
                     {"role": "user", "content": t}]
    return messages


# ---- the policy is the workflows' and the workers' ---------------------------------------


async def test_routing_and_holding_are_the_workflows_own_code(
        make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """No copy of a policy: the route comes from workflows.routing.choose_engine and the
    hold from the inference workers' HoldManager.after_step -> decide_hold. Replacing
    those changes what the gateway does."""
    assert gateway_routing.choose_engine is workflow_routing.choose_engine
    assert gateway_routing.eligible_engines is workflow_routing.eligible_engines
    assert issubclass(GatewayHolds, HoldManager)
    for name in ("after_step", "resume", "touch_interval_s", "_touch", "_make_room", "costs"):
        assert getattr(GatewayHolds, name) is getattr(HoldManager, name), name
    routed: list[str] = []
    decided: list[str] = []
    real_choose, real_decide = workflow_routing.choose_engine, worker_holds.decide_hold

    def spy_choose(candidates: Any, **kw: Any) -> Any:
        routed.append(kw["job_id"])
        return real_choose(candidates, **kw)

    def spy_decide(costs: Any, pauses: Any) -> Any:
        decided.append(type(costs).__name__)
        return real_decide(costs, pauses)

    monkeypatch.setattr(gateway_routing, "choose_engine", spy_choose)
    monkeypatch.setattr(worker_holds, "decide_hold", spy_decide)
    rig = await make("e0", "e1")
    r = await rig.chat(conversation(), headers={"x-session-id": "s1"})
    assert r.status_code == 200
    assert routed == ["s1"] and decided == ["HoldCosts"]


# ---- relaying ----------------------------------------------------------------------------


async def test_a_stream_is_relayed_byte_for_byte(make: Make) -> None:
    rig = await make("e0")
    body = {"model": "tiny", "messages": conversation(), "stream": True,
            "stream_options": {"include_usage": True}}
    raw = json.dumps(body).encode()
    r = await rig.client.post("/v1/chat/completions", content=raw)
    await rig.gateway.idle()
    assert r.status_code == 200 and r.headers["x-warmloop-engine"] == "e0"
    assert r.headers["content-type"].startswith("text/event-stream")
    assert r.content == rig.fleet["e0"].stream_bytes(body)
    # the client's own bytes went to the engine (no lane header, no key: nothing to change)
    assert rig.fleet["e0"].raw == [raw]


async def test_a_streams_prefill_prices_the_engines_holds_but_a_whole_answer_does_not(
        make: Make) -> None:
    # the gateway's holds price re-prefill by what the engine shows now, as the workers'
    rig = await make("e0")
    manager = rig.gateway.holds.manager("e0")
    assert manager is not None
    seen: list[tuple[int, float]] = []
    manager.observe_step = lambda **kw: seen.append(  # type: ignore[method-assign]
        (kw["uncached_tokens"], kw["ttft_s"]))
    body = {"model": "tiny", "messages": conversation(), "stream": True,
            "stream_options": {"include_usage": True}}
    r = await rig.client.post("/v1/chat/completions", json=body)
    await rig.gateway.idle()
    assert r.status_code == 200
    usage = rig.fleet["e0"].usage(body)
    assert len(seen) == 1 and seen[0][0] == usage["prompt_tokens"] - usage[
        "prompt_tokens_details"]["cached_tokens"] and seen[0][1] > 0
    r = await rig.client.post("/v1/chat/completions", json={**body, "stream": False})
    await rig.gateway.idle()
    assert r.status_code == 200 and len(seen) == 1  # its first bytes come after decode


def test_a_usage_event_the_gateway_asked_for_is_read_and_left_out() -> None:
    """``drop_usage_event``: the usage-only event (empty ``choices``) is read and not
    passed on, even split across pieces or unterminated at the end; an event that
    carries usage beside its choices (per-chunk usage), and every other byte, pass."""
    text = b'data: {"choices": [{"index": 0, "delta": {"content": "hi"}}]}\n\n'
    with_usage = (b'data: {"choices": [{"index": 0, "delta": {}}], "usage": '
                  b'{"prompt_tokens": 3}}\r\n\r\n')
    usage_only = b'data: {"choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 2}}'
    relay = EventRelay(drop_usage_event=True)
    assert relay.take(text + with_usage + usage_only[:20]) == text + with_usage
    assert relay.take(usage_only[20:] + b"\n\ndata: [DONE]\n\n") == b"data: [DONE]\n\n"
    assert (relay.outcome.prompt_tokens, relay.outcome.completion_tokens) == (5, 2)
    end = EventRelay(drop_usage_event=True)
    assert end.take(text) == text
    assert end.take(usage_only) == b"" and end.flush() == b""  # unterminated, still read
    assert end.outcome.prompt_tokens == 5
    kept = EventRelay()  # not asked for by the gateway: the client's own, passed on
    assert kept.take(usage_only + b"\n\n") == usage_only + b"\n\n"
    extra = EventRelay(drop_usage_event=True)  # a blank line too many is still relayed
    assert extra.take(text + usage_only + b"\n\n\n") == text + b"\n"


async def test_a_whole_answer_is_the_engines_json_with_its_cached_tokens(make: Make) -> None:
    rig = await make("e0")
    await rig.chat(conversation())
    r = await rig.chat(conversation())
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 8
    assert r.json() == rig.fleet["e0"].completion(rig.fleet["e0"].seen[-1])


async def test_events_are_passed_on_whole() -> None:
    relay = EventRelay()
    assert relay.take(b'data: {"choices": [], "usa') == b""
    out = relay.take(b'ge": {"prompt_tokens": 5, "prompt_tokens_details": '
                     b'{"cached_tokens": 4}}}\n\ndata: [DO')
    assert out == (b'data: {"choices": [], "usage": {"prompt_tokens": 5, '
                   b'"prompt_tokens_details": {"cached_tokens": 4}}}\n\n')
    assert relay.take(b"NE]\n\n") == b"data: [DONE]\n\n"
    assert relay.flush() == b""
    assert relay.outcome.prompt_tokens == 5 and relay.outcome.cached_tokens == 4
    assert relay.outcome.done


# ---- routing -----------------------------------------------------------------------------


async def test_a_session_stays_on_its_engine(make: Make) -> None:
    rig = await make("e0", "e1")
    first = await rig.chat(conversation(), headers={"x-session-id": "s1"})
    engine = first.headers["x-warmloop-engine"]
    second = await rig.chat(conversation("My app crashes.", "Still crashing."),
                            headers={"session-id": "s1"})
    assert second.headers["x-warmloop-engine"] == engine
    assert second.headers["x-warmloop-route"] == "sticky"
    # the session's chain is in the prefix directory, as a job's is
    known = await PrefixDirectory(rig.redis).job_chain(job_key("s1"))
    assert known is not None and known[1] == engine and len(known[0]) > 50


async def test_a_gateway_new_to_a_session_finds_its_engine_in_the_directory(
        make: Make) -> None:
    first = await make("e0", "e1")
    r = await first.chat(conversation(), headers={"x-session-id": "s9"})
    engine = r.headers["x-warmloop-engine"]
    # A second gateway (a restart, another replica) knows nothing of s9 in memory. The
    # session's first call there is a sub-agent's opening call (no model turn yet; a
    # session may span agents): it must still find the session's engine, or the main
    # agent's next call would stick to wherever that call went.
    second = await make("e0", "e1")
    r = await second.chat([{"role": "system", "content": "A sub-agent entirely."},
                           {"role": "user", "content": "Summarise the ticket."}],
                          headers={"x-session-id": "s9"})
    assert r.headers["x-warmloop-engine"] == engine
    assert r.headers["x-warmloop-route"] == "sticky"  # not by load alone
    r = await second.chat(conversation("My app crashes.", "Still crashing."),
                          headers={"x-session-id": "s9"})
    assert r.headers["x-warmloop-engine"] == engine
    assert r.headers["x-warmloop-route"] == "sticky"


async def test_without_a_session_a_prompt_goes_where_its_prefix_is(make: Make) -> None:
    rig = await make("e0", "e1")
    first = await rig.chat(conversation("Where is my order?"))
    warm = first.headers["x-warmloop-engine"]
    again = await rig.chat(conversation("Where is my order?", "Any news?"))
    assert again.headers["x-warmloop-engine"] == warm
    assert again.headers["x-warmloop-route"] == "prefix"
    # a new conversation with the same system prompt: its stable prefix was learned
    other = await rig.chat(conversation("Can I get a refund?"))
    assert other.headers["x-warmloop-engine"] == warm
    assert other.headers["x-warmloop-route"] == "prefix"


async def test_a_refused_connection_goes_to_the_next_engine(make: Make) -> None:
    rig = await make("e0", "e1")
    rig.fleet["e0"].mode = "refuse"
    rig.fleet["e1"].mode = "503"
    r = await rig.chat(conversation(), headers={"x-session-id": "s1"})
    assert r.status_code == 503 and r.json()["error"]["type"] == "service_unavailable"
    rig.fleet["e1"].mode = "ok"
    rig.gateway.fleet._failed.clear()
    for _ in range(3):
        r = await rig.chat(conversation(), headers={"x-session-id": f"s{time.time()}"})
        assert r.status_code == 200 and r.headers["x-warmloop-engine"] == "e1"
    assert rig.gateway.metrics.counter("warmloop_gateway_failovers_total", engine="e0") >= 1


async def test_an_engine_dying_mid_stream_ends_the_stream_cleanly(make: Make) -> None:
    rig = await make("e0", "e1")
    s = {"x-session-id": "s1"}
    first = await rig.chat(conversation(), headers=s)
    dying = first.headers["x-warmloop-engine"]
    rig.fleet[dying].mode = "cut"
    r = await rig.chat(conversation("My app crashes.", "And now?"), headers=s, stream=True)
    events = [e for e in r.content.decode().split("\n\n") if e]
    assert len(events) == 2 and events[0].startswith('data: {"id": "c1"')
    error = json.loads(events[1].removeprefix("data: "))["error"]
    assert error["type"] == "engine_error" and dying in error["message"]
    rig.fleet[dying].mode = "ok"
    rig.gateway.fleet._failed.clear()  # only the session's own memory sends it elsewhere
    after = await rig.chat(conversation("My app crashes.", "And now?"), headers=s)
    assert after.status_code == 200
    assert after.headers["x-warmloop-engine"] != dying
    assert after.headers["x-warmloop-route"] == "failover"


async def test_an_engine_dying_before_a_whole_answer_is_a_502(make: Make) -> None:
    rig = await make("e0")
    rig.fleet["e0"].mode = "cut"
    r = await rig.chat(conversation(), headers={"x-session-id": "s1"}, stream=True)
    assert b"engine_error" in r.content
    stats = rig.gateway.metrics
    assert stats.counter("warmloop_gateway_stream_errors_total", engine="e0") == 1
    assert stats.counter("warmloop_gateway_requests_total", endpoint="chat", status="502") == 1


# ---- lanes, salts ------------------------------------------------------------------------


async def test_the_lane_header_sets_priority_and_batch_admission(make: Make) -> None:
    rig = await make("e0")
    await rig.chat(conversation(), headers={"x-warmloop-lane": "batch", "x-session-id": "b1"})
    await rig.chat(conversation(), headers={"x-warmloop-lane": "interactive"})
    sent = rig.fleet["e0"].seen
    assert [b["priority"] for b in sent] == [VLLM_PRIORITY[Lane.BATCH],
                                             VLLM_PRIORITY[Lane.INTERACTIVE]]
    admission = rig.gateway._admissions["e0"]
    assert admission.active == 0 and "b1" in admission._started
    bad = await rig.chat(conversation(), headers={"x-warmloop-lane": "urgent"})
    assert bad.status_code == 400 and bad.json()["error"]["param"] == "x-warmloop-lane"


async def test_a_client_cannot_pick_another_tenants_cache_salt(make: Make) -> None:
    rig = await make("e0")
    await rig.chat(conversation(), headers={"authorization": "Bearer k1"}, cache_salt="acme")
    sent = rig.fleet["e0"].seen[-1]["cache_salt"]
    assert sent == gateway_salt(api_key_scope("Bearer k1"), "acme")
    await rig.chat(conversation(), cache_salt=cache_salt("acme"))  # a tenant's own salt
    assert rig.fleet["e0"].seen[-1]["cache_salt"] not in (cache_salt("acme"), None)
    assert gateway_salt(None, None) is None
    assert len({gateway_salt("k", "x"), gateway_salt("k", "y"), gateway_salt("j", "y")}) == 3


# ---- pauses and holds --------------------------------------------------------------------


async def test_pauses_are_learned_and_holds_kept_then_ended(
        make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    # This test is about the table, not outages: one Redis call over the 1 s guard on a
    # loaded host marks Redis away and the tick then rightly skips the write the test
    # reads (the likeliest cause of an empty table once, late in a full local run of the
    # suite). The outage tests keep the 1 s guard.
    for module in (gateway_core, gateway_fleet, gateway_holds):
        monkeypatch.setattr(module, "REDIS_TIMEOUT_S", 30.0)
    rig = await make("e0", holding=HoldConfig(max_held_fraction=0.3))
    rig.gateway.config.hold_policy = "always_hold"
    s = {"x-session-id": "s1", "x-session-kind": "support"}
    rig.fleet["e0"].tool = "search_kb"
    await rig.chat(conversation(), headers=s)
    manager = rig.gateway.holds.manager("e0")
    assert manager is not None and manager.holds["s1"].tokens
    await manager.tick()  # the table is written by the tick
    table = await rig.redis.hgetall(GATEWAY_HOLDS_KEY.format("e0", rig.gateway.instance))
    assert list(table) == [b"s1"] and json.loads(table[b"s1"])["kind"] == "tool:search_kb"
    assert await rig.redis.hlen("warmloop:holds:e0") == 0  # the worker's table is its own
    await asyncio.sleep(0.05)
    rig.fleet["e0"].tool = None
    await rig.chat(conversation("My app crashes.", "Search done."), headers=s)
    hist = await PauseStats(rig.redis).histogram(kind_profile("support").name,
                                                 "tool:search_kb")
    assert sum(hist.values()) == 1  # the pause on the caller's tool, measured
    assert manager.holds["s1"].kind == REPLY_KIND  # held again, now on the caller's turn
    final = {**s, "x-session-final": "true"}
    await rig.chat(conversation("My app crashes.", "Search done.", "Thanks"), headers=final)
    await manager.tick()
    assert "s1" not in manager.holds and rig.gateway.sessions.get("s1") is None
    assert await rig.redis.hlen(GATEWAY_HOLDS_KEY.format("e0", rig.gateway.instance)) == 0
    assert rig.gateway.metrics.counter("warmloop_gateway_hold_decisions_total",
                                       action="hold") == 2


async def test_a_final_header_ends_a_hold_at_once(make: Make) -> None:
    rig = await make("e0")
    rig.gateway.config.hold_policy = "always_hold"
    await rig.chat(conversation(), headers={"x-session-id": "s2"})
    manager = rig.gateway.holds.manager("e0")
    assert manager is not None and "s2" in manager.holds
    await rig.gateway.holds.end("s2")
    stats = await rig.redis.hgetall("warmloop:holds:stats:e0")
    assert "s2" not in manager.holds and stats[b"released_final"] == b"1"


async def test_the_cap_counts_the_workers_held_tokens(make: Make, redis: aioredis.Redis) -> None:
    rig = await make("e0", holding=HoldConfig(max_held_fraction=0.3))
    rig.gateway.config.hold_policy = "always_hold"
    await rig.chat(conversation(), headers={"x-session-id": "s3"})
    manager = rig.gateway.holds.manager("e0")
    assert manager is not None and manager.holds
    await heartbeat(redis, "e0", held_tokens=30_000)  # the worker holds the whole cap
    await rig.gateway.refresh()
    await manager.tick()
    assert not manager.holds


async def test_a_new_session_goes_where_less_is_held(make: Make) -> None:
    # Both engines idle at the same KV usage: only what the gateway holds tells them
    # apart (vLLM counts a held block as free), and a new session goes to the other.
    rig = await make("e0", "e1")
    rig.gateway.config.hold_policy = "always_hold"
    await rig.chat(conversation(), headers={"x-session-id": "held"})
    holder = rig.fleet.served_by()[-1]
    manager = rig.gateway.holds.manager(holder)
    assert manager is not None and "held" in manager.holds
    rig.gateway.config.hold_policy = "never"
    for i in range(12):
        await rig.chat([{"role": "system", "content": f"Desk {i}. " + SYSTEM},
                        {"role": "user", "content": "Where is my invoice?"}],
                       headers={"x-session-id": f"new-{i}"})
    assert rig.fleet.served_by()[1:] == [e for e in ("e0", "e1") if e != holder] * 12


async def test_replicas_and_the_worker_share_an_engines_batch_slots(
        make: Make, redis: aioredis.Redis) -> None:
    # K = 1 on e0 (its worker's heartbeat says so; the gateways' own K is 4). The worker
    # runs one batch step there; two gateway replicas each get a batch call for e0:
    # neither goes to the engine until the worker's slot frees, and then one at a time.
    one = AdmissionConfig(k_start=1, k_min=1, k_max=1, idle_grow_s=3600)
    four = AdmissionConfig(k_start=4, k_min=1, k_max=4, idle_grow_s=3600)
    first = await make("e0", instance="gw-a", admission=four)
    second = await make("e0", instance="gw-b", admission=four)
    await heartbeat(redis, "e0", batch_limit=1)
    for rig in (first, second):
        await rig.gateway.refresh()
    worker = BatchAdmission(one, shared=SharedBatchSlots(redis, "e0", holder="worker-e0"))
    await worker.acquire("step-of-a-workflow")
    for rig in (first, second):
        rig.fleet["e0"].gate = asyncio.Event()
    calls = [asyncio.ensure_future(rig.client.post(
        "/v1/chat/completions", headers={"x-warmloop-lane": "batch", "x-session-id": f"b{i}"},
        json={"model": "tiny", "messages": conversation()}))
        for i, rig in enumerate((first, second))]
    await eventually(lambda: _waiting(first, second, 2))
    assert first.fleet["e0"].arrived == second.fleet["e0"].arrived == 0
    # each session is announced to the other replicas while its call waits for a slot
    await eventually(lambda: _stream_length(redis, 2))
    shown = (await first.client.get("/metrics")).text
    assert 'warmloop_gateway_batch_waiting{engine="e0"} 1' in shown
    await worker.release()
    await eventually(lambda: _arrived(first, second, 1))
    assert await _waiting(first, second, 1)  # the other replica's call still waits
    assert await redis.zcard(BATCH_SLOTS_KEY.format("e0")) == 1
    for rig in (first, second):
        assert rig.fleet["e0"].gate is not None
        rig.fleet["e0"].gate.set()
    answers = await asyncio.wait_for(asyncio.gather(*calls), 10)
    assert [a.status_code for a in answers] == [200, 200]
    assert first.fleet["e0"].arrived + second.fleet["e0"].arrived == 2
    await first.gateway.idle()
    await second.gateway.idle()
    assert await redis.zcard(BATCH_SLOTS_KEY.format("e0")) == 0


async def _stream_length(redis: aioredis.Redis, n: int) -> bool:
    return int(await redis.xlen(gateway_core.SESSIONS_STREAM)) == n


async def _waiting(first: Rig, second: Rig, n: int) -> bool:
    return sum(a.waiting + a.fleet_waiting
               for r in (first, second) for a in r.gateway._admissions.values()) == n


async def _arrived(first: Rig, second: Rig, n: int) -> bool:
    return first.fleet["e0"].arrived + second.fleet["e0"].arrived == n


async def test_another_gateways_holds_count_as_taken(make: Make) -> None:
    # Two gateway replicas over the same engines: what one holds is in no heartbeat,
    # and the other sends its new sessions away from it all the same.
    first = await make("e0", "e1", instance="gw-a")
    second = await make("e0", "e1", instance="gw-b")
    first.gateway.config.hold_policy = "always_hold"
    await first.chat(conversation(), headers={"x-session-id": "held"})
    holder = first.fleet.served_by()[-1]
    manager = first.gateway.holds.manager(holder)
    assert manager is not None and "held" in manager.holds
    await first.gateway.refresh()  # publishes what it holds
    await second.gateway.refresh()  # reads it
    assert second.gateway.fleet.others_held(holder) == manager.own_held_tokens > 0
    second.gateway.config.hold_policy = "never"
    for i in range(12):
        await second.chat([{"role": "system", "content": f"Desk {i}. " + SYSTEM},
                           {"role": "user", "content": "Where is my invoice?"}],
                          headers={"x-session-id": f"new-{i}"})
    assert second.fleet.served_by() == [e for e in ("e0", "e1") if e != holder] * 12


async def test_replicas_keep_their_own_hold_tables(make: Make, redis: aioredis.Redis) -> None:
    # Each replica rewrites its table whole at every tick: in one shared table the last
    # writer erased the others' holds.
    rigs = [await make("e0", instance=name) for name in ("gw-a", "gw-b")]
    for i, rig in enumerate(rigs):
        rig.gateway.config.hold_policy = "always_hold"
        await rig.chat(conversation(f"Case {i}."), headers={"x-session-id": f"s-{i}"})
    for rig in rigs:
        manager = rig.gateway.holds.manager("e0")
        assert manager is not None
        await manager.tick()
    await asyncio.gather(*(rig.gateway.refresh() for rig in rigs))  # both publish
    records = (await gateway_holds.gateway_hold_records(
        redis, ["e0"], await EngineRegistry(redis, ttl_s=60).gateways()))["e0"]
    assert sorted((r["gateway"], r["session"]) for r in records) == [("gw-a", "s-0"),
                                                                     ("gw-b", "s-1")]
    await rigs[0].gateway.stop()  # its holds end with it; the other's stay
    records = (await gateway_holds.gateway_hold_records(
        redis, ["e0"], await EngineRegistry(redis, ttl_s=60).gateways()))["e0"]
    assert [r["session"] for r in records] == ["s-1"]
    assert await EngineRegistry(redis, ttl_s=60).gateways_held(exclude="gw-b") == {}


async def test_the_cap_counts_the_other_gateways_held_tokens(
        make: Make, redis: aioredis.Redis) -> None:
    rig = await make("e0", holding=HoldConfig(max_held_fraction=0.3), instance="gw-a")
    rig.gateway.config.hold_policy = "always_hold"
    await rig.chat(conversation(), headers={"x-session-id": "s3"})
    manager = rig.gateway.holds.manager("e0")
    assert manager is not None and manager.holds
    await manager.tick()
    assert manager.holds  # alone under the cap
    # another replica holds the whole cap (30 % of 100,000 tokens) on e0
    await EngineRegistry(redis, ttl_s=60).publish_gateway_held(
        GatewayHeld(gateway="gw-b", engines={"e0": 30_000}, at=time.time()))
    await rig.gateway.refresh()
    await manager.tick()
    assert not manager.holds


async def test_gateway_entries_expired_or_garbled_count_for_nothing(
        redis: aioredis.Redis) -> None:
    registry = EngineRegistry(redis, ttl_s=60)
    now = time.time()
    for name, engines in (("live", {"e0": 500, "e1": 7}), ("also", {"e0": 100}),
                          ("dead", {"e0": 9_999}), ("garbled", {}), ("wrong", {})):
        await registry.publish_gateway_held(GatewayHeld(gateway=name, engines=engines, at=now))
    await redis.delete(GATEWAY_HELD_KEY.format("dead"))  # as its expiry does
    await redis.set(GATEWAY_HELD_KEY.format("garbled"), b"{not json")
    await redis.set(GATEWAY_HELD_KEY.format("wrong"), json.dumps(
        {"gateway": "wrong", "at": now, "engines": {"e0": "lots"}}))
    assert await redis.pttl(GATEWAY_HELD_KEY.format("live")) > 0  # Redis expires them
    assert await registry.gateways_held() == {"e0": 600, "e1": 7}
    assert await registry.gateways_held(exclude="live") == {"e0": 100}
    # a gateway silent for an hour is not listed, and the next publish drops it from
    # the set; the others stay
    await redis.zadd(GATEWAY_SET, {"dead": now - GATEWAY_FORGET_S - 1})
    assert sorted(await registry.gateways()) == ["also", "garbled", "live", "wrong"]
    await registry.publish_gateway_held(GatewayHeld(gateway="live", engines={"e0": 500, "e1": 7},
                                                    at=now))
    assert await redis.zscore(GATEWAY_SET, "dead") is None
    await registry.gateway_gone("also")
    assert await registry.gateways_held() == {"e0": 500, "e1": 7}


async def _session_held_on_the_first(make: Make, session: str, *instances: str
                                     ) -> tuple[list[Rig], dict[str, str], Any]:
    """Replicas ``instances`` over e0; ``session`` served and held (always-hold) by the
    first: (the replicas, the session's headers, the first's hold manager on e0)."""
    rigs = [await make("e0", instance=name) for name in instances]
    rigs[0].gateway.config.hold_policy = "always_hold"
    s = {"x-session-id": session, "x-session-kind": "support"}
    await rigs[0].chat(conversation(), headers=s)
    manager = rigs[0].gateway.holds.manager("e0")
    assert manager is not None and session in manager.holds
    return rigs, s, manager


async def test_a_session_that_moved_to_another_replica_ends_its_hold_here(
        make: Make, redis: aioredis.Redis) -> None:
    (first, second), s, manager = await _session_held_on_the_first(
        make, "roaming", "gw-a", "gw-b")
    # garbage on the stream, and a replica's own announcement, change nothing
    for junk in ({"junk": b"\xff"}, {"gateway": b"\xff", "session": "roaming", "age_ms": 0},
                 {"gateway": "gw-b", "session": "roaming", "age_ms": "soon"},
                 {"gateway": "gw-a", "session": "roaming", "age_ms": 0}):
        await redis.xadd(gateway_core.SESSIONS_STREAM, junk)  # type: ignore[arg-type]
    # the proxy sends the session's next call to the other replica
    await second.chat(conversation("My app crashes.", "Still broken."), headers=s)

    async def moved() -> bool:
        return "roaming" not in manager.holds and first.gateway.sessions.get("roaming") is None

    await eventually(moved)
    assert first.gateway.metrics.counter("warmloop_gateway_sessions_moved_total") == 1
    assert second.gateway.sessions.get("roaming") is not None  # it is the second's now
    # its pause, measured by the replica that saw it begin, ended as the call arrived
    stats = PauseStats(redis)

    async def pauses() -> dict[int, int]:
        return await stats.histogram(kind_profile("support").name, REPLY_KIND)

    assert sum((await eventually(pauses)).values()) == 1
    # back on the first replica: the second measures that pause; the first, which forgot
    # the session, does not measure one from its own last answer (two pauses, not one
    # spanning the second replica's call)
    await first.chat(conversation("My app crashes.", "Still broken.", "Fixed?"), headers=s)
    await eventually(lambda: _false_if_known(second.gateway, "roaming"))

    async def two() -> bool:
        return sum((await pauses()).values()) == 2

    await eventually(two)
    assert first.gateway.metrics.counter("warmloop_gateway_pauses_total") == 1
    assert second.gateway.metrics.counter("warmloop_gateway_pauses_total") == 1


async def test_a_move_announced_while_redis_was_away_still_ends_the_hold_it_left(
        make: Make, redis: aioredis.Redis, module_server: RedisServer) -> None:
    (first, second), s, manager = await _session_held_on_the_first(
        make, "roaming", "gw-a", "gw-b")
    # Redis goes down; the session's next call comes to the other replica, which serves
    # it from its last view of the fleet but cannot announce it
    module_server.kill()
    try:
        r = await second.chat(conversation("My app crashes.", "Still broken."), headers=s)
        assert r.status_code == 200
        assert "roaming" in second.gateway._unannounced
        assert "roaming" in manager.holds and first.gateway.sessions.get("roaming")
    finally:
        module_server.start()  # back, empty (no persistence): the engine beats again
    await heartbeat(redis, "e0")

    async def moved() -> bool:
        return "roaming" not in manager.holds and first.gateway.sessions.get("roaming") is None

    await eventually(moved, attempts=400)  # sent at a refresh once Redis is back
    assert not second.gateway._unannounced
    assert first.gateway.metrics.counter("warmloop_gateway_sessions_moved_total") == 1
    stats = PauseStats(redis)

    async def pauses() -> dict[int, int]:
        return await stats.histogram(kind_profile("support").name, REPLY_KIND)

    assert sum((await eventually(pauses)).values()) == 1


async def test_a_move_announced_late_after_the_session_came_back_is_ignored(
        make: Make, redis: aioredis.Redis) -> None:
    (first,), _, manager = await _session_held_on_the_first(make, "boomerang", "gw-a")
    # another replica's announcement of a call a minute ago, before this one's: stale
    await redis.xadd(gateway_core.SESSIONS_STREAM,
                     {"gateway": "gw-b", "session": "boomerang", "age_ms": 60_000})
    await eventually(lambda: _true(first.gateway.metrics.counter(
        "warmloop_gateway_session_moves_stale_total") == 1))
    assert "boomerang" in manager.holds and first.gateway.sessions.get("boomerang")
    # sent at once: the session moved after its last call here
    await redis.xadd(gateway_core.SESSIONS_STREAM,
                     {"gateway": "gw-b", "session": "boomerang", "age_ms": 0})
    await eventually(lambda: _true("boomerang" not in manager.holds))
    assert first.gateway.metrics.counter("warmloop_gateway_sessions_moved_total") == 1


async def test_a_calls_bookkeeping_starts_once_its_request_is_with_the_engine(
        make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """A new session's announcement to the other replicas and a resumed session's pause
    record are Redis writes its call need not wait for: they start once the call's
    request has reached the engine. (They were started as the call came, and ran in its
    first wait, the directory read its routing makes, delaying the call.) A call that
    reaches no engine still announces its session."""
    rig = await make("e0")
    engine = rig.fleet["e0"]
    started: list[tuple[str, int]] = []  # (the work, chat requests the engine had then)
    announce, record = rig.gateway._announce, rig.gateway.pauses.record

    async def spy_announce(session: str, at: float) -> None:
        started.append(("announce", engine.arrived))
        await announce(session, at)

    async def spy_record(profile: str, kind: str, seconds: float) -> None:
        started.append(("pause", engine.arrived))
        await record(profile, kind, seconds)

    monkeypatch.setattr(rig.gateway, "_announce", spy_announce)
    monkeypatch.setattr(rig.gateway.pauses, "record", spy_record)
    engine.gate = asyncio.Event()
    engine.tool = "search_kb"  # a pause on a tool follows
    s = {"x-session-id": "s1", "x-session-kind": "support"}
    first = asyncio.create_task(rig.chat(conversation(), headers=s))

    async def announced() -> bool:
        return bool(started)

    await eventually(announced)
    assert started == [("announce", 1)]  # not before the engine had the request
    engine.gate.set()
    assert (await first).status_code == 200
    engine.gate, engine.tool = asyncio.Event(), None
    second = asyncio.create_task(rig.chat(conversation("My app crashes.", "Found it."),
                                          headers=s))

    async def recorded() -> bool:
        return len(started) > 1

    await eventually(recorded)
    assert started == [("announce", 1), ("pause", 2)]
    engine.gate.set()
    assert (await second).status_code == 200
    engine.gate, engine.mode = None, "refuse"  # no engine takes the next new session's call
    r = await rig.chat(conversation(), headers={"x-session-id": "s2"})
    assert r.status_code == 503 and started[-1] == ("announce", 2)
    r = await rig.chat(conversation(), headers={"x-session-id": "s3"}, model="no-such-model")
    assert r.status_code == 404 and started.count(("announce", 2)) == 2  # none routed
    assert await rig.redis.xlen(gateway_core.SESSIONS_STREAM) == 3


async def test_a_replica_reading_back_its_own_announcements_asks_redis_nothing_more(
        make: Make, redis: aioredis.Redis, monkeypatch: pytest.MonkeyPatch) -> None:
    # each session new here is announced and read back by this replica's own reader,
    # during the call: no clock to read for entries it skips (a round trip a call)
    rig = await make("e0", instance="gw-a")
    reads: list[list[Any]] = []
    asked: list[float] = []
    clock_reads = 0
    xread, clock = rig.gateway.redis.xread, rig.gateway.redis.time

    async def spy_xread(*a: Any, **kw: Any) -> Any:
        asked.append(time.monotonic())
        got = await xread(*a, **kw)
        reads.append(gateway_core._stream_entries(got) if got else [])
        return got

    async def spy_time() -> Any:
        nonlocal clock_reads
        clock_reads += 1
        return await clock()

    monkeypatch.setattr(rig.gateway.redis, "xread", spy_xread)
    monkeypatch.setattr(rig.gateway.redis, "time", spy_time)
    await eventually(lambda: _true(bool(asked)))  # its reader waits in the spy now
    assert (await rig.chat(conversation(), headers={"x-session-id": "s1"})).status_code == 200
    await eventually(lambda: _true(any(reads)))  # its own entry, read back
    assert clock_reads == 0
    # another replica's move is still placed in time, and ends the session here
    await redis.xadd(gateway_core.SESSIONS_STREAM,
                     {"gateway": "gw-b", "session": "s2", "age_ms": 0})
    await eventually(lambda: _true(clock_reads == 1))


async def test_an_announcement_made_as_soon_as_a_replica_started_is_read(
        make: Make, redis: aioredis.Redis) -> None:
    # start() returns with the stream's end fixed: a move announced next, before the
    # replica's reader first ran (CI once lost this race and never read it), is read
    first = await make("e0", instance="gw-a")
    first.gateway.sessions.open("early", "support", Lane.INTERACTIVE)  # no await between
    await redis.xadd(gateway_core.SESSIONS_STREAM,
                     {"gateway": "gw-b", "session": "early", "age_ms": 60_000})
    await eventually(lambda: _true(first.gateway.metrics.counter(
        "warmloop_gateway_session_moves_stale_total") == 1))


@pytest.mark.parametrize("away", ["down", "hung"])
async def test_a_replica_started_while_redis_is_away_follows_moves_once_it_is_back(
        make: Make, redis: aioredis.Redis, module_server: RedisServer, away: str) -> None:
    (module_server.kill if away == "down" else module_server.stop)()
    try:
        async with asyncio.timeout(30):  # a hung Redis is waited out (each call's timeout)
            first = await make(instance="gw-a")  # starts: no stream end to read yet
    finally:
        (module_server.start if away == "down" else module_server.cont)()  # back
    listener = first.gateway._listener
    assert listener is not None and not listener.done()
    first.gateway.sessions.open("early", "support", Lane.INTERACTIVE)

    async def moved() -> bool:
        # its reader starts from the stream's end once Redis answers, so an announcement
        # made before that is not its to read: announce until one is read
        await redis.xadd(gateway_core.SESSIONS_STREAM,
                         {"gateway": "gw-b", "session": "early", "age_ms": 0})
        return first.gateway.metrics.counter("warmloop_gateway_sessions_moved_total") == 1

    await eventually(moved, attempts=400)
    assert first.gateway.sessions.get("early") is None


async def _true(value: bool) -> bool:
    return value


async def test_a_session_served_by_each_replica_in_turn_keeps_its_engine_and_one_hold(
        make: Make, redis: aioredis.Redis) -> None:
    # No session-sticky proxy: a balancer sends each call of a session to the next
    # replica. Every call still goes to the engine that has the session's prefix, one
    # replica at a time holds it, and each pause is measured once.
    replicas = [await make("e0", "e1", instance=f"gw-{i}") for i in range(2)]
    for rig in replicas:
        rig.gateway.config.hold_policy = "always_hold"
    s = {"x-session-id": "round-robin", "x-session-kind": "support"}
    turns = ["Still broken.", "Tried it.", "Now what?", "Done.", "Thanks."]
    served: list[str] = []
    for n in range(6):
        here, other = replicas[n % 2], replicas[(n + 1) % 2]
        r = await here.chat(conversation("My app crashes.", *turns[:n]), headers=s)
        assert r.status_code == 200
        served.append(r.headers["x-warmloop-engine"])
        await eventually(functools.partial(_false_if_known, other.gateway, "round-robin"))
        holding = [rig for rig in replicas
                   if any("round-robin" in m.holds for m in rig.gateway.holds.managers.values())]
        assert holding == [here]
    assert len(set(served)) == 1
    stats = PauseStats(redis)

    async def five() -> bool:
        return sum((await stats.histogram(kind_profile("support").name, REPLY_KIND)
                    ).values()) == 5

    await eventually(five)
    for rig in replicas:
        await rig.gateway.idle()
    assert await five()  # and no pause counted late, twice


async def _false_if_known(gateway: Gateway, session: str) -> bool:
    return gateway.sessions.get(session) is None


async def test_holds_are_touched_on_their_engine(make: Make) -> None:
    rig = await make("e0", holding=HoldConfig(max_touch_interval_s=0.3,
                                              min_touch_interval_s=0.25))
    rig.gateway.config.hold_policy = "always_hold"
    await rig.chat(conversation(), headers={"x-session-id": "s4"})
    manager = rig.gateway.holds.manager("e0")
    assert manager is not None
    manager.holds["s4"].next_touch = 0
    await manager.tick()
    assert "/v1/completions" in rig.fleet["e0"].paths
    assert manager.holds["s4"].touches == 1


async def test_idle_client_connections_outlive_the_clients_and_balancers_in_front() -> None:
    # uvicorn's default (5 s) is httpx's own keep-alive expiry, and shorter than a load
    # balancer's idle timeout (60 s): a call may then go out on a connection the gateway
    # is closing, and fail with no answer.
    settings = Settings(redis_url="redis://127.0.0.1:1/0")
    served = server_config(settings, port=free_port())
    gateway: Gateway = served.app.state.gateway  # type: ignore[union-attr]
    try:
        assert served.timeout_keep_alive == GatewayConfig().keep_alive_s
        assert served.timeout_keep_alive > 60 > httpx.Limits().keepalive_expiry  # type: ignore[operator]
        custom = server_config(settings, port=free_port(), config=GatewayConfig(keep_alive_s=90))
        assert custom.timeout_keep_alive == 90
        await custom.app.state.gateway.http.aclose()  # type: ignore[union-attr]
    finally:
        await gateway.http.aclose()


# ---- errors and the other endpoints ------------------------------------------------------


async def test_errors_are_openai_shaped(make: Make, redis: aioredis.Redis) -> None:
    rig = await make("e0")
    r = await rig.client.post("/v1/chat/completions", content=b"{not json")
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = await rig.client.post("/v1/chat/completions", json=[1, 2])
    assert r.status_code == 400
    r = await rig.client.post("/v1/completions", json={"model": "tiny", "prompt": 3})
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"
    r = await rig.chat(conversation(), model="gpt-4.1")
    assert r.status_code == 404 and r.json()["error"]["code"] == "model_not_found"
    await EngineRegistry(redis, ttl_s=60).leave("e0")
    await rig.gateway.refresh()
    r = await rig.chat(conversation())
    assert r.status_code == 503 and r.json()["error"]["code"] == 503


async def test_models_health_and_metrics(make: Make) -> None:
    rig = await make("e0", "e1")
    models = (await rig.client.get("/v1/models")).json()
    assert [m["id"] for m in models["data"]] == ["tiny"]
    assert models["data"][0]["engines"] == ["e0", "e1"]
    assert (await rig.client.get("/health")).json()["engines"] == ["e0", "e1"]
    await rig.chat(conversation(), headers={"x-session-id": "s1"})
    text = (await rig.client.get("/metrics")).text
    assert 'warmloop_gateway_requests_total{endpoint="chat",status="200"} 1' in text
    assert "warmloop_gateway_routed_total{engine=" in text
    assert "warmloop_gateway_added_latency_seconds_count 1" in text
    assert "# TYPE warmloop_gateway_holds gauge" in text


async def test_completions_with_token_ids_are_routed_by_their_own_chain(make: Make) -> None:
    rig = await make("e0", "e1")
    ids = list(range(400))
    first = await rig.client.post("/v1/completions", json={"model": "tiny", "prompt": ids})
    await rig.gateway.idle()
    warm = first.headers["x-warmloop-engine"]
    again = await rig.client.post("/v1/completions",
                                  json={"model": "tiny", "prompt": ids + [7, 8, 9]})
    assert again.headers["x-warmloop-engine"] == warm
    assert again.headers["x-warmloop-route"] == "prefix"
    assert "/tokenize" not in rig.fleet[warm].paths


# ---- parsing and memory ------------------------------------------------------------------


def test_session_headers_and_their_scope() -> None:
    body = b'{"model": "tiny", "messages": [{"role": "user", "content": "hi"}]}'
    call = parse_call("chat", {"X-Dynamo-Session-ID": "wf-1", "X-Dynamo-Session-Final": "TRUE",
                               "x-session-kind": "support agent!"}, body)
    assert call.session == "wf-1" and call.final and call.kind.startswith("k-")
    scoped = parse_call("chat", {"x-session-affinity": "wf-1", "Authorization": "Bearer sk-1"},
                        body)
    assert scoped.session is not None and scoped.session.endswith("/wf-1")
    assert scoped.session != "wf-1" and "sk-1" not in scoped.session
    assert scoped.kind.startswith("key-") and not scoped.final
    long = parse_call("chat", {"x-session-id": "w" * 500}, body)
    assert long.session is not None and len(long.session) < 64
    none = parse_call("chat", {}, body)
    assert none.session is None and none.kind == "default" and none.lane == Lane.INTERACTIVE
    assert none.upstream_body() == body
    with pytest.raises(BadCall):
        parse_call("chat", {}, b'{"messages": []}')


def test_prefix_keys_extend_with_the_conversation() -> None:
    def keys(messages: list[dict[str, Any]], **extra: Any) -> list[str]:
        raw = json.dumps({"model": "tiny", "messages": messages, **extra}).encode()
        return parse_call("chat", {}, raw).prefix_keys

    short, longer = keys(conversation()), keys(conversation("My app crashes.", "More."))
    assert longer[:len(short)] == short and len(longer) == len(short) + 2
    assert keys(conversation(), tools=[{"type": "function"}])[0] != short[0]
    assert keys(conversation("Other."))[0] == short[0] != keys(conversation("Other."))[1]


def test_memory_is_bounded() -> None:
    now = [0.0]
    table = SessionTable(max_sessions=2, idle_s=10, clock=lambda: now[0])
    for key in ("a", "b", "c"):
        table.open(key, "k", Lane.INTERACTIVE)
    assert table.get("a") is None and len(table) == 2
    now[0] = 11
    assert table.get("b") is None
    index = PromptIndex(max_entries=2)
    for key in ("x", "y", "z"):
        index.put(key, Chain.of(["0" * 16], 4))
    assert index.longest(["x"]) is None and index.longest(["x", "z"]) is not None
    chain = Chain.of(["a" * 16, "b" * 16, "c" * 16], 4)
    assert chain.hashes() == ["a" * 16, "b" * 16, "c" * 16] and chain.first(1).blocks == 1


async def test_a_loop_that_swallows_its_cancellation_is_stopped_all_the_same() -> None:
    swallowed = 0

    async def stubborn() -> None:
        nonlocal swallowed
        while True:
            try:
                await asyncio.sleep(10)
            except asyncio.CancelledError:  # as redis-py sometimes does
                if swallowed:
                    raise
                swallowed += 1

    task = asyncio.ensure_future(stubborn())
    await asyncio.sleep(0)
    await asyncio.wait_for(stop_task(task, wait_s=0.05), 2)
    assert task.cancelled() and swallowed == 1


async def test_a_client_leaving_mid_stream_lets_the_engine_and_session_go(make: Make) -> None:
    rig = await make("e0")
    raw = json.dumps({"model": "tiny", "messages": conversation(), "stream": True}).encode()
    scope = {"type": "http", "asgi": {"version": "3.0", "spec_version": "2.4"},
             "http_version": "1.1", "method": "POST", "scheme": "http",
             "path": "/v1/chat/completions", "raw_path": b"/v1/chat/completions",
             "query_string": b"", "root_path": "", "client": ("127.0.0.1", 1),
             "server": ("gateway", 80),
             "headers": [(b"content-type", b"application/json"), (b"x-session-id", b"s9")]}
    requests = [{"type": "http.request", "body": raw, "more_body": False}]

    async def receive() -> dict[str, Any]:
        if requests:
            return requests.pop(0)
        await asyncio.sleep(3600)
        return {"type": "http.disconnect"}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.body" and message.get("body"):
            raise OSError("the client went away")

    with contextlib.suppress(Exception):
        await rig.app(scope, receive, send)
    await rig.gateway.idle()
    session = rig.gateway.sessions.get("s9")
    assert session is not None and session.active == 0 and session.engine == "e0"
    assert not rig.gateway.fleet.local
    assert rig.gateway.metrics.counter("warmloop_gateway_requests_total", endpoint="chat",
                                       status="499") == 1


# ---- the lean engine client ----------------------------------------------------------------


Reply = bytes | str | tuple[bytes, str]


class ScriptedServer:
    """An HTTP/1.1 server answering each request with its next scripted reply: bytes
    to write, "close" (close the connection without answering), or (bytes, "close")
    (write them, then close: an engine that dies mid-answer)."""

    def __init__(self, *replies: Reply) -> None:
        self.replies = list(replies)
        self.connections = 0
        self.requests: list[bytes] = []
        self._server: asyncio.Server | None = None

    async def __aenter__(self) -> str:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        port = self._server.sockets[0].getsockname()[1]
        return f"http://127.0.0.1:{port}/v1/chat/completions"

    async def __aexit__(self, *exc: object) -> None:
        assert self._server is not None
        self._server.close()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            while True:
                head = await reader.readuntil(b"\r\n\r\n")
                length = int(head.lower().split(b"content-length:")[1].split(b"\r\n")[0])
                self.requests.append(await reader.readexactly(length))
                reply = self.replies.pop(0)
                if reply == "close":
                    return
                data = reply[0] if isinstance(reply, tuple) else reply
                assert isinstance(data, bytes)
                writer.write(data)
                await writer.drain()
                if isinstance(reply, tuple):
                    return
        except (asyncio.IncompleteReadError, ConnectionError):
            return
        finally:
            writer.close()


def sized(body: bytes) -> bytes:
    return (b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: "
            + str(len(body)).encode() + b"\r\n\r\n" + body)


def chunked(*pieces: bytes, end: bool = True) -> bytes:
    out = (b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
           b"transfer-encoding: chunked\r\n\r\n")
    for p in pieces:
        out += f"{len(p):x}\r\n".encode() + p + b"\r\n"
    return out + (b"0\r\n\r\n" if end else b"")


def lean() -> RawUpstream:
    return RawUpstream(httpx.AsyncClient(), connect_timeout_s=1.0, read_timeout_s=5.0)


async def test_the_lean_client_keeps_connections_and_undoes_chunking() -> None:
    events = [b'data: {"a": 1}\n\n', b"data: [DONE]\n\n"]
    async with ScriptedServer(sized(b'{"ok": true}'), chunked(*events)) as url:
        up = lean()
        r = await up.post(url, b'{"x": 1}')
        assert r.status_code == 200 and await r.aread() == b'{"ok": true}'
        r = await up.post(url, b"{}")
        assert r.headers["content-type"] == "text/event-stream"
        assert [p async for p in r.aiter_raw()] == events
        await r.aclose()
        await up.aclose()


async def test_the_lean_client_resends_once_on_a_connection_the_engine_dropped() -> None:
    server = ScriptedServer(sized(b"1"), "close", sized(b"2"))
    async with server as url:
        up = lean()
        assert await (await up.post(url, b"{}")).aread() == b"1"
        assert await (await up.post(url, b"{}")).aread() == b"2"
        assert server.connections == 2 and server.requests == [b"{}"] * 3
        await up.aclose()


async def test_the_lean_clients_failures_are_httpxs() -> None:
    up = lean()
    with pytest.raises(httpx.ConnectError):
        await up.post(f"http://127.0.0.1:{free_port()}/v1/completions", b"{}")
    async with ScriptedServer("close") as url:
        with pytest.raises(httpx.RemoteProtocolError):
            await up.post(url, b"{}")
    async with ScriptedServer((chunked(b"data: 1\n\n", end=False), "close")) as url:
        r = await up.post(url, b"{}")
        pieces = []
        with pytest.raises(httpx.RemoteProtocolError):
            async for p in r.aiter_raw():
                pieces.append(p)
        assert pieces == [b"data: 1\n\n"]
    await up.aclose()


async def test_calls_in_flight_reach_the_registry_once_a_refresh(
        redis: aioredis.Redis) -> None:
    await heartbeat(redis, "e0")
    registry = EngineRegistry(redis, ttl_s=60)
    fleet = FleetView(registry, redis, instance="gw1", cooldown_s=1.0, outage=RedisOutage())
    short = fleet.started("e0", "gateway:k")
    fleet.ended("e0", short)  # began and ended between two refreshes: never written
    long = fleet.started("e0", "gateway:k")
    await registry.step_routed("e0", "job-1:1|profile")  # a workflow's step
    await fleet.refresh()
    assert set((await registry.in_flight_steps(["e0"]))["e0"]) == {"job-1:1|profile", long}
    assert fleet.in_flight("e0") == 2  # the workflow's step and this call, not it twice
    fleet.ended("e0", long)
    await fleet.publish_in_flight()
    assert (await registry.in_flight_steps(["e0"]))["e0"] == ["job-1:1|profile"]


async def test_a_sessions_next_call_supersedes_the_last_ones_bookkeeping(make: Make) -> None:
    rig = await make("e0", config=GatewayConfig(refresh_s=0.05, learn_delay_s=0.3))
    s = {"x-session-id": "quick"}
    for turn in ("One.", "Two.", "Three."):
        await rig.client.post("/v1/chat/completions", headers=s, json={
            "model": "tiny", "messages": conversation("Go.", turn)})
    await rig.gateway.idle()
    assert rig.fleet["e0"].paths.count("/tokenize") == 1 + 2  # the last call's; the
    # system prompt's stable prefix (two probes), once


async def test_a_quick_next_call_stays_where_the_last_one_was_computed(make: Make) -> None:
    """The session's next call comes before its last call's chain is learned (learning
    waits ``learn_delay_s``; the next call supersedes it), and the last engine's
    heartbeat still counts that call as running (it lags by up to a second). The
    prompt the last call computed there outweighs one request of load: sticky."""
    rig = await make("e0", "e1", config=GatewayConfig(refresh_s=3600, learn_delay_s=1.0))
    s = {"x-session-id": "quick-review"}
    first = await rig.client.post("/v1/chat/completions", headers=s, json={
        "model": "tiny", "messages": conversation("Draft a reply.")})
    engine = first.headers["x-warmloop-engine"]
    await heartbeat(rig.redis, engine, running=1)  # the lagging heartbeat
    await rig.gateway.refresh()
    second = await rig.client.post("/v1/chat/completions", headers=s, json={
        "model": "tiny", "messages": conversation("Draft a reply.", "Approved: send it.")})
    await rig.gateway.idle()
    assert (second.headers["x-warmloop-engine"], second.headers["x-warmloop-route"]) \
        == (engine, "sticky")
    # a session whose last call was learned goes by the directory, not by this floor
    assert rig.fleet[engine].paths.count("/tokenize") >= 1


async def test_with_key_digests_set_only_callers_with_an_accepted_key_get_through(
        make: Make) -> None:
    good, other = "sk-team-a", "sk-team-b"
    rig = await make("e0", gateway_key_digests=",".join(
        hashlib.sha256(k.encode()).hexdigest() for k in (good, other)))
    for headers in ({}, {"authorization": "Bearer sk-wrong"}, {"authorization": f"Basic {good}"},
                    {"authorization": "Bearer "}):
        r = await rig.chat(conversation(), headers=headers)
        assert r.status_code == 401, headers
        assert r.json()["error"]["code"] == "invalid_api_key"
        assert (await rig.client.get("/v1/models", headers=headers)).status_code == 401
    assert rig.fleet["e0"].seen == []  # nothing reached the engine
    for key in (good, other):
        ok = await rig.chat(conversation(), headers={"authorization": f"Bearer {key}"})
        assert ok.status_code == 200
    assert (await rig.client.get("/health")).status_code == 200  # probes need no key
    assert 'status="401"' in (await rig.client.get("/metrics")).text


def test_key_digests_must_be_digests_not_keys() -> None:
    with pytest.raises(ValueError, match="SHA-256 hex digests"):
        Settings(gateway_key_digests="sk-my-plain-key")
    d = hashlib.sha256(b"k").hexdigest()
    assert Settings(gateway_key_digests=f" {d.upper()} ,").gateway_key_digests == d


# ---- a tenant's keys -----------------------------------------------------------------------


async def test_a_tenants_key_shares_its_jobs_cache_and_spends_its_hour(
        make: Make, redis: aioredis.Redis) -> None:
    """WARMLOOP_GATEWAY_KEY_TENANTS: a key that is acme's sends acme's jobs' own
    cache_salt (their cache, no other tenant's), and the tokens its answers report go
    onto acme's hour: a whole answer's, a stream's whether or not it asks for usage. Once
    the hour is spent its calls are refused with 429 and Retry-After, the engine never
    asked; another key is neither salted as acme nor held to its quota."""
    import hashlib

    from warmloop.activities.registry import TenantUsage
    from warmloop.workflows.tenants import TenantQuota

    digest = hashlib.sha256(b"acme-key").hexdigest()
    rig = await make("e0", gateway_key_tenants={digest: "acme"},
                     tenants={"acme": TenantQuota(tokens_per_hour=5_000)})
    acme = {"authorization": "Bearer acme-key"}
    usage = TenantUsage(redis)
    r = await rig.chat(conversation(), headers=acme)
    assert r.status_code == 200
    sent = rig.fleet["e0"].seen[-1]
    assert sent["cache_salt"] == cache_salt("acme")
    whole = r.json()["usage"]
    assert await usage.used("acme") == whole["prompt_tokens"] + whole["completion_tokens"]
    # a stream's tokens count whether or not the client asks for its usage: not asked,
    # the engine is asked for it and the client gets, byte for byte, the stream it
    # asked for (the engine's without its usage event)
    e0 = rig.fleet["e0"]
    for options in (None, {"continuous_usage_stats": True}):
        before = await usage.used("acme")
        extra = {} if options is None else {"stream_options": options}
        plain = await rig.chat(conversation("Again."), headers=acme, stream=True, **extra)
        sent = e0.seen[-1]
        assert sent["stream_options"] == {**(options or {}), "include_usage": True,
                                          **({"continuous_usage_stats": False} if options
                                             else {})}
        assert plain.content == e0.stream_bytes(extra)
        assert b'"usage"' not in plain.content and plain.content.endswith(b"[DONE]\n\n")
        told = e0.usage(sent)
        assert await usage.used("acme") - before == (told["prompt_tokens"]
                                                     + told["completion_tokens"])
    # asked for: the client gets the usage event, and it is counted once
    before = await usage.used("acme")
    asked = await rig.chat(conversation("Once more."), headers=acme, stream=True,
                           stream_options={"include_usage": True})
    assert asked.content == e0.stream_bytes(e0.seen[-1]) and b'"usage"' in asked.content
    told = e0.usage(e0.seen[-1])
    assert await usage.used("acme") - before == told["prompt_tokens"] + told["completion_tokens"]
    # its own salt in the body: the gateway's namespace for this key, not acme's cache
    await rig.chat(conversation(), headers=acme, cache_salt="mine")
    assert rig.fleet["e0"].seen[-1]["cache_salt"] == gateway_salt(
        api_key_scope("Bearer acme-key"), "mine")
    # the hour spent: refused before any engine is asked
    await usage.add("acme", 5_000)
    calls = len(rig.fleet["e0"].seen)
    announced = await redis.xlen(gateway_core.SESSIONS_STREAM)
    refused = await rig.chat(conversation(), headers={**acme, "x-session-id": "late"})
    assert refused.status_code == 429
    # refused, its session came all the same: announced to the other replicas
    assert await redis.xlen(gateway_core.SESSIONS_STREAM) == announced + 1
    assert int(refused.headers["retry-after"]) >= 1
    err = refused.json()["error"]
    assert err["type"] == "rate_limit_error" and "tokens_per_hour" in err["message"]
    assert len(rig.fleet["e0"].seen) == calls
    # another key: its own salt, no quota
    other = await rig.chat(conversation(), headers={"authorization": "Bearer other"})
    assert other.status_code == 200
    assert rig.fleet["e0"].seen[-1]["cache_salt"] not in (None, cache_salt("acme"))


def test_key_tenants_are_named_by_digest() -> None:
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="SHA-256 hex digest"):
        Settings(gateway_key_tenants={"acme-key": "acme"})
    with pytest.raises(ValidationError):
        Settings(gateway_key_tenants={"a" * 64: "Not A Tenant"})
    assert Settings(gateway_key_tenants={"A" * 64: "acme"}).gateway_key_tenants == {
        "a" * 64: "acme"}
