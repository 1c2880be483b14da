"""The agent worker: runs AgentJob workflows, tools, routing and storage activities."""

from __future__ import annotations

import asyncio
import os
import socket

import structlog
from temporalio.worker import Worker

from warmloop.activities.batch import BatchActivities
from warmloop.activities.pauses import PauseActivities, PauseStats
from warmloop.activities.registry import EngineRegistry
from warmloop.activities.routing import RoutingActivities
from warmloop.activities.storage import StorageActivities
from warmloop.activities.tools import EffectLedger, ToolActivities
from warmloop.activities.tools.invoice_reconciliation import InvoiceReconciliationTools
from warmloop.activities.tools.synthetic import SyntheticTools
from warmloop.activities.tools.ticket_triage import TicketTriageTools
from warmloop.workers.clients import build_redis, build_s3, connect
from warmloop.workers.logging import configure_logging
from warmloop.workers.settings import Settings
from warmloop.workflows.agent_job import AgentJob
from warmloop.workflows.batch_run import BatchRun
from warmloop.workflows.contracts import AGENT_TASK_QUEUE
from warmloop.workflows.profiles.synthetic import SYNTHETIC_PROFILES

log = structlog.get_logger(__name__)
WORKER_KEY = "warmloop:worker:agent:{}"


async def run_agent_worker(settings: Settings) -> None:
    client = await connect(settings, metrics_port=settings.agent_metrics_port)
    redis = build_redis(settings)
    s3 = build_s3(settings)
    registry = EngineRegistry(redis, ttl_s=settings.engine_ttl_s)
    routing = RoutingActivities(registry, redis, config=settings.routing)
    tools = ToolActivities(
        [TicketTriageTools.bundled(), InvoiceReconciliationTools.bundled(),
         *(SyntheticTools(p.name, settings.synthetic_pauses) for p in SYNTHETIC_PROFILES)],
        EffectLedger(redis), s3=s3, bucket=settings.s3_bucket, pauses=PauseStats(redis),
    )
    pauses = PauseActivities(PauseStats(redis))
    storage = StorageActivities(s3, settings.s3_bucket)
    batch = BatchActivities(s3, settings.s3_bucket)
    worker = Worker(
        client,
        task_queue=AGENT_TASK_QUEUE,
        workflows=[AgentJob, BatchRun],
        activities=[routing.route_step, routing.pick_engine, tools.run_tool,
                    storage.store_transcript, batch.read_records, batch.write_batch_results,
                    pauses.record_pause],
        max_concurrent_activities=64,
    )
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
    asyncio.run(run_agent_worker(settings))


if __name__ == "__main__":
    main()
