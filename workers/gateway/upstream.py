"""The engine request on a call's path: a lean HTTP/1.1 client on asyncio streams.

httpx costs some 2 ms a request on the 2-core dev host (measured: a bare Starlette
proxy added 2.3 ms p50 with httpx, 0.6 ms with this), the whole of the gateway's
budget. vLLM speaks plain HTTP/1.1, so a call's engine request is written and its
answer read here directly: keep-alive connections per engine, the answer's head
parsed, its body read by ``content-length`` or chunked transfer. Everything off the
call's path (tokenize, hold touches) keeps using httpx, as does an ``https://`` engine.

Errors are raised as httpx's (``ConnectError``, ``RemoteProtocolError``, ``ReadError``,
``ReadTimeout``...), so the gateway treats both clients' failures alike.

Hazards:

- A pooled connection the engine closed while idle (uvicorn drops keep-alive
  connections after 5 s) fails on reuse before any answer: the request is sent once
  more on a new connection to the same engine before the engine counts as refusing.
  Connections idle longer than ``IDLE_S`` are not reused at all.
- An answer not read to its end leaves its connection unusable: ``aclose`` closes it
  (the engine then aborts the request, as vLLM does for a client that left).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Mapping
from dataclasses import dataclass, field
from typing import Protocol
from urllib.parse import urlsplit

import httpx

IDLE_S = 4.0
"""Idle keep-alive connections older than this are closed, not reused (uvicorn, which
serves vLLM, closes them at 5 s)."""
MAX_IDLE_PER_ENGINE = 64
MAX_HEAD_BYTES = 64 * 1024


class UpstreamResponse(Protocol):
    """What the gateway reads of an engine's answer (``httpx.Response`` is one)."""

    @property
    def status_code(self) -> int: ...
    @property
    def headers(self) -> Mapping[str, str]: ...
    async def aread(self) -> bytes: ...
    def aiter_raw(self) -> AsyncIterator[bytes]: ...
    async def aclose(self) -> None: ...


class Upstream(Protocol):
    async def post(self, url: str, body: bytes) -> UpstreamResponse: ...
    async def aclose(self) -> None: ...


class HttpxUpstream:
    """Engine requests through an httpx client (tests' mock transports, https)."""

    def __init__(self, http: httpx.AsyncClient) -> None:
        self._http = http

    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        request = self._http.build_request("POST", url, content=body,
                                           headers={"content-type": "application/json"})
        return await self._http.send(request, stream=True)

    async def aclose(self) -> None:
        return None  # the client is its owner's to close


@dataclass
class _Conn:
    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    idle_since: float = field(default_factory=time.monotonic)

    def usable(self) -> bool:
        return not (self.reader.at_eof() or self.writer.is_closing()
                    or time.monotonic() - self.idle_since > IDLE_S)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self.writer.close()


class RawUpstream:
    """Keep-alive HTTP/1.1 to ``http://`` engines; others through ``fallback``."""

    def __init__(self, fallback: httpx.AsyncClient, *, connect_timeout_s: float,
                 read_timeout_s: float) -> None:
        self._fallback = HttpxUpstream(fallback)
        self._connect_s, self._read_s = connect_timeout_s, read_timeout_s
        self._idle: dict[tuple[str, int], list[_Conn]] = {}

    async def post(self, url: str, body: bytes) -> UpstreamResponse:
        parts = urlsplit(url)
        if parts.scheme != "http" or parts.hostname is None:
            return await self._fallback.post(url, body)
        where = (parts.hostname, parts.port or 80)
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        head = (f"POST {path} HTTP/1.1\r\nhost: {parts.netloc}\r\n"
                f"content-type: application/json\r\ncontent-length: {len(body)}\r\n"
                "accept: */*\r\n\r\n").encode()
        conn = self._pooled(where)
        if conn is not None:
            try:
                return await self._exchange(where, conn, head + body)
            except _NoAnswer:
                pass  # the engine had closed it: once more on a new connection
        conn = await self._connect(where)
        try:
            return await self._exchange(where, conn, head + body)
        except _NoAnswer as e:
            raise httpx.RemoteProtocolError(f"the engine closed the connection without "
                                            f"answering ({e})") from None

    async def aclose(self) -> None:
        for conns in self._idle.values():
            for c in conns:
                c.close()
        self._idle.clear()

    def release(self, where: tuple[str, int], conn: _Conn) -> None:
        """A connection whose answer was read to its end, back to the pool."""
        idle = self._idle.setdefault(where, [])
        if len(idle) >= MAX_IDLE_PER_ENGINE:
            conn.close()
            return
        conn.idle_since = time.monotonic()
        idle.append(conn)

    def _pooled(self, where: tuple[str, int]) -> _Conn | None:
        idle = self._idle.get(where)
        while idle:
            conn = idle.pop()
            if conn.usable():
                return conn
            conn.close()
        return None

    async def _connect(self, where: tuple[str, int]) -> _Conn:
        try:
            async with asyncio.timeout(self._connect_s):
                reader, writer = await asyncio.open_connection(*where, limit=MAX_HEAD_BYTES)
        except TimeoutError:
            raise httpx.ConnectTimeout(f"no connection to {where[0]}:{where[1]} in "
                                       f"{self._connect_s}s") from None
        except OSError as e:
            raise httpx.ConnectError(f"{where[0]}:{where[1]}: {e}") from None
        return _Conn(reader, writer)

    async def _exchange(self, where: tuple[str, int], conn: _Conn, request: bytes
                        ) -> RawResponse:
        try:
            conn.writer.write(request)
            await conn.writer.drain()
            async with asyncio.timeout(self._read_s):
                raw_head = await conn.reader.readuntil(b"\r\n\r\n")
        except (asyncio.IncompleteReadError, ConnectionError) as e:
            conn.close()
            if isinstance(e, asyncio.IncompleteReadError) and e.partial:
                raise httpx.RemoteProtocolError("the engine's answer ended in its head") from None
            raise _NoAnswer(type(e).__name__) from None
        except TimeoutError:
            conn.close()
            raise httpx.ReadTimeout(f"no answer in {self._read_s}s") from None
        except asyncio.LimitOverrunError:
            conn.close()
            raise httpx.RemoteProtocolError("the engine's answer head is too long") from None
        except OSError as e:
            conn.close()
            raise httpx.WriteError(str(e)) from None
        status, headers = _parse_head(raw_head, conn)
        return RawResponse(status, headers, conn, self, where, self._read_s)


class _NoAnswer(Exception):
    """The connection ended before the first byte of an answer."""


def _parse_head(raw: bytes, conn: _Conn) -> tuple[int, dict[str, str]]:
    lines = raw.decode("latin-1").split("\r\n")
    version, _, rest = lines[0].partition(" ")
    code = rest.partition(" ")[0]
    if not version.startswith("HTTP/1.") or not code.isdigit():
        conn.close()
        raise httpx.RemoteProtocolError(f"not an HTTP/1.1 answer: {lines[0][:80]!r}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            continue
        name, _, value = line.partition(":")
        key = name.strip().lower()
        headers[key] = f"{headers[key]}, {value.strip()}" if key in headers else value.strip()
    if version == "HTTP/1.0":
        headers.setdefault("connection", "close")
    return int(code), headers


class RawResponse:
    """An engine's answer on a pooled connection; read it once, whole or in pieces."""

    def __init__(self, status: int, headers: dict[str, str], conn: _Conn, pool: RawUpstream,
                 where: tuple[str, int], read_s: float) -> None:
        self.status_code, self.headers = status, headers
        self._conn, self._pool, self._where, self._read_s = conn, pool, where, read_s
        self._done = False
        self._closed = False

    async def aread(self) -> bytes:
        return b"".join([piece async for piece in self.aiter_raw()])

    async def aiter_raw(self) -> AsyncIterator[bytes]:
        """The body's pieces as they come (chunked transfer undone)."""
        if self._done or self._closed:
            raise httpx.StreamConsumed()
        try:
            if "chunked" in self.headers.get("transfer-encoding", "").lower():
                async for piece in self._chunks():
                    yield piece
            elif "content-length" in self.headers:
                async for piece in self._sized(int(self.headers["content-length"])):
                    yield piece
            else:
                async for piece in self._until_eof():
                    yield piece
        except asyncio.IncompleteReadError:
            await self.aclose()
            raise httpx.RemoteProtocolError("peer closed connection without sending "
                                            "complete message body") from None
        except TimeoutError:
            await self.aclose()
            raise httpx.ReadTimeout(f"no bytes in {self._read_s}s") from None
        except (ConnectionError, OSError, ValueError) as e:
            await self.aclose()
            raise httpx.ReadError(f"{type(e).__name__}: {e}") from None
        self._done = True
        if "close" in self.headers.get("connection", "").lower():
            await self.aclose()
        elif not self._closed:
            self._closed = True
            self._pool.release(self._where, self._conn)

    async def aclose(self) -> None:
        """Let the connection go: back to the pool once the body was read, else shut."""
        if self._closed:
            return
        self._closed = True
        self._conn.close()

    async def _read(self, n: int) -> bytes:
        async with asyncio.timeout(self._read_s):
            return await self._conn.reader.readexactly(n)

    async def _line(self) -> bytes:
        async with asyncio.timeout(self._read_s):
            return await self._conn.reader.readuntil(b"\r\n")

    async def _chunks(self) -> AsyncIterator[bytes]:
        while True:
            size = int((await self._line()).split(b";", 1)[0].strip(), 16)
            if size == 0:
                while (await self._line()) != b"\r\n":  # trailers, then the blank line
                    pass
                return
            data = await self._read(size)
            await self._read(2)
            yield data

    async def _sized(self, n: int) -> AsyncIterator[bytes]:
        while n > 0:
            async with asyncio.timeout(self._read_s):
                data = await self._conn.reader.read(min(n, 1 << 16))
            if not data:
                raise asyncio.IncompleteReadError(b"", n)
            n -= len(data)
            yield data

    async def _until_eof(self) -> AsyncIterator[bytes]:
        self.headers["connection"] = "close"
        while True:
            async with asyncio.timeout(self._read_s):
                data = await self._conn.reader.read(1 << 16)
            if not data:
                return
            yield data
