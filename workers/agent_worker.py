"""The agent worker: runs AgentJob workflows, tools, routing and storage activities."""

from __future__ import annotations

import asyncio
import os
import socket

import boto3
import redis.asyncio as aioredis
import structlog
from temporalio.worker import Worker

from activities.registry import EngineRegistry
from activities.routing import RoutingActivities
from activities.storage import StorageActivities
from activities.tools import TicketTriageTools, ToolActivities
from workers.logging import configure_logging
from workers.settings import Settings
from workers.temporal import connect
from workflows.agent_job import AgentJob
from workflows.contracts import AGENT_TASK_QUEUE

log = structlog.get_logger(__name__)
WORKER_KEY = "warmloop:worker:agent:{}"


def build_s3(settings: Settings):  # type: ignore[no-untyped-def]
    return boto3.client(
        "s3", endpoint_url=settings.s3_endpoint_url, region_name=settings.s3_region,
        aws_access_key_id=os.environ.get("AWS_ACCESS_KEY_ID", "warmloop"),
        aws_secret_access_key=os.environ.get("AWS_SECRET_ACCESS_KEY", "warmloop"),
    )


async def run_agent_worker(settings: Settings) -> None:
    client = await connect(settings)
    redis = aioredis.Redis.from_url(settings.redis_url)
    registry = EngineRegistry(redis, ttl_s=settings.engine_ttl_s)
    routing = RoutingActivities(registry, redis)
    tools = ToolActivities([TicketTriageTools.bundled()])
    storage = StorageActivities(build_s3(settings), settings.s3_bucket)
    worker = Worker(
        client,
        task_queue=AGENT_TASK_QUEUE,
        workflows=[AgentJob],
        activities=[routing.pick_engine, tools.run_tool, storage.store_transcript],
        max_concurrent_activities=64,
    )
    me = WORKER_KEY.format(f"{socket.gethostname()}-{os.getpid()}")

    async def beat() -> None:
        while True:
            await redis.set(me, "1", px=int(settings.engine_ttl_s * 1000))
            await asyncio.sleep(settings.engine_heartbeat_s)

    log.info("agent_worker_started", task_queue=AGENT_TASK_QUEUE)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(beat())
        tg.create_task(worker.run())


def main() -> None:
    settings = Settings()
    configure_logging(settings.log_format, settings.log_level)
    asyncio.run(run_agent_worker(settings))


if __name__ == "__main__":
    main()
