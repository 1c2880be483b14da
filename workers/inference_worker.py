"""The inference worker beside one engine: serves ``generate`` on ``engine.<id>`` and
heartbeats the engine's health and load into the registry."""

from __future__ import annotations

import argparse
import asyncio
import time

import httpx
import msgpack
import structlog
import zmq
import zmq.asyncio
from temporalio import activity
from temporalio.worker import Worker

from warmloop.activities.admission import BatchAdmission
from warmloop.activities.cachebust import CacheBust, CacheBustDetector
from warmloop.activities.directory import KvEventApplier, PrefixDirectory
from warmloop.activities.holds import HoldManager
from warmloop.activities.inference import InferenceActivities
from warmloop.activities.pauses import PauseStats
from warmloop.activities.registry import (
    EngineHeartbeat,
    EngineRegistry,
    parse_cache_config,
    parse_vllm_metrics,
)
from warmloop.activities.trace_prompts import TracePromptStore
from warmloop.activities.transcripts import TranscriptStore
from warmloop.workers.clients import build_redis, build_s3, connect, use_io_threads
from warmloop.workers.logging import configure_logging
from warmloop.workers.plugins import PluginError, load_plugins
from warmloop.workers.settings import KV_EVENTS_TOPIC, EngineEndpoint, Settings
from warmloop.workflows.contracts import engine_task_queue
from warmloop.workflows.holding import TtlCacheEndpoint

log = structlog.get_logger(__name__)


async def probe_engine(http: httpx.AsyncClient, engine: EngineEndpoint) -> EngineHeartbeat:
    base = engine.url.rstrip("/")
    healthy, metrics, block_size, capacity = False, {}, 0, 0
    try:
        healthy = (await http.get(f"{base}/health", timeout=2.0)).status_code == 200
        if healthy:
            text = (await http.get(f"{base}/metrics", timeout=2.0)).text
            metrics = parse_vllm_metrics(text)
            block_size, capacity = parse_cache_config(text)
    except httpx.HTTPError:
        healthy = False
    return EngineHeartbeat(
        engine_id=engine.id, task_queue=engine_task_queue(engine.id), model=engine.model,
        url=engine.url, healthy=healthy,
        running=int(metrics.get("vllm:num_requests_running", 0)),
        waiting=int(metrics.get("vllm:num_requests_waiting", 0)),
        kv_usage=metrics.get("vllm:kv_cache_usage_perc", 0.0), at=time.time(),
        block_size=block_size or 16, kv_capacity_tokens=capacity,
        prefill_computed_total=(metrics.get("vllm:prefix_cache_queries_total", 0.0)
                                - metrics.get("vllm:prefix_cache_hits_total", 0.0)),
        precise=engine.kv_events is not None, priced=engine.price is not None,
    )


class EngineView:
    """The worker's latest view of its engine, shared by the heartbeat and activities."""

    def __init__(self) -> None:
        self.last: EngineHeartbeat | None = None

    def __call__(self) -> EngineHeartbeat | None:
        return self.last


async def heartbeat_loop(registry: EngineRegistry, http: httpx.AsyncClient,
                         engine: EngineEndpoint, interval_s: float,
                         view: EngineView | None = None,
                         admission: BatchAdmission | None = None,
                         directory: PrefixDirectory | None = None,
                         holds: HoldManager | None = None) -> None:
    was_healthy: bool | None = None
    while True:
        hb = await probe_engine(http, engine)
        if holds is not None:
            hb.held_tokens = holds.held_tokens
            if hb.healthy:
                holds.observe_engine(hb.prefill_computed_total)
        if admission is not None:
            hb.batch_limit, hb.batch_active = admission.effective_limit, admission.active
            hb.batch_waiting = admission.waiting
            hb.interactive_ttft_p95_ms = admission.recent_interactive_p95_ms()
        if view is not None:
            view.last = hb
        if hb.healthy:
            await registry.heartbeat(hb)
            if admission is not None and admission.config.fleet_signal:
                admission.observe_fleet([
                    e.interactive_ttft_p95_ms for e in await registry.live()
                    if e.engine_id != engine.id and e.interactive_ttft_p95_ms is not None])
        else:
            await registry.leave(engine.id)  # never route to an engine that fails /health
        if hb.healthy != was_healthy:
            log.info("engine_health", engine=engine.id, healthy=hb.healthy)
            if hb.healthy and directory is not None:
                # A (re)started engine holds nothing: forget what the directory believed.
                await directory.clear_engine(engine.id)
            was_healthy = hb.healthy
        await asyncio.sleep(interval_s)


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


async def kv_event_loop(endpoint: str, applier: KvEventApplier) -> None:
    """Follow the engine's KV events into the prefix directory (precise mode).

    The engine connects to this endpoint; the worker binds it, so the engine need not
    know whether anyone listens. Events lost while the worker was down only make the
    directory stale until the blocks are touched again."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.SUB)
    sock.bind(endpoint)
    sock.setsockopt(zmq.SUBSCRIBE, KV_EVENTS_TOPIC.encode())
    log.info("kv_events_listening", endpoint=endpoint)
    try:
        while True:
            frames = await sock.recv_multipart()
            try:
                batch = msgpack.unpackb(frames[-1], raw=False, strict_map_key=False)
                events = batch[1] if isinstance(batch, (list, tuple)) else []
                await applier.apply(list(events))
            except (ValueError, TypeError, IndexError, KeyError) as e:
                log.warning("kv_event_unreadable", error=str(e))
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
    registry = EngineRegistry(redis, ttl_s=settings.engine_ttl_s)
    limits = httpx.Limits(max_connections=settings.inference_max_steps,
                          max_keepalive_connections=64)
    # A stream that sends nothing for 30 s is treated as lost: the activity fails and
    # Temporal retries it, instead of a step hanging until start_to_close.
    async with httpx.AsyncClient(timeout=httpx.Timeout(30.0, connect=5.0),
                                 limits=limits) as http:
        directory = PrefixDirectory(redis, trace=settings.trace_prompt_chains)
        view = EngineView()
        def on_bust(b: CacheBust) -> None:
            activity.metric_meter().create_counter(
                "warmloop_cache_busts", "prompt prefixes that changed where they should not"
            ).add(1, {"profile": b.profile, "kind": b.kind})

        admission = BatchAdmission(
            settings.admission,
            kv_capacity_tokens=lambda: view.last.kv_capacity_tokens if view.last else 0)
        holds = HoldManager(engine_id=engine.id, base_url=engine.url, model=engine.model,
                            http=http, redis=redis, pauses=PauseStats(redis), engine_info=view,
                            config=settings.holding, directory=directory,
                            ttl_cache=_ttl_cache(engine))
        inference = InferenceActivities(
            engine_id=engine.id, base_url=engine.url, model=engine.model, http=http,
            price=engine.price,
            transcripts=TranscriptStore(build_s3(settings), settings.s3_bucket),
            trace_prompts=TracePromptStore(build_s3(settings), settings.s3_bucket),
            directory=directory, registry=registry,
            detector=CacheBustDetector(redis, directory, on_bust=on_bust),
            engine_info=view, admission=admission, holds=holds,
        )
        worker = Worker(
            client,
            task_queue=engine_task_queue(engine.id),
            activities=[inference.generate, inference.prewarm],
            # Interactive steps go straight to the engine, whose scheduler queues them;
            # batch steps wait here for admission, in its order.
            max_concurrent_activities=settings.inference_max_steps,
        )
        log.info("inference_worker_started", task_queue=engine_task_queue(engine.id))
        try:
            async with asyncio.TaskGroup() as tg:
                tg.create_task(heartbeat_loop(registry, http, engine, settings.engine_heartbeat_s,
                                              view, admission, directory, holds))
                tg.create_task(holds.run())
                tg.create_task(loop_lag_monitor())
                if engine.kv_events:
                    tg.create_task(kv_event_loop(engine.kv_events,
                                                 KvEventApplier(directory, engine.id)))
                tg.create_task(worker.run())
        finally:
            await registry.leave(engine.id)


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
