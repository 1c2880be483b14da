"""Clients built once at worker start from the settings: Temporal, S3, Redis."""

from __future__ import annotations

import os
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


def build_s3(settings: Settings) -> Any:
    import boto3

    return boto3.client(
        "s3", endpoint_url=settings.s3_endpoint_url, region_name=settings.s3_region,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "warmloop"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "warmloop"),
    )


def build_redis(settings: Settings) -> aioredis.Redis:
    # Blocking pool: redis-py's default pool fails fast at its connection cap.
    pool = aioredis.BlockingConnectionPool.from_url(settings.redis_url, max_connections=64,
                                                    timeout=10)
    return aioredis.Redis(connection_pool=pool)
