"""Fakes for the inference worker's unit tests: an engine behind ``httpx.MockTransport``
(its SSE stream scripted per test), an in-memory S3, a throwaway redis-server, and a
Redis address where nothing listens."""

from __future__ import annotations

import asyncio
import io
import json
import os
import signal
import socket
import subprocess
import time
from collections.abc import AsyncIterator, Callable, Iterator
from typing import Any

import httpx
import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from temporalio.testing import ActivityEnvironment

from warmloop.activities.cachebust import CacheBustDetector
from warmloop.activities.directory import PrefixDirectory
from warmloop.activities.holds import HoldManager
from warmloop.activities.inference import InferenceActivities
from warmloop.activities.pauses import PauseStats
from warmloop.activities.registry import EngineHeartbeat, EngineRegistry, RedisOutage
from warmloop.activities.transcripts import TranscriptStore
from warmloop.infra.stack import find_redis_server
from warmloop.workflows.contracts import GenerateRequest, GenerateResult

TASK = {"ticket_id": "T1001", "customer_id": "C115", "subject": "App crashes on start",
        "body": "Since yesterday's update the app closes right after the splash screen."}
PROMPT_IDS = list(range(300))
USAGE = {"prompt_tokens": 300, "completion_tokens": 12,
         "prompt_tokens_details": {"cached_tokens": 256}}


def role_chunk() -> dict[str, Any]:
    return {"id": "c", "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "finish_reason": None}],
            "prompt_token_ids": PROMPT_IDS}


def call_chunks() -> list[dict[str, Any]]:
    return [
        {"choices": [{"index": 0, "delta": {"tool_calls": [{
            "index": 0, "id": "call-1", "type": "function",
            "function": {"name": "search_kb", "arguments": ""}}]}}]},
        {"choices": [{"index": 0, "delta": {"tool_calls": [{
            "index": 0, "function": {"arguments": '{"topic": "crash"}'}}]}}]},
        {"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]},
    ]


def usage_chunk(usage: dict[str, Any] | None = None) -> dict[str, Any]:
    return {"choices": [], "usage": USAGE if usage is None else usage}


def sse(*events: dict[str, Any] | str) -> bytes:
    """Server-sent events as vLLM writes them: ``data: <json>`` and a blank line."""
    return "".join(f"data: {e if isinstance(e, str) else json.dumps(e)}\n\n"
                   for e in events).encode()


GOOD_STREAM = sse(role_chunk(), *call_chunks(), usage_chunk(), "[DONE]")


class CutStream(httpx.AsyncByteStream):
    """Sends ``head`` and then loses the connection (the engine died mid-stream)."""

    def __init__(self, head: bytes) -> None:
        self.head = head

    async def __aiter__(self) -> AsyncIterator[bytes]:
        yield self.head
        raise httpx.RemoteProtocolError("peer closed connection without sending complete "
                                        "message body (incomplete chunked read)")


def engine(stream: bytes | Callable[[], httpx.AsyncByteStream] = GOOD_STREAM,
           requests: list[httpx.Request] | None = None) -> httpx.MockTransport:
    """An engine whose chat completions answer 200 with ``stream``; it tokenizes any
    text as one token per character and answers touches from cache."""

    def handle(request: httpx.Request) -> httpx.Response:
        if requests is not None:
            requests.append(request)
        path = request.url.path
        if path == "/v1/chat/completions":
            headers = {"content-type": "text/event-stream"}
            if isinstance(stream, bytes):
                return httpx.Response(200, content=stream, headers=headers)
            return httpx.Response(200, stream=stream(), headers=headers)
        if path == "/tokenize":
            body = json.loads(request.content)
            text = body.get("prompt") or json.dumps(body.get("messages"))
            return httpx.Response(200, json={"tokens": list(range(len(text)))})
        if path == "/v1/completions":
            n = len(json.loads(request.content)["prompt"])
            return httpx.Response(200, json={"usage": {
                "prompt_tokens": n, "prompt_tokens_details": {"cached_tokens": n - 1}}})
        return httpx.Response(404)

    return httpx.MockTransport(handle)


class FakeS3:
    """The two calls TranscriptStore makes, in memory."""

    class exceptions:  # noqa: N801 - boto3's spelling
        class NoSuchKey(Exception):
            pass

    def __init__(self) -> None:
        self.objects: dict[str, str] = {}

    def put_object(self, *, Bucket: str, Key: str, Body: str) -> None:  # noqa: N803
        self.objects[Key] = Body

    def get_object(self, *, Bucket: str, Key: str) -> dict[str, Any]:  # noqa: N803
        if Key not in self.objects:
            raise self.exceptions.NoSuchKey(Key)
        return {"Body": io.BytesIO(self.objects[Key].encode())}


def inference(transport: httpx.MockTransport, **kw: Any) -> InferenceActivities:
    return InferenceActivities(
        engine_id="e0", base_url="http://engine", model="tiny",
        http=httpx.AsyncClient(transport=transport),
        transcripts=TranscriptStore(FakeS3(), "bucket"), **kw)


def step_request(step: int = 1, *, job_id: str = "j1", **kw: Any) -> GenerateRequest:
    return GenerateRequest(job_id=job_id, step=step, profile="ticket-triage", task=TASK,
                           base_len=0, tail="Budget: 5 steps left.", max_tokens=64, **kw)


async def generate(inf: InferenceActivities, req: GenerateRequest | None = None,
                   timeout_s: float = 10.0, *, drain: bool = True) -> GenerateResult:
    """Run the activity as Temporal would (activity info, heartbeats), bounded in time:
    a hang fails the test instead of stalling the suite. ``drain``: then wait for the
    step's directory and hold bookkeeping, which runs after the step has returned."""
    result = await asyncio.wait_for(ActivityEnvironment().run(inf.generate,
                                                              req or step_request()),
                                    timeout_s)
    if drain:
        assert await inf.drain(timeout_s) == 0, "the step's bookkeeping did not finish"
    return result


def redis_backed_inference(redis: aioredis.Redis) -> tuple[InferenceActivities, HoldManager]:
    """The inference worker's Redis users, wired as ``run_inference_worker`` wires them."""
    info = EngineHeartbeat(engine_id="e0", task_queue="engine.e0", model="tiny",
                           url="http://e0", healthy=True, kv_capacity_tokens=16384,
                           block_size=16, at=time.time())
    outage = RedisOutage()
    directory = PrefixDirectory(redis)
    transport = engine()
    holds = HoldManager(engine_id="e0", base_url="http://engine", model="tiny",
                        http=httpx.AsyncClient(transport=transport), redis=redis,
                        pauses=PauseStats(redis, outage=outage), engine_info=lambda: info,
                        directory=directory, outage=outage)
    return inference(transport, directory=directory, registry=EngineRegistry(redis, ttl_s=5),
                     detector=CacheBustDetector(redis, directory), engine_info=lambda: info,
                     holds=holds, outage=outage), holds


# ---- Redis -------------------------------------------------------------------------------


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def nowhere_redis() -> aioredis.Redis:
    """A client of a Redis that is not there: every call fails at once (refused)."""
    return aioredis.Redis(host="127.0.0.1", port=free_port(), socket_connect_timeout=0.5,
                          socket_timeout=0.5, retry=Retry(NoBackoff(), 0))


class RedisServer:
    """A throwaway redis-server on a free port, to kill, restart, stop and continue."""

    def __init__(self) -> None:
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None
        self.started: list[subprocess.Popen[bytes]] = []
        """Every process started, so that teardown ends them all (a test that fails
        half way may leave a restart behind)."""

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [find_redis_server(), "--bind", "127.0.0.1", "--port", str(self.port),
             "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.started.append(self.proc)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                with socket.create_connection(("127.0.0.1", self.port), timeout=0.2):
                    return
            except OSError:
                time.sleep(0.02)
        raise RuntimeError(f"redis-server did not listen on {self.port}")

    def kill(self) -> None:
        if self.proc is not None:
            _end(self.proc)
            self.proc = None

    def kill_all(self) -> None:
        for proc in self.started:
            _end(proc)
        self.proc = None

    def stop(self) -> None:
        """SIGSTOP: the server keeps its sockets but answers nothing (a hung Redis)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def cont(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)


def _end(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)  # a stopped process cannot die
        proc.kill()
    proc.wait(timeout=10)


def redis_server() -> Iterator[RedisServer]:
    """Fixture body: a started server, killed at the end (with any restart of it)
    whatever the test did."""
    server = RedisServer()
    server.start()
    try:
        yield server
    finally:
        server.kill_all()


class Recorder:
    """Stands in for a module's structlog logger: keeps (level, event, fields)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, str, dict[str, Any]]] = []

    def _record(self, level: str) -> Callable[..., None]:
        def log(event: str, **fields: Any) -> None:
            self.events.append((level, event, fields))
        return log

    def __getattr__(self, level: str) -> Callable[..., None]:
        return self._record(level)

    def named(self, event: str) -> list[dict[str, Any]]:
        return [f for _, e, f in self.events if e == event]
