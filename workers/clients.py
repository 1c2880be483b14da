"""Clients built once at worker start from the settings: Temporal, S3, Redis."""

from __future__ import annotations

import asyncio
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis.asyncio as aioredis
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


def build_redis(settings: Settings) -> aioredis.Redis:
    # Blocking pool: redis-py's default pool fails fast at its connection cap.
    pool = aioredis.BlockingConnectionPool.from_url(settings.redis_url, max_connections=64,
                                                    timeout=10)
    return aioredis.Redis(connection_pool=pool)
