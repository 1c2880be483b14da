"""Clients built once at worker start from the settings: Temporal, S3, Redis."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis.asyncio as aioredis
from redis.asyncio.retry import Retry
from redis.backoff import ExponentialBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from temporalio.client import Client
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.runtime import PrometheusConfig, Runtime, TelemetryConfig

from warmloop.workers.settings import Settings


class StackNotRunningError(RuntimeError):
    """Temporal (or another part of the stack) cannot be reached."""


async def connect(settings: Settings, *, metrics_port: int | None = None) -> Client:
    """A Temporal client; with ``metrics_port``, its runtime serves Prometheus metrics
    (the SDK's and warmloop's own) on 127.0.0.1:<port>/metrics."""
    runtime = None
    if metrics_port is not None:
        runtime = Runtime(telemetry=TelemetryConfig(
            metrics=PrometheusConfig(bind_address=f"127.0.0.1:{metrics_port}")
        ))
    try:
        return await Client.connect(
            settings.temporal_address,
            namespace=settings.temporal_namespace,
            data_converter=pydantic_data_converter,
            runtime=runtime,
        )
    except RuntimeError as e:
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


def build_s3(settings: Settings) -> Any:
    import boto3
    from botocore.config import Config

    return boto3.client(
        "s3", endpoint_url=settings.s3_endpoint_url, region_name=settings.s3_region,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "warmloop"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "warmloop"),
        config=Config(max_pool_connections=IO_THREADS),
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


def build_redis(settings: Settings) -> aioredis.Redis:
    """The process's Redis client. The blocking pool waits for a connection at its cap
    where redis-py's default pool fails at once. A pool's connections take their retry
    policy from the pool's arguments, not the client's, so it is given here: without
    one, every dropped connection failed its call (and the worker loop that made it)."""
    pool = aioredis.BlockingConnectionPool.from_url(
        settings.redis_url, max_connections=64, timeout=10,
        retry=Retry(ExponentialBackoff(cap=1.0, base=0.1), retries=REDIS_RETRIES,
                    supported_errors=(RedisConnectionError,)),
        socket_timeout=REDIS_SOCKET_TIMEOUT_S, socket_connect_timeout=REDIS_SOCKET_TIMEOUT_S,
        socket_keepalive=True, health_check_interval=REDIS_HEALTH_CHECK_S)
    return aioredis.Redis(connection_pool=pool)
