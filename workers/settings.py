"""Settings, read from the environment (prefix ``WARMLOOP_``) once, at process start."""

from __future__ import annotations

from functools import cached_property
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from warmloop.workflows.holding import HoldConfig
from warmloop.workflows.lanes import AdmissionConfig
from warmloop.workflows.pricing import PER_TOKEN_FIELDS, EnginePrice
from warmloop.workflows.routing import RoutingConfig

KV_EVENTS_TOPIC = "kv-events"

# The embedded engines serve the tiny CPU model, priced as if each were a GPU at $0.80/h
# (an assumption, an L4-class card) at the throughput seen here: a 2,116-token prefix
# prefilled cold in ~100 ms (PLATFORM.md: ~20,000 tokens/s) and ~130 generated tokens/s
# per engine (vLLM's own log line during `make demo`).
EMBEDDED_ENGINE_PRICE = EnginePrice(gpu_usd_per_hour=0.80, prefill_tokens_per_s=20_000,
                                    decode_tokens_per_s=130)
_OLD_TTL_PRICE_DEFAULTS = {"input_usd_per_mtok": 3.0, "cached_input_usd_per_mtok": 0.3,
                           "output_usd_per_mtok": 15.0}


class EngineEndpoint(BaseModel):
    """One OpenAI-compatible vLLM server, the model it serves and what its tokens cost."""

    id: str = Field(pattern=r"^[A-Za-z0-9_-]{1,32}$", description="Engine id; its task queue "
                    "is engine.<id>.")
    url: str = Field(description="Base URL without /v1, e.g. http://10.0.0.5:8000.")
    model: str = Field(default="tiny", description="Served model name sent in requests.")
    kind: Literal["vllm", "ttl_cache"] = Field(
        default="vllm", description="vllm: a KV pool with an LRU (holds are kept by "
        "touches paced by churn). ttl_cache: a managed API whose prompt cache expires "
        "cache_ttl_s after last use (holds are keep-alive pings just before expiry).")
    cache_ttl_s: float = Field(default=300.0, gt=0, description="ttl_cache: prompt-cache TTL.")
    price: EnginePrice | None = Field(
        default=None, description="What the engine's tokens cost: self-hosted "
        '({"gpu_usd_per_hour": 2.0, "prefill_tokens_per_s": 15000, "decode_tokens_per_s": '
        '1500}) or per token ({"input_usd_per_mtok": 3, "cached_input_usd_per_mtok": 0.3, '
        '"output_usd_per_mtok": 15}). The engine\'s worker prices every step with it. '
        "None: steps cost an unknown amount, and jobs with a cost cap are not routed here. "
        "A ttl_cache engine needs a per-token price.")
    kv_events: str | None = Field(
        default=None, pattern=r"^tcp://[^*]+:[0-9]+$",
        description="ZMQ endpoint the engine publishes its KV events to (vLLM "
        "--kv-events-config); the inference worker binds it. None: the prefix directory "
        "estimates evictions from recency and capacity instead.")

    @model_validator(mode="before")
    @classmethod
    def _old_price_fields(cls, data: Any) -> Any:
        """Engines declared before "price" gave a ttl_cache engine's prices as top-level
        input_usd_per_mtok, cached_input_usd_per_mtok, output_usd_per_mtok (each with a
        default); they become its per-token price."""
        if not isinstance(data, dict) or not any(f in data for f in PER_TOKEN_FIELDS):
            return data
        if data.get("price") is not None:
            raise ValueError(f"give the price once, in \"price\" ({', '.join(PER_TOKEN_FIELDS)} "
                             "at the top level are the old spelling of a per-token price)")
        rest = {k: v for k, v in data.items() if k not in PER_TOKEN_FIELDS}
        rest["price"] = {f: data.get(f, _OLD_TTL_PRICE_DEFAULTS[f]) for f in PER_TOKEN_FIELDS}
        return rest

    @model_validator(mode="after")
    def _ttl_cache_priced_per_token(self) -> EngineEndpoint:
        if self.kind == "ttl_cache" and (self.price is None or self.price.kind != "per_token"):
            raise ValueError(
                f"engine {self.id}: a ttl_cache engine is billed per token and its holds are "
                'priced by it; add "price": {"input_usd_per_mtok": ..., '
                '"cached_input_usd_per_mtok": ..., "output_usd_per_mtok": ...}')
        return self


class Settings(BaseSettings):
    """Everything a warmloop process needs to find its peers.

    Defaults describe the embedded dev stack (``warmloop dev up``); point the same code
    at a real cluster by setting e.g. ``WARMLOOP_TEMPORAL_ADDRESS`` and
    ``WARMLOOP_ENGINES='[{"id": "gpu0", "url": "http://gpu0:8000", "model": "..."}]'``.
    """

    # "null" in a variable means None, so that a child process started with these
    # settings (warmloop.infra.stack.settings_env) sees an unset option as unset.
    model_config = SettingsConfigDict(env_prefix="WARMLOOP_", extra="ignore",
                                      env_parse_none_str="null")

    plugins: str = ""
    """Plugin modules to load, ``module[,module]`` (``WARMLOOP_PLUGINS``): each may define
    ``PROFILES`` and ``TOOLSETS``. Installed distributions' entry points
    (``warmloop.profiles``, ``warmloop.toolsets``) load without being named here."""
    profile_paths: str = ""
    """YAML profile files or folders to load, ``path[,path]``."""
    temporal_address: str = "127.0.0.1:7233"
    """host:port of the Temporal frontend."""
    temporal_namespace: str = "default"
    temporal_ui_port: int = Field(default=8233, ge=1, le=65535)
    """Web UI port of the embedded dev server."""
    redis_url: str = "redis://127.0.0.1:6390/0"
    """Engine registry and statistics."""
    s3_endpoint_url: str | None = "http://127.0.0.1:9010"
    """S3-compatible endpoint; None means AWS S3 itself."""
    s3_bucket: str = "warmloop"
    s3_region: str = "us-east-1"
    batch_input_dirs: str = ""
    """Where batch sources may be read: folders and ``s3://bucket[/prefix]``,
    ``entry[,entry]``. A source anywhere else (``/etc/passwd``, ``/dev/zero``, another
    bucket) ends its batch as SOURCE_REFUSED. Empty: the agent worker's working folder,
    the temporary folder and ``s3://<s3_bucket>``."""
    state_dir: Path = Path(".warmloop")
    """Pids, logs, the dev server's database and the built model live here."""
    model_path: Path | None = None
    """Model directory served by embedded engines; default: <state_dir>/models/tiny-llama."""
    engine_count: int = Field(default=2, ge=1, le=8)
    """How many embedded vLLM engines `warmloop dev up` starts."""
    engine_base_port: int = Field(default=8100, ge=1024, le=65000)
    engine_max_model_len: int = Field(default=32768, ge=512)
    engine_kv_cache_bytes: int | None = Field(default=None, ge=4 * 1024 * 1024)
    """Explicit KV pool per embedded engine (vLLM --kv-cache-memory-bytes); None: 1 GiB."""
    engine_kv_events_base_port: int | None = Field(default=5557, ge=1024, le=65000)
    """Embedded engine i publishes KV events to tcp://127.0.0.1:(this + i); None: off."""
    engine_compute_nice: int = Field(default=10, ge=0, le=19)
    """CPU niceness of each embedded engine's compute processes (vLLM's engine core and
    model worker; not its API server), which also run as SCHED_BATCH. On a shared CPU
    host they would otherwise take the cores from the API servers, the Temporal workers
    and the dev server whenever batch work runs, and interactive TTFT would follow the
    box's contention. 0 leaves them as started."""
    engines: list[EngineEndpoint] | None = None
    """External engines. When set, `dev up` starts no engines of its own."""
    engine_heartbeat_s: float = Field(default=1.0, gt=0)
    inference_max_steps: int = Field(default=64, ge=1, le=4096)
    """Steps one inference worker takes from its queue at once (the engine's scheduler
    queues interactive ones; batch ones wait in admission). The rest wait in Temporal's
    queue by task priority. Keep it well above the batch K, and high enough that a
    busy engine's steps are picked up within ``step_pickup_timeout_s``."""
    engine_ttl_s: float = Field(default=5.0, gt=0)
    """An engine whose heartbeat is older than this has left the fleet."""
    trace_prompt_chains: bool = False
    """Keep every served prompt's block chain in Redis (benchmarks compute the oracle
    hit rate from it); off in production, it grows without bound."""
    routing: RoutingConfig = Field(default_factory=RoutingConfig)
    """Weights of the routing score, e.g. WARMLOOP_ROUTING='{"max_load": 4}'."""
    holding: HoldConfig = Field(default_factory=HoldConfig)
    """Prices and limits of holding paused jobs' prefixes, e.g. WARMLOOP_HOLDING='{...}'."""
    admission: AdmissionConfig = Field(default_factory=AdmissionConfig)
    """Batch admission per engine, e.g. WARMLOOP_ADMISSION='{"k_max": 8}'."""
    agent_metrics_port: int | None = Field(default=9464, ge=1024, le=65535)
    """Prometheus /metrics of the agent worker (None: off)."""
    inference_metrics_base_port: int | None = Field(default=9470, ge=1024, le=65000)
    """Prometheus /metrics of inference worker i: this port + i (None: off)."""
    log_format: Literal["auto", "console", "json"] = "auto"
    log_level: str = "INFO"

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @property
    def manages_engines(self) -> bool:
        return self.engines is None

    @cached_property
    def engine_endpoints(self) -> list[EngineEndpoint]:
        if self.engines is not None:
            return self.engines
        return [
            EngineEndpoint(
                id=f"e{i}", url=f"http://127.0.0.1:{self.engine_base_port + i}",
                price=EMBEDDED_ENGINE_PRICE,
                kv_events=(None if self.engine_kv_events_base_port is None
                           else f"tcp://127.0.0.1:{self.engine_kv_events_base_port + i}"),
            )
            for i in range(self.engine_count)
        ]

    def inference_metrics_port(self, engine_id: str) -> int | None:
        if self.inference_metrics_base_port is None:
            return None
        ids = [e.id for e in self.engine_endpoints]
        return self.inference_metrics_base_port + ids.index(engine_id)

    def engine(self, engine_id: str) -> EngineEndpoint:
        for e in self.engine_endpoints:
            if e.id == engine_id:
                return e
        known = ", ".join(e.id for e in self.engine_endpoints)
        raise ValueError(f"unknown engine {engine_id!r}; configured engines: {known}")

    @property
    def resolved_model_path(self) -> Path:
        return self.model_path or self.state_dir / "models" / "tiny-llama"
