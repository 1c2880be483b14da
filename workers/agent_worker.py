"""The agent worker: runs AgentJob workflows, tools, routing and storage activities."""

from __future__ import annotations

import asyncio
import os
import socket

import structlog
from temporalio.worker import Worker

from warmloop.workers.clients import build_redis, connect, use_io_threads
from warmloop.workers.logging import configure_logging
from warmloop.workers.plugins import PluginError
from warmloop.workers.settings import Settings
from warmloop.workers.temporal_plugin import WarmloopPlugin
from warmloop.workflows.contracts import AGENT_TASK_QUEUE

log = structlog.get_logger(__name__)
WORKER_KEY = "warmloop:worker:agent:{}"


async def run_agent_worker(settings: Settings) -> None:
    plugin = WarmloopPlugin(settings)
    use_io_threads()
    client = await connect(settings, metrics_port=settings.agent_metrics_port)
    redis = build_redis(settings)
    worker = Worker(client, task_queue=AGENT_TASK_QUEUE, plugins=[plugin],
                    max_concurrent_activities=64)
    me = WORKER_KEY.format(f"{socket.gethostname()}-{os.getpid()}")

    async def beat() -> None:
        while True:
            await redis.set(me, "1", px=int(settings.engine_ttl_s * 1000))
            await asyncio.sleep(settings.engine_heartbeat_s)

    log.info("agent_worker_started", task_queue=AGENT_TASK_QUEUE,
             metrics_port=settings.agent_metrics_port)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(beat())
        tg.create_task(worker.run())


def main() -> None:
    settings = Settings()
    configure_logging(settings.log_format, settings.log_level)
    try:
        asyncio.run(run_agent_worker(settings))
    except PluginError as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
