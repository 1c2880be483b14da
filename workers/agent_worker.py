"""The agent worker: runs AgentJob workflows, tools, routing and storage activities."""

from __future__ import annotations

import asyncio
import os
import socket
from typing import Any

import redis.asyncio as aioredis
import structlog
from temporalio.worker import Worker

from warmloop.activities.registry import RedisOutage, stop_if_cancelled
from warmloop.workers.clients import REDIS_SOCKET_TIMEOUT_S, build_redis, connect, use_io_threads
from warmloop.workers.identity import install_verify_keys_from_settings
from warmloop.workers.logging import configure_logging
from warmloop.workers.plugins import PluginError
from warmloop.workers.settings import Settings
from warmloop.workers.temporal_plugin import WarmloopPlugin
from warmloop.workers.timer_check import warn_if_timers_late
from warmloop.workflows.agent_job import SEARCH_ATTRIBUTES
from warmloop.workflows.contracts import AGENT_TASK_QUEUE

log = structlog.get_logger(__name__)
WORKER_KEY = "warmloop:worker:agent:{}"


class MissingSearchAttributesError(RuntimeError):
    """The namespace lacks search attributes that AgentJob upserts."""


async def check_search_attributes(client: Any) -> None:
    """Refuse a namespace without warmloop's search attributes (of the right types).

    AgentJob upserts them from its first step; on a namespace without them every
    workflow task fails and is retried for good, so every job hangs with nothing in the
    worker's log. Better one line at start naming the command that registers them. A
    server that cannot list them (the time-skipping test server) is not refused."""
    from temporalio.api.enums.v1 import IndexedValueType
    from temporalio.api.operatorservice.v1 import ListSearchAttributesRequest
    from temporalio.service import RPCError, RPCStatusCode

    try:
        have = dict((await client.operator_service.list_search_attributes(
            ListSearchAttributesRequest(namespace=client.namespace))).custom_attributes)
    except RPCError as e:
        if e.status == RPCStatusCode.UNIMPLEMENTED:
            return
        raise
    want = {name: IndexedValueType.Value(f"INDEXED_VALUE_TYPE_{_enum(kind)}")
            for name, kind in SEARCH_ATTRIBUTES.items()}
    missing = {name: kind for name, kind in SEARCH_ATTRIBUTES.items() if name not in have}
    retyped = {name: kind for name, kind in SEARCH_ATTRIBUTES.items()
               if name in have and have[name] != want[name]}
    if not missing and not retyped:
        return
    ns = client.namespace
    problems = []
    if missing:
        flags = " ".join(f"--name {name} --type {kind}" for name, kind in missing.items())
        problems.append(
            "lacks the search attributes "
            + ", ".join(f"{name} ({kind})" for name, kind in missing.items())
            + f" that every job sets; register them with `temporal operator search-attribute "
            f"create --namespace {ns} {flags}`")
    for name, kind in retyped.items():
        problems.append(f"has {name} of another type than {kind}; remove it (`temporal "
                        f"operator search-attribute remove --namespace {ns} --name {name}`) "
                        f"and create it as {kind}")
    raise MissingSearchAttributesError(
        f"Temporal namespace {ns!r} " + "; ".join(problems)
        + (" (the embedded stack: `warmloop dev up` registers them)" if missing else ""))


def _enum(kind: str) -> str:
    """"KeywordList" -> "KEYWORD_LIST" (IndexedValueType's spelling)."""
    return "".join(f"_{c}" if c.isupper() and i else c for i, c in enumerate(kind)).upper()


async def beat(redis: aioredis.Redis, key: str, *, ttl_s: float, interval_s: float,
               outage: RedisOutage | None = None) -> None:
    """Say this worker is alive (``warmloop dev status`` counts agent workers by it).

    Advice, like the rest of Redis here: an outage is logged once and the worker goes
    on (it would otherwise leave the worker's task group and stop the worker)."""
    outage = outage or RedisOutage()
    while True:
        stop_if_cancelled()
        await outage.attempt("agent worker heartbeat",
                             lambda: redis.set(key, "1", px=int(ttl_s * 1000)), None,
                             timeout_s=REDIS_SOCKET_TIMEOUT_S, probe=True)
        await asyncio.sleep(interval_s)


async def run_agent_worker(settings: Settings) -> None:
    plugin = WarmloopPlugin(settings)
    use_io_threads()
    client = await connect(settings, metrics_port=settings.agent_metrics_port)
    await check_search_attributes(client)
    # The decide validator accepts assertions signed by these keys only; none: every
    # decision is refused (and says which setting is missing).
    key_ids = install_verify_keys_from_settings(settings)
    if not key_ids:
        log.warning("no_approval_verify_keys", hint="set WARMLOOP_APPROVAL_VERIFY_KEYS; "
                    "every approval decision will be refused")
    redis = build_redis(settings)
    worker = Worker(client, task_queue=AGENT_TASK_QUEUE, plugins=[plugin],
                    max_concurrent_activities=64)
    me = WORKER_KEY.format(f"{socket.gethostname()}-{os.getpid()}")
    log.info("agent_worker_started", task_queue=AGENT_TASK_QUEUE,
             metrics_port=settings.agent_metrics_port, approval_key_ids=key_ids)
    async with asyncio.TaskGroup() as tg:
        tg.create_task(beat(redis, me, ttl_s=settings.engine_ttl_s,
                            interval_s=settings.engine_heartbeat_s))
        tg.create_task(worker.run())
        if settings.timer_check:  # served by this worker (or another on the queue)
            tg.create_task(warn_if_timers_late(client))


def main() -> None:
    settings = Settings()
    configure_logging(settings.log_format, settings.log_level)
    try:
        asyncio.run(run_agent_worker(settings))
    except (PluginError, MissingSearchAttributesError) as e:
        raise SystemExit(f"error: {e}") from None


if __name__ == "__main__":
    main()
