"""``WarmloopPlugin``: warmloop's workflows and activities in any Temporal worker.

Temporal's plugin interface (``temporalio.plugin.SimplePlugin``, as the SDK's own
``OpenAIAgentsPlugin`` uses) lets a team run ``AgentJob`` and ``BatchRun`` inside the
worker it already operates, beside its own workflows and activities. warmloop's agent
worker is built the same way.
"""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Any

from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.plugin import SimplePlugin
from temporalio.worker import WorkerConfig, WorkflowRunner
from temporalio.worker.workflow_sandbox import SandboxedWorkflowRunner

from warmloop.workers.plugins import LoadedPlugins, check_tools_implemented, load_plugins
from warmloop.workers.settings import Settings


def passthrough_runner(modules: Sequence[str]) -> Callable[[WorkflowRunner | None],
                                                            WorkflowRunner]:
    """Pass warmloop and the plugins' modules through the workflow sandbox.

    The sandbox re-imports workflow code per run; a re-imported profile registry would
    be empty, and a plugin's profile classes would be copies. Passed through, the
    workflow reads the registry the process loaded at start. These modules are pure
    (warmloop's workflow code is deterministic by construction; a plugin's profile
    modules must be too: no I/O or clocks at import)."""

    def configure(runner: WorkflowRunner | None) -> WorkflowRunner:
        runner = runner or SandboxedWorkflowRunner()
        if isinstance(runner, SandboxedWorkflowRunner):
            # cryptography too: the decide validator verifies signatures, and its Rust
            # core imports its exception types when it raises; re-imported in the
            # sandbox, that import aborts the process instead of raising. And redis
            # (no workflow calls it): a collection that runs on the workflow thread may
            # finalize a connection pool, whose __del__ imports redis.observability;
            # in the sandbox that re-imports redis (and is refused its os.environ).
            return dataclasses.replace(
                runner, restrictions=runner.restrictions.with_passthrough_modules(
                    *modules, "cryptography", "redis"))
        return runner

    return configure


def sandbox_runner(modules: Sequence[str] = ("warmloop",)) -> WorkflowRunner:
    """A sandboxed runner that passes ``modules`` through (see ``passthrough_runner``):
    for a ``Worker`` or ``Replayer`` built without ``WarmloopPlugin``."""
    return passthrough_runner(modules)(None)


@dataclass
class AgentActivities:
    """The agent task queue's activities and the clients they hold (closed with them)."""

    activities: list[Callable[..., Any]]
    closers: list[Callable[[], Awaitable[None]]]

    async def aclose(self) -> None:
        for close in self.closers:
            await close()


def build_agent_activities(settings: Settings, loaded: LoadedPlugins) -> AgentActivities:
    """The agent task queue's activities, with their clients built once, here."""
    from warmloop.activities.batch import BatchActivities
    from warmloop.activities.hygiene import HygieneActivities
    from warmloop.activities.pauses import PauseActivities, PauseStats
    from warmloop.activities.registry import EngineRegistry, TenantUsage
    from warmloop.activities.routing import RoutingActivities
    from warmloop.activities.storage import StorageActivities
    from warmloop.activities.tenant_slots import TenantSlotActivities
    from warmloop.activities.tools import EffectLedger, Hedging, ToolActivities
    from warmloop.workers.clients import build_redis, build_s3

    redis = build_redis(settings)
    s3 = build_s3(settings)
    registry = EngineRegistry(redis, ttl_s=settings.engine_ttl_s)
    routing = RoutingActivities(registry, redis, config=settings.routing,
                                quotas=settings.tenants)
    # Hedging reads its thresholds from the pause statistics and counts its hedges in
    # Redis (``warmloop:tool_hedges``, which bench-hedge reads).
    tools = ToolActivities(loaded.toolsets, EffectLedger(redis), s3=s3,
                           bucket=settings.s3_bucket, pauses=PauseStats(redis),
                           hedging=Hedging(PauseStats(redis), redis=redis))
    pauses = PauseActivities(PauseStats(redis))
    storage = StorageActivities(s3, settings.s3_bucket)
    batch = BatchActivities(s3, settings.s3_bucket, inputs=settings.batch_input_dirs,
                            quotas=settings.tenants)
    hygiene = HygieneActivities(s3, settings.s3_bucket)
    slots = TenantSlotActivities(TenantUsage(redis), settings.tenants)

    async def close_s3() -> None:
        s3.close()

    return AgentActivities(
        [routing.route_step, routing.pick_engine, routing.engine_alive, routing.batch_window,
         tools.run_tool,
         storage.store_transcript,
         storage.load_transcript_chunk,
         batch.read_records, batch.write_batch_results, batch.write_recovered_page,
         slots.claim_job_slot,
         pauses.record_pause,
         hygiene.archive_tool_outputs],
        [tools.aclose, redis.aclose, close_s3])


class WarmloopPlugin(SimplePlugin):
    """Adds ``AgentJob``, ``BatchRun`` and ``TimerProbe``, the agent activities
    (routing, tools, storage) and the sandbox passthrough to a worker.

    Give it to the worker that polls ``warmloop.AGENT_TASK_QUEUE`` (where the workflows
    schedule their activities): ``Worker(client, task_queue=AGENT_TASK_QUEUE,
    plugins=[WarmloopPlugin()])``. Its client must use the pydantic data converter
    (``temporalio.contrib.pydantic.pydantic_data_converter``): warmloop's payloads are
    pydantic models, and a worker whose client lacks it is refused at start. Given to
    ``Client.connect`` instead, it would add warmloop's workflows and activities to
    every worker of that client, on every task queue. Plugins (``WARMLOOP_PLUGINS``,
    entry points) are loaded here, once, and a tool no runner can serve stops the
    worker at start, not a job at its fifth step. The clients the activities hold
    (Redis, S3, HTTP) are closed when the worker stops.
    """

    def __init__(self, settings: Settings | None = None, *, activities: bool = True) -> None:
        """``activities=False``: workflows only (another worker serves the agent
        activities, or a replayer)."""
        from warmloop.workflows.agent_job import AgentJob
        from warmloop.workflows.batch_run import BatchRun
        from warmloop.workflows.timer_probe import TimerProbe

        self.settings = settings or Settings()
        self.loaded = load_plugins(plugins=self.settings.plugins,
                                   profile_paths=self.settings.profile_paths)
        self.agent_activities: AgentActivities | None = None
        if activities:
            check_tools_implemented(self.loaded)
            self.agent_activities = build_agent_activities(self.settings, self.loaded)

        @asynccontextmanager
        async def closing() -> AsyncIterator[None]:
            try:
                yield
            finally:
                if self.agent_activities is not None:
                    await self.agent_activities.aclose()

        super().__init__(
            "warmloop.WarmloopPlugin", workflows=[AgentJob, BatchRun, TimerProbe],
            activities=self.agent_activities.activities if self.agent_activities else None,
            workflow_runner=passthrough_runner(self.loaded.modules), run_context=closing)

    def configure_worker(self, config: WorkerConfig) -> WorkerConfig:
        converter = config["client"].data_converter
        if not issubclass(converter.payload_converter_class,
                          pydantic_data_converter.payload_converter_class):
            raise ValueError("WarmloopPlugin: the worker's client does not use the pydantic "
                             "data converter; pass the plugin to Client.connect(plugins=[...]) "
                             "or connect with temporalio.contrib.pydantic."
                             "pydantic_data_converter")
        return super().configure_worker(config)
