"""Clients built once at worker start from the settings: Temporal, S3, Redis.

Every connection a warmloop process makes is built here, so that its security (TLS,
credentials, payload encryption) comes from one place: ``connect`` (Temporal),
``build_redis``/``redis_options`` (Redis), ``build_s3`` (S3)."""

from __future__ import annotations

import asyncio
import dataclasses
import ipaddress
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, TypeVar
from urllib.parse import urlsplit

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import AuthenticationError as RedisAuthenticationError
from redis.exceptions import ConnectionError as RedisConnectionError
from temporalio.client import Client, TLSConfig
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DataConverter, DefaultFailureConverterWithEncodedAttributes
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from warmloop.workers.codec import EncryptionCodec
from warmloop.workers.settings import Settings, decode_payload_key

T = TypeVar("T")


class StackNotRunningError(RuntimeError):
    """Temporal (or another part of the stack) cannot be reached."""


class SecureConnectionError(StackNotRunningError):
    """A secured-connection setting names a file that cannot be read."""


def data_converter(settings: Settings) -> DataConverter:
    """warmloop's data converter: pydantic payloads, encrypted with
    ``WARMLOOP_PAYLOAD_KEY`` when it is set (``EncryptionCodec``), with failure
    messages and stack traces moved into the encrypted payloads too (they would
    otherwise be stored in clear: a tool's error often quotes its input).

    Hazard: every client and worker of a namespace must use the same converter; one
    built without the key writes plaintext (readable by the others) and cannot read
    the encrypted jobs."""
    if settings.payload_key is None:
        return pydantic_data_converter
    codec = EncryptionCodec(
        decode_payload_key("payload_key", settings.payload_key.get_secret_value()),
        settings.payload_key_id, old_keys=settings.payload_old_key_ring())
    return dataclasses.replace(pydantic_data_converter, payload_codec=codec,
                               failure_converter_class=DefaultFailureConverterWithEncodedAttributes)


def _read(path: Path | None, setting: str) -> bytes | None:
    if path is None:
        return None
    try:
        return path.read_bytes()
    except OSError as e:
        raise SecureConnectionError(f"cannot read WARMLOOP_{setting.upper()} ({path}): "
                                    f"{e.strerror or e}") from None


def temporal_tls(settings: Settings) -> TLSConfig | bool:
    """What ``Client.connect`` gets as ``tls``: a ``TLSConfig`` when a certificate,
    CA or server name is set (files read now, at start), True for TLS with the
    system roots (``temporal_tls``, or an API key: Temporal Cloud's convention), False
    for plaintext. Raises ``SecureConnectionError`` naming an unreadable file."""
    if settings.temporal_tls is False:
        return False  # the settings refuse certificate options with it
    if (settings.temporal_tls_client_cert or settings.temporal_tls_server_ca
            or settings.temporal_tls_server_name):
        return TLSConfig(
            server_root_ca_cert=_read(settings.temporal_tls_server_ca, "temporal_tls_server_ca"),
            domain=settings.temporal_tls_server_name,
            client_cert=_read(settings.temporal_tls_client_cert, "temporal_tls_client_cert"),
            client_private_key=_read(settings.temporal_tls_client_key,
                                     "temporal_tls_client_key"),
        )
    return bool(settings.temporal_tls) or settings.temporal_api_key is not None


async def connect(settings: Settings, *, metrics_port: int | None = None) -> Client:
    """A Temporal client with the settings' TLS, API key and data converter
    (``data_converter``); with ``metrics_port``, its runtime serves Prometheus metrics
    (the SDK's and warmloop's own) on 127.0.0.1:<port>/metrics.

    Every warmloop process connects through here (workers, CLI, stack, benchmarks): a
    client built with ``Client.connect`` directly would skip TLS and the payload
    codec, and write jobs the rest of the fleet reads as plaintext or not at all."""
    tls = temporal_tls(settings)
    api_key = (None if settings.temporal_api_key is None
               else settings.temporal_api_key.get_secret_value())
    runtime = None
    if metrics_port is not None:
        runtime = Runtime(telemetry=TelemetryConfig(
            metrics=PrometheusConfig(bind_address=f"127.0.0.1:{metrics_port}")
        ))
    try:
        return await Client.connect(
            settings.temporal_address,
            namespace=settings.temporal_namespace,
            api_key=api_key,
            tls=tls,
            data_converter=data_converter(settings),
            runtime=runtime,
        )
    except RuntimeError as e:
        if tls is not False or api_key is not None:
            how = ("over TLS" if tls is not False else "in plaintext") + (
                " with an API key" if api_key is not None else "")
            raise StackNotRunningError(
                f"cannot connect to Temporal at {settings.temporal_address} {how} ({e}); "
                "check WARMLOOP_TEMPORAL_ADDRESS and the WARMLOOP_TEMPORAL_TLS* / "
                "WARMLOOP_TEMPORAL_API_KEY settings"
            ) from None
        raise StackNotRunningError(
            f"cannot reach Temporal at {settings.temporal_address} ({e}); "
            "start the embedded stack with `warmloop dev up` or set WARMLOOP_TEMPORAL_ADDRESS"
        ) from None


IO_THREADS = 32
"""Threads for blocking I/O (boto3's S3 calls, through ``asyncio.to_thread``)."""


def use_io_threads(n: int = IO_THREADS) -> None:
    """Give the running loop's default executor ``n`` threads. Python's default,
    min(32, cores + 4), is 6 on a 2-core host: steps taken at once then queue for a
    thread to store their transcripts, and the queue shows in every step's latency."""
    asyncio.get_running_loop().set_default_executor(
        ThreadPoolExecutor(max_workers=n, thread_name_prefix="warmloop-io"))


PLACEHOLDER_S3_KEY = "warmloop"
"""Access key id and secret used only for a loopback S3 endpoint (the embedded S3 server
of ``warmloop dev up``, which accepts any) when the AWS chain finds no credentials."""


def is_loopback_url(url: str | None) -> bool:
    """Whether ``url``'s host is this machine (localhost or a loopback address)."""
    host = urlsplit(url).hostname if url else None
    if host is None:
        return False
    if host.rstrip(".").lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def build_s3(settings: Settings) -> Any:
    """The process's S3 client.

    Credentials: ``s3_access_key_id``/``s3_secret_access_key`` when set; else boto3's
    standard chain (AWS_* variables, ~/.aws, web identity, container and instance
    roles), refreshed as the chain's credentials expire. Only when the chain finds
    nothing and the endpoint is loopback (the embedded S3 server) are placeholder
    keys used. The hazard this avoids: a default key passed explicitly overrides the
    chain, so an IAM role on the host is never used and every call fails as the fake
    user (or, worse, succeeds as whoever left AWS_ACCESS_KEY_ID in the environment).
    Resolving the chain here may take a second on a host where the instance metadata
    service does not answer quickly; it happens once, at start."""
    import boto3
    from botocore.config import Config

    session = boto3.session.Session()
    keys: dict[str, str] = {}
    if settings.s3_access_key_id is not None and settings.s3_secret_access_key is not None:
        keys = {"aws_access_key_id": settings.s3_access_key_id,
                "aws_secret_access_key": settings.s3_secret_access_key.get_secret_value()}
    elif session.get_credentials() is None and is_loopback_url(settings.s3_endpoint_url):
        keys = {"aws_access_key_id": PLACEHOLDER_S3_KEY,
                "aws_secret_access_key": PLACEHOLDER_S3_KEY}
    return session.client(
        "s3", endpoint_url=settings.s3_endpoint_url, region_name=settings.s3_region,
        config=Config(max_pool_connections=IO_THREADS), **keys,
    )


REDIS_RETRIES = 3
"""Retries of a Redis call whose connection failed (dropped, refused), 0.2 s, 0.4 s
and 0.8 s apart: a restart or failover of Redis (a second or so) is ridden out inside
the call, and a Redis that stays down fails the call in about 1.5 s."""
REDIS_SOCKET_TIMEOUT_S = 2.0
"""A Redis that accepts but does not answer (hung, partitioned) fails a call after
this long, instead of redis-py's 5 s, and a timeout is not retried: a hung Redis
rarely answers the next try, and every caller but the effect ledger can go on
without it."""
REDIS_HEALTH_CHECK_S = 10.0
"""A pooled connection idle this long is checked (PING) before it is used: one left
over from before a Redis restart is replaced, not tried and failed."""


class _Unretryable(Exception):
    def __init__(self, error: RedisAuthenticationError) -> None:
        super().__init__(str(error))
        self.error = error


class RetryConnectionErrors(Retry):
    """Retries dropped and refused connections, never a refused password.

    redis-py's AuthenticationError is a ConnectionError; retried (with the pool's
    health checks), a missing or wrong password made every call take about 7 s to
    fail, and the workers, which ride out Redis outages, took it for one. Refused at
    once, the error names the cause on the first call."""

    async def call_with_retry(self, do: Callable[[], Awaitable[T]], fail: Any,
                              *args: Any, **kwargs: Any) -> T:
        async def attempt() -> T:
            try:
                return await do()
            except RedisAuthenticationError as e:
                raise _Unretryable(e) from None

        try:
            return await super().call_with_retry(attempt, fail, *args, **kwargs)
        except _Unretryable as u:
            raise u.error from None


def redis_options(settings: Settings) -> dict[str, Any]:
    """AUTH and TLS options for a redis-py client or pool made from ``settings.redis_url``
    (``from_url(settings.redis_url, **redis_options(settings), ...)``): the password
    (unless the URL carries one) and, with a ``rediss://`` URL, the CA and client
    certificate. TLS itself comes from the scheme; redis-py then verifies the server's
    certificate and host name. Every Redis client of a warmloop process is built with
    these; one built from the URL alone fails with NOAUTH on a protected Redis."""
    options: dict[str, Any] = {}
    if settings.redis_password is not None:
        options["password"] = settings.redis_password.get_secret_value()
    if urlsplit(settings.redis_url).scheme == "rediss":
        if settings.redis_tls_ca is not None:
            options["ssl_ca_certs"] = str(settings.redis_tls_ca)
        if settings.redis_tls_client_cert is not None:
            options["ssl_certfile"] = str(settings.redis_tls_client_cert)
        if settings.redis_tls_client_key is not None:
            options["ssl_keyfile"] = str(settings.redis_tls_client_key)
    return options


def build_redis(settings: Settings) -> aioredis.Redis:
    """The process's Redis client, with the settings' AUTH and TLS (``redis_options``).
    The blocking pool waits for a connection at its cap where redis-py's default pool
    fails at once. A pool's connections take their retry policy from the pool's
    arguments, not the client's, so it is given here: without one, every dropped
    connection failed its call (and the worker loop that made it)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=64, timeout=10,
        retry=RetryConnectionErrors(ExponentialBackoff(cap=1.0, base=0.1),
                                    retries=REDIS_RETRIES,
                                    supported_errors=(RedisConnectionError,)),
        socket_timeout=REDIS_SOCKET_TIMEOUT_S, socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
        socket_keepalive=True, health_check_interval=REDIS_HEALTH_CHECK_S,
        **redis_options(settings))
    return aioredis.Redis(connection_pool=pool)
