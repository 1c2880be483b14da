"""The inference worker beside one engine: serves ``generate`` on ``engine.<id>`` and
heartbeats the engine's health and load into the registry."""

from __future__ import annotations

import argparse
import asyncio
import os
import socket
import time
from collections.abc import Callable
from typing import Any

import httpx
import msgpack
import structlog
import zmq
import zmq.asyncio
from temporalio import activity
from temporalio.worker import FixedSizeSlotSupplier, Worker, WorkerTuner

from warmloop.activities.admission import BatchAdmission, SharedBatchSlots
from warmloop.activities.cachebust import CacheBust, CacheBustDetector
from warmloop.activities.directory import KvEventApplier, PrefixDirectory
from warmloop.activities.holds import HoldManager, WorkflowsOver, without_touches
from warmloop.activities.inference import InferenceActivities
from warmloop.activities.pauses import PauseStats
from warmloop.activities.registry import (
    REDIS_ERRORS,
    EngineHeartbeat,
    EngineRegistry,
    RedisOutage,
    TenantUsage,
    parse_cache_config,
    parse_vllm_metrics,
    stop_if_cancelled,
)
from warmloop.activities.routing import RoutingActivities
from warmloop.activities.trace_prompts import TracePromptStore
from warmloop.activities.transcripts import TranscriptStore
from warmloop.workers.calibrate import CalibrationSource, calibration_file
from warmloop.workers.clients import (
    REDIS_SOCKET_TIMEOUT_S,
    build_redis,
    build_s3,
    connect,
    use_io_threads,
)
from warmloop.workers.logging import configure_logging
from warmloop.workers.plugins import PluginError, load_plugins
from warmloop.workers.settings import KV_EVENTS_TOPIC, EngineEndpoint, Settings
from warmloop.workers.step_slots import EngineStepSlots, StepSlotConfig
from warmloop.workflows.calibration import EngineCalibration
from warmloop.workflows.contracts import engine_task_queue
from warmloop.workflows.holding import EvictionRegret, TtlCacheEndpoint

log = structlog.get_logger(__name__)


async def probe_engine(http: httpx.AsyncClient, engine: EngineEndpoint, *,
                       own_touches: Callable[[], int] | None = None) -> EngineHeartbeat:
    """The engine's heartbeat as its ``/health`` and ``/metrics`` say. ``own_touches``:
    the worker's hold touches in flight now (``HoldManager.touching``); those in flight
    both before and after the metrics were read are left out of its running and waiting
    requests (``without_touches``)."""
    base = engine.url.rstrip("/")
    healthy, metrics, block_size, capacity, touching = False, {}, 0, 0, 0
    try:
        healthy = (await http.get(f"{base}/health", timeout=2.0)).status_code == 200
        if healthy:
            before = own_touches() if own_touches is not None else 0
            text = (await http.get(f"{base}/metrics", timeout=2.0)).text
            touching = min(before, own_touches()) if own_touches is not None else 0
            metrics = parse_vllm_metrics(text)
            block_size, capacity = parse_cache_config(text)
    except httpx.HTTPError:
        healthy = False
    running, waiting = without_touches(int(metrics.get("vllm:num_requests_running", 0)),
                                       int(metrics.get("vllm:num_requests_waiting", 0)),
                                       touching)
    return EngineHeartbeat(
        engine_id=engine.id, task_queue=engine_task_queue(engine.id), model=engine.model,
        url=engine.url, healthy=healthy, running=running, waiting=waiting,
        kv_usage=metrics.get("vllm:kv_cache_usage_perc", 0.0), at=time.time(),
        block_size=block_size or 16, kv_capacity_tokens=capacity,
        prefill_computed_total=(metrics.get("vllm:prefix_cache_queries_total", 0.0)
                                - metrics.get("vllm:prefix_cache_hits_total", 0.0)),
        precise=engine.kv_events is not None,
        # priced by its declared price, else by its calibration (set by heartbeat_loop)
        priced=engine.price is not None,
        worker=f"{socket.gethostname()}-{os.getpid()}",
    )


class EngineView:
    """The worker's latest view of its engine, shared by the heartbeat and activities."""

    def __init__(self) -> None:
        self.last: EngineHeartbeat | None = None
        self.listeners: list[Callable[[EngineHeartbeat], None]] = []

    def update(self, hb: EngineHeartbeat) -> None:
        self.last = hb
        for listener in self.listeners:
            listener(hb)

    def __call__(self) -> EngineHeartbeat | None:
        return self.last


async def heartbeat_loop(registry: EngineRegistry, http: httpx.AsyncClient,
                         engine: EngineEndpoint, interval_s: float,
                         view: EngineView | None = None,
                         admission: BatchAdmission | None = None,
                         directory: PrefixDirectory | None = None,
                         holds: HoldManager | None = None,
                         outage: RedisOutage | None = None,
                         calibration: CalibrationSource | None = None) -> None:
    """Probe the engine and publish what it says, every ``interval_s``, and at once when
    ``holds`` makes a hold.

    The probe and the worker's own view of its engine go on whatever Redis does: the
    registry is how *others* find the engine, and a Redis that is away (logged once by
    ``outage``) only means they keep their last snapshot. This loop tries Redis on every
    beat, so it is what notices Redis is back for the rest of the worker."""
    outage = outage or RedisOutage()
    was_healthy: bool | None = None
    clear_directory = False  # the engine (re)started and the directory still says otherwise
    publishing: asyncio.Task[None] | None = None
    seen_calibration: EngineCalibration | None = None

    async def publish(hb: EngineHeartbeat) -> None:
        nonlocal clear_directory
        try:
            async with asyncio.timeout(max(2.0, 2 * interval_s)):
                await _publish(registry, hb, engine.id, admission)
                if clear_directory and directory is not None:
                    await directory.clear_engine(engine.id)
                    clear_directory = False
        except REDIS_ERRORS as e:
            outage.failed(e, what="engine heartbeat")
        except Exception:  # noqa: BLE001 - the next beat tries again; the worker serves on
            log.exception("engine_heartbeat_failed")
        else:
            outage.ok()

    queued: EngineHeartbeat | None = None
    """A hold's heartbeat waiting for the publish in flight (at most one: the latest)."""

    async def publish_queued(in_flight: asyncio.Task[None]) -> None:
        nonlocal queued
        try:
            await asyncio.wait({in_flight})
        except asyncio.CancelledError:
            in_flight.cancel()
            raise
        hb, queued = queued, None
        if hb is not None:
            await publish(hb)

    try:
        while True:
            stop_if_cancelled()
            hb = await probe_engine(http, engine, own_touches=(
                None if holds is None else lambda: holds.touching))
            if calibration is not None:
                hb.calibration = await calibration.refresh()
                hb.priced = True
                if admission is not None and hb.calibration is not seen_calibration:
                    admission.calibrate(hb.calibration)
                seen_calibration = hb.calibration
            if holds is not None:
                hb.held_tokens = holds.held_tokens
                if holds.regret is not None:
                    hb.room_regret = holds.regret.curve(time.time())
                if hb.healthy:
                    holds.observe_engine(hb.prefill_computed_total)
            if admission is not None:
                hb.batch_limit, hb.batch_active = admission.effective_limit, admission.active
                hb.batch_kv_fit = admission.kv_fit
                hb.batch_waiting = admission.waiting
                hb.interactive_ttft_p95_ms = admission.recent_interactive_p95_ms()
            if view is not None:
                view.update(hb)
            if hb.healthy != was_healthy:
                log.info("engine_health", engine=engine.id, healthy=hb.healthy)
                # A (re)started engine holds nothing: forget what the directory believed.
                clear_directory = bool(hb.healthy and directory is not None)
                was_healthy = hb.healthy
            # Beside the probe, one at a time: a Redis that is slow to fail (retrying,
            # hung) must not slow the worker's own view of its engine.
            if publishing is None or publishing.done():
                publishing = asyncio.ensure_future(publish(hb))
            if holds is None:
                await asyncio.sleep(interval_s)
                continue
            # Until the next beat, a new hold is published at once (the router counts
            # held tokens as taken KV) with this beat's probe: probing again would feed
            # the churn meter a short interval holding the step's prefill.
            deadline = time.monotonic() + interval_s
            while (left := deadline - time.monotonic()) > 0:
                try:
                    await asyncio.wait_for(holds.held_more.wait(), left)
                except TimeoutError:
                    break
                holds.held_more.clear()
                hb = hb.model_copy(update={"held_tokens": holds.held_tokens})
                if publishing is None or publishing.done():
                    publishing = asyncio.ensure_future(publish(hb))
                elif queued is None:  # after the one in flight, not instead of it
                    queued = hb
                    publishing = asyncio.ensure_future(publish_queued(publishing))
                else:
                    queued = hb  # the follow-up not yet sent takes the latest
    finally:
        if publishing is not None:
            publishing.cancel()


async def _publish(registry: EngineRegistry, hb: EngineHeartbeat, engine_id: str,
                   admission: BatchAdmission | None) -> None:
    """One beat's Redis work: the heartbeat (or leaving, for an engine that fails its
    health check: never route to it) and the neighbours' TTFT for batch admission."""
    if admission is not None and admission.shared is not None:
        # first, and whatever the engine's health: its calls run on while it is slow
        await admission.shared.renew_if_due()
    if not hb.healthy:
        await registry.leave(engine_id)
        return
    await registry.heartbeat(hb)
    if admission is not None and admission.config.fleet_signal:
        admission.observe_fleet([
            e.interactive_ttft_p95_ms for e in await registry.live()
            if e.engine_id != engine_id and e.interactive_ttft_p95_ms is not None])


async def loop_lag_monitor(interval_s: float = 0.5, warn_ms: float = 200.0) -> None:
    """Log when this worker's event loop runs late: a late loop delays pickups and
    inflates the TTFT the worker measures (and feeds to batch admission)."""
    loop = asyncio.get_running_loop()
    while True:
        start = loop.time()
        await asyncio.sleep(interval_s)
        lag_ms = (loop.time() - start - interval_s) * 1000
        if lag_ms > warn_ms:
            log.warning("event_loop_lag", lag_ms=round(lag_ms))


async def kv_event_loop(endpoint: str, applier: KvEventApplier,
                        outage: RedisOutage | None = None, idle_s: float = 1.0) -> None:
    """Follow the engine's KV events into the prefix directory (precise mode).

    The engine connects to this endpoint; the worker binds it, so the engine need not
    know whether anyone listens. Events lost while the worker was down only make the
    directory stale until the blocks are touched again. Events that arrive while Redis
    is away are still followed in memory (``applier``); when Redis answers again (on
    the next event, or within ``idle_s``) the engine's directory entry is rebuilt from
    them, so an outage leaves no block the engine has evicted in the directory."""
    outage = outage or RedisOutage()
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.bind(endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC.encode())
    log.info("kv_events_listening", endpoint=endpoint)
    try:
        while True:
            stop_if_cancelled()
            events: list[Any] = []
            if await sock.poll(int(idle_s * 1000)):
                frames = await sock.recv_multipart()
                try:
                    batch = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                    events = list(batch[1] if isinstance(batch, (list, tuple)) else [])
                    applier.follow(events)
                except (ValueError, TypeError, IndexError, KeyError) as e:
                    log.warning("kv_event_unreadable", error=str(e))
                    continue
            elif not applier.behind:
                continue
            if not outage.should_try():
                applier.behind = True
                continue
            try:
                async with asyncio.timeout(REDIS_SOCKET_TIMEOUT_S):
                    await applier.publish()
            except REDIS_ERRORS as e:
                outage.failed(e, what="kv events")
            else:
                outage.ok()
    finally:
        sock.close(linger=0)


def _ttl_cache(engine: EngineEndpoint) -> TtlCacheEndpoint | None:
    """A ttl_cache engine's keep-alive economics, from its declared per-token price."""
    if engine.kind == "vllm":
        return None
    p = engine.price
    # EngineEndpoint refuses a ttl_cache engine without a per-token price
    assert p is not None and p.kind == "per_token"
    assert (p.input_usd_per_mtok is not None and p.cached_input_usd_per_mtok is not None
            and p.output_usd_per_mtok is not None)
    return TtlCacheEndpoint(cache_ttl_s=engine.cache_ttl_s,
                            input_usd_per_mtok=p.input_usd_per_mtok,
                            cached_input_usd_per_mtok=p.cached_input_usd_per_mtok,
                            output_usd_per_mtok=p.output_usd_per_mtok)


async def run_inference_worker(settings: Settings, engine_id: str) -> None:
    engine = settings.engine(engine_id)
    use_io_threads()
    structlog.contextvars.bind_contextvars(engine=engine.id)
    client = await connect(settings, metrics_port=settings.inference_metrics_port(engine.id))
    redis = build_redis(settings)
    # One view of Redis for the whole worker: an outage is logged once, and the step
    # path skips Redis until the heartbeat (or a due probe) finds it back.
    outage = RedisOutage()
    registry = EngineRegistry(redis, ttl_s=settings.engine_ttl_s)
    slot_config = StepSlotConfig(floor=settings.inference_min_steps,
                                 ceiling=settings.inference_max_steps,
                                 queue_share=settings.inference_queue_share)
    limits = httpx.Limits(max_connections=settings.inference_max_steps,
                          max_keepalive_connections=64)
    # A stream that sends nothing for 30 s is treated as lost: the activity fails and
    # Temporal retries it, instead of a step hanging until start_to_close.
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0),
                                 limits=limits) as http:
        directory = PrefixDirectory(redis, trace=settings.trace_prompt_chains)
        view = EngineView()
        slots = EngineStepSlots(view, slot_config)

        def on_heartbeat(_: EngineHeartbeat) -> None:
            before = slots.limit
            now = slots.refresh()
            if now.slots != before:
                log.info("step_slots", slots=now.slots, was=before, why=now.reason)

        view.listeners.append(on_heartbeat)
        def on_bust(b: CacheBust) -> None:
            activity.metric_meter().create_counter(
                "warmloop_cache_busts", "prompt prefixes that changed where they should not"
            ).add(1, {"profile": b.profile, "kind": b.kind})

        calibration = CalibrationSource(
            redis, engine.id, preset_calibration=settings.engine_calibration_base(engine),
            file=calibration_file(settings.state_dir, engine.id))
        admission = BatchAdmission(
            settings.admission,
            kv_pool=lambda: view.last,
            # K is the engine's: the gateways admit batch calls to it too
            shared=SharedBatchSlots.for_engine(redis, engine.id, settings.admission,
                                               holder=f"worker-{engine.id}"))
        # The engine's evictions (its KV events), for the hold model's rent.
        regret = EvictionRegret() if engine.kv_events else None
        holds = HoldManager(engine_id=engine.id, base_url=engine.url, model=engine.model,
                            http=http, redis=redis, pauses=PauseStats(redis, outage=outage),
                            engine_info=view, config=settings.holding, directory=directory,
                            ttl_cache=_ttl_cache(engine), outage=outage, regret=regret,
                            jobs_over=WorkflowsOver(client))
        inference = InferenceActivities(
            engine_id=engine.id, base_url=engine.url, model=engine.model, http=http,
            price=engine.price,
            transcripts=TranscriptStore(build_s3(settings), settings.s3_bucket),
            trace_prompts=TracePromptStore(build_s3(settings), settings.s3_bucket),
            directory=directory, registry=registry,
            detector=CacheBustDetector(redis, directory, on_bust=on_bust),
            engine_info=view, admission=admission, holds=holds, outage=outage,
            usage=TenantUsage(redis),  # each step's tokens onto its tenant's hour
            grounded_arguments=settings.grounds_arguments,
            router=RoutingActivities(registry, redis, directory=directory,
                                     config=settings.routing, outage=outage,
                                     quotas=settings.tenants),
        )
        worker = Worker(
            client,
            task_queue=engine_task_queue(engine.id),
            activities=[inference.generate, inference.prewarm],
            # Interactive steps go straight to the engine, whose scheduler queues them;
            # batch steps wait here for admission, in its order. How many at once
            # follows the engine's capacity (step_slots.py).
            tuner=WorkerTuner.create_composite(
                workflow_supplier=FixedSizeSlotSupplier(1),
                activity_supplier=slots,
                local_activity_supplier=FixedSizeSlotSupplier(1),
                nexus_supplier=FixedSizeSlotSupplier(1)),
        )
        if admission.shared is not None and (left := await admission.shared.forget_predecessors()):
            log.info("batch_slots_of_predecessor_given_back", engine=engine.id, slots=left)
        log.info("inference_worker_started", task_queue=engine_task_queue(engine.id))
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(heartbeat_loop(registry, http, engine, settings.engine_heartbeat_s,
                                              view, admission, directory, holds, outage,
                                              calibration))
                tg.create_task(holds.run())
                tg.create_task(loop_lag_monitor())
                if engine.kv_events:
                    applier = KvEventApplier(directory, engine.id, regret=regret)
                    tg.create_task(kv_event_loop(engine.kv_events, applier, outage))
                tg.create_task(worker.run())
        finally:
            # the directory and hold records of steps already returned
            if cancelled := await inference.drain():
                log.warning("step_bookkeeping_cancelled", steps=cancelled)
            # Best effort: without Redis the engine's key expires by itself, and the
            # batch slots' leases end by themselves.
            await outage.attempt("leave the registry", lambda: registry.leave(engine.id),
                                 None, timeout_s=REDIS_SOCKET_TIMEOUT_S, probe=True)
            if admission.shared is not None:
                await admission.shared.clear()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--engine-id", required=True)
    args = parser.parse_args(argv)
    settings = Settings()
    configure_logging(settings.log_format, settings.log_level)
    try:
        # The worker assembles prompts from the profiles: it loads the same plugins.
        load_plugins(plugins=settings.plugins, profile_paths=settings.profile_paths,
                     toolsets=False)
    except PluginError as e:
        raise SystemExit(f"error: {e}") from None
    asyncio.run(run_inference_worker(settings, args.engine_id))


if __name__ == "__main__":
    main()
