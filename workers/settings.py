"""Settings, read from the environment (prefix ``WARMLOOP_``) once, at process start."""

from __future__ import annotations

import base64
import binascii
import ipaddress
import re
from functools import cached_property
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

from pydantic import (
    BaseModel,
    Field,
    SecretStr,
    field_serializer,
    field_validator,
    model_validator,
)
from pydantic_settings import BaseSettings, SettingsConfigDict

from warmloop.workers.gateway.config import GatewayConfig
from warmloop.workflows.calibration import PRESETS, EngineCalibration, preset
from warmloop.workflows.holding import HoldConfig
from warmloop.workflows.lanes import AdmissionConfig
from warmloop.workflows.pricing import PER_TOKEN_FIELDS, EnginePrice
from warmloop.workflows.routing import RoutingConfig
from warmloop.workflows.tenants import TenantName, TenantQuota

KV_EVENTS_TOPIC = "kv-events"

# The embedded engines serve the tiny CPU model. They declare no price: each is priced
# by its calibration (`warmloop calibrate`), the ``cpu-tiny`` preset until measured,
# whose price this is: a GPU at $0.80/h (an assumption, an L4-class card) over the
# throughput seen here.
EMBEDDED_ENGINE_PRICE = preset("cpu-tiny").engine_price()
_OLD_TTL_PRICE_DEFAULTS = {"input_usd_per_mtok": 3.0, "cached_input_usd_per_mtok": 0.3,
                           "output_usd_per_mtok": 15.0}


_KV_EVENTS_ENDPOINT = re.compile(r"^tcp://(?P<host>[^:/\[\]]+):(?P<port>[0-9]{1,5})$")
_SHA256_HEX = re.compile(r"[0-9a-f]{64}")
"""A gateway key's digest, lowercased (how the settings name keys)."""


def check_kv_events_endpoint(endpoint: str) -> str:
    """``endpoint`` if the inference worker may bind it for an engine's KV events, else
    ValueError saying why.

    The hazard: the worker's SUB socket takes whatever reaches it, and what reaches it
    goes into the prefix directory that routes every job. Bound to ``*`` or 0.0.0.0 it
    listens on every interface of the host, so anyone on the network who can reach
    the port can publish forged KV events (poisoning routing) or fill the worker's
    queue. So the address must name one interface: loopback for an engine on the same
    host, else the interface the engine reaches the worker on. Refused:

    - ``*`` and unspecified addresses (0.0.0.0, ``0``): every interface;
    - IPv6 (``[...]``): vLLM's publisher binds, rather than connects to, any endpoint
      containing ``::`` (both sides would bind and no event would flow), and the
      worker's socket is IPv4 only;
    - any scheme but tcp (``ipc://``, ``inproc://``: vLLM binds those too).

    A host name or an interface name (``eth0``) is accepted; ZMQ binds the address it
    names, and the engine must reach the same address."""
    m = _KV_EVENTS_ENDPOINT.match(endpoint)
    if m is None:
        raise ValueError(
            f"kv_events {endpoint!r}: give tcp://<address>:<port> with an IPv4 address, "
            "a host name or an interface name (IPv6 and ipc:// endpoints make vLLM bind "
            "instead of connecting to the worker)")
    host, port = m["host"], int(m["port"])
    if not 1 <= port <= 65535:
        raise ValueError(f"kv_events {endpoint!r}: port {port} is not in 1-65535")
    if "*" in host:
        raise ValueError(f"kv_events {endpoint!r}: a wildcard would bind every interface; "
                         "give loopback (127.0.0.1) or one interface of the worker's host")
    if re.fullmatch(r"[0-9.]+", host):
        try:
            address = ipaddress.IPv4Address(host)
        except ValueError:
            raise ValueError(f"kv_events {endpoint!r}: {host} is not a dotted IPv4 "
                             "address") from None
        if address.is_unspecified or address.is_multicast:
            raise ValueError(
                f"kv_events {endpoint!r}: {host} would bind every interface (or none); give "
                "loopback (127.0.0.1) or one interface of the worker's host")
    return endpoint


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
    calibration: str | None = Field(
        default=None, description="The calibration preset (warmloop.workflows.calibration."
        "PRESETS) this engine is priced, held and routed by until `warmloop calibrate` "
        "measures it. None: Settings.engine_calibration.")
    kv_events: str | None = Field(
        default=None,
        description="ZMQ endpoint the engine publishes its KV events to (vLLM "
        "--kv-events-config), tcp://<address>:<port>; the inference worker binds it, the "
        "engine connects to it. The address is loopback (the engine on the worker's host) "
        "or one interface of the worker's host (an IPv4 address, a host name or an "
        "interface name), never a wildcard: see check_kv_events_endpoint. None: the prefix "
        "directory estimates evictions from recency and capacity instead.")

    @field_validator("calibration")
    @classmethod
    def _known_preset(cls, v: str | None) -> str | None:
        return v if v is None else _preset_name(v)

    @field_validator("kv_events")
    @classmethod
    def _kv_events_not_wildcard(cls, v: str | None) -> str | None:
        return None if v is None else check_kv_events_endpoint(v)

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
    # Errors leave the input out: a model-level check's error would otherwise quote every
    # setting given, secrets included (API key, passwords, payload key), and the CLI
    # prints it.
    model_config = SettingsConfigDict(env_prefix="WARMLOOP_", extra="ignore",
                                      env_parse_none_str="null", hide_input_in_errors=True)

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
    """Model directory served by embedded engines; default: per ``engine_model``."""
    engine_model: Literal["tiny", "demo", "demo-gpu"] = "tiny"
    """What embedded engines serve when ``model_path`` is unset: ``tiny``, the
    random-weight model built at ``dev up`` into <state_dir>/models/tiny-llama (caching
    and routing work; its decisions are chance); ``demo``, the small model trained on 2
    CPU cores to run the bundled agents (``make model``), shipped in
    ``infra/demo_model/artifact``; or ``demo-gpu``, the same model trained 24 times
    longer on a lent GPU (``bench/demo_model_gpu.py``), shipped in
    ``infra/demo_model/artifact-gpu`` (``make demo``'s default)."""
    grounded_arguments: bool | None = None
    """Id arguments (patterned strings, such as ``customer_id``) may only name values the
    job's task, calls and tool results contain: guided decoding lists them
    (``activities/grounding.py``). A small model's ids are right even when it copies
    badly; a tool result that mentions an id makes it callable. Profiles with tools on
    demand keep their own constraint, ungrounded. None: on when the engines serve the
    demo model (``engine_model: demo``), off otherwise."""
    engine_count: int = Field(default=2, ge=1, le=8)
    """How many embedded vLLM engines `warmloop dev up` starts."""
    engine_models: list[str] | None = None
    """The served model name of each embedded engine, in order (one per engine): a pool
    per model, as a model ladder needs (``Profile.ladder``). A name in ``model_paths``
    is served from that directory; any other from the default (``engine_model``).
    None: every engine serves the default as ``tiny``."""
    model_paths: dict[str, Path] = Field(default_factory=dict)
    """Model directories by served name, for ``engine_models``."""
    engine_base_port: int = Field(default=8100, ge=1024, le=65000)
    engine_max_model_len: int = Field(default=32768, ge=512)
    engine_calibration: str = Field(
        default="cpu-tiny", description="The calibration preset of engines that name none "
        "and are not measured yet (`warmloop calibrate ENGINE` replaces it with the "
        "engine's own figures). One of warmloop.workflows.calibration.PRESETS.")
    engine_kv_cache_bytes: int | None = Field(default=None, ge=4 * 1024 * 1024)
    """Explicit KV pool per embedded engine (vLLM --kv-cache-memory-bytes) at bfloat16's
    2 bytes a value; an engine computing in float32 (``engine_dtype``) gets twice the
    bytes, so every engine's pool holds the same tokens. None: vLLM's 1 GiB CPU KV space,
    whatever the dtype (half the tokens in float32)."""
    engine_dtype: Literal["auto", "bfloat16", "float32"] = "auto"
    """What the embedded engines compute in. ``auto``: bfloat16 on a CPU with native
    bfloat16 arithmetic (AVX512-BF16 or AMX; Arm's BF16), float32 elsewhere. On a CPU
    without it (an AVX2-only host) PyTorch emulates bfloat16 and a matmul runs ~50x
    slower than in float32: prefill fell from 13-25k to ~2k tokens/s, which changed
    every benchmark's regime and slowed the tests."""
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
    timer_check: bool = True
    """The agent worker times one short Temporal timer at start and warns
    (``temporal_timers_late``) when the server fires it late (``workers.timer_check``)."""
    inference_max_steps: int = Field(default=1024, ge=1, le=4096)
    """Steps one inference worker takes from its queue at once, at most. Within
    [``inference_min_steps``, this] the count follows the engine's capacity
    (``warmloop.workers.step_slots``): what it runs at once (calibrated ``max_batch``,
    typical prompts its KV pool fits) times 1 + ``inference_queue_share``, plus the
    batch steps admission holds. The rest wait in Temporal's queue by task priority."""
    inference_min_steps: int = Field(default=16, ge=1, le=4096)
    """Steps a worker takes at once at least (and before its engine's first heartbeat).
    Keep it high enough that a busy engine's steps are picked up within
    ``step_pickup_timeout_s``, or they fail over as if the engine were dead."""
    inference_queue_share: float = Field(default=1.0, ge=0, le=16)
    """Steps taken beyond what the engine runs at once, as a share of that: they wait
    in the engine's own queue, ready the moment a sequence finishes."""
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

    tenants: dict[TenantName, TenantQuota] = Field(default_factory=dict)
    """Tenants' quotas, e.g. WARMLOOP_TENANTS='{"acme": {"max_jobs_in_flight": 20,
    "tokens_per_hour": 2000000}}': jobs in flight checked at submit, tokens per clock hour
    at submit and before each step (warmloop.workflows.tenants). A tenant not named here
    has no quota; every tenant's requests carry its own cache_salt either way."""

    # ---- approvers' identity (issue 15) ------------------------------------------------
    auth_token_file: Path | None = None
    """Local tokens (subject and roles per token, stored as SHA-256) for the embedded
    stack; default <state_dir>/auth/tokens.json when it exists (``warmloop dev up``
    writes it). Ignored when ``oidc_issuer`` is set."""
    oidc_issuer: str | None = None
    """Verify approvers' bearer tokens as JWTs from this issuer (``iss``)."""
    oidc_audience: str | None = None
    """The ``aud`` the JWTs must carry; required with ``oidc_issuer``."""
    oidc_jwks_url: str | None = None
    """Where the issuer's signing keys are; default <issuer>/.well-known/jwks.json."""
    oidc_roles_claim: str = "roles"
    """The JWT claim that lists the approver's roles."""
    oidc_tenants_claim: str = "tenants"
    """The JWT claim that lists the tenants whose approvals the approver may see and
    decide."""
    oidc_all_tenants_role: str | None = None
    """Only tokens with this role see every tenant; a token without the tenants claim
    and without this role sees none. None (the default): a token without the claim sees
    every tenant, as a single-tenant deployment wants. Set it in a multi-tenant one."""
    oidc_client_id: str | None = None
    """The inbox's client id at ``oidc_issuer``: with it the sign-in page offers a sign-in
    at the identity provider (OpenID Connect's authorization code flow with PKCE)
    beside the pasted token, and the ID token the issuer returns for this client is
    the session's (verified again on every request, so its expiry ends the session)."""
    oidc_client_secret: SecretStr | None = None
    """The client's secret for a confidential client (sent to the token endpoint as
    ``client_secret_post``); None: a public client, PKCE alone."""
    inbox_url: str | None = None
    """The inbox's URL as browsers reach it (behind a proxy, its public https URL); the
    identity provider sends people back to ``<inbox_url>/signin/callback``, which must be
    registered for the client. None: the URL the sign-in request arrived on."""
    approval_signing_key: Path | None = None
    """Ed25519 private key (PEM) the approvals service signs decision assertions with;
    default <state_dir>/auth/approval-signing.pem. Only the approvals service (inbox,
    ``warmloop ui``) needs it; workers hold the public half."""
    approval_verify_keys: str = ""
    """Public keys (PEM files, comma separated) the agent worker accepts assertions
    from; default <state_dir>/auth/approval-verify.pem. Several allow key rotation."""
    approval_assertion_ttl_s: float = Field(default=120.0, gt=0, le=3600)
    """How long a signed decision stays valid: a captured one cannot be replayed later."""
    approvals_url: str = "http://127.0.0.1:8300"
    """The approvals service (web inbox and its API) that the CLI's approval commands call."""
    inbox_port: int = Field(default=8300, ge=1024, le=65535)
    """Port of the web inbox the embedded stack runs (``warmloop ui`` serves it)."""
    inbox_session_key: SecretStr | None = None
    """AES-256 key (base64 of 32 random bytes) sealing the inbox's session cookies. Give
    every replica the same one, and keep it across restarts, or a restart (or another
    replica) signs everyone out. None: a random key per start."""
    gateway_port: int = Field(default=8500, ge=1024, le=65535)
    """Port of the OpenAI-compatible gateway (``warmloop gateway``; the embedded stack's
    ``gateway`` part)."""
    gateway_url: str | None = None
    """Where clients reach the gateway (``http://gateway.internal:8500``, no ``/v1``);
    None: ``http://127.0.0.1:<gateway_port>``, the embedded stack's."""
    gateway_key_digests: str | None = None
    """Comma-separated SHA-256 hex digests of the API keys the gateway accepts
    (``printf %s "$KEY" | sha256sum``): set, every /v1 call must carry one of those keys
    as ``Authorization: Bearer``, else 401; unset, the gateway takes any caller (the
    embedded stack's, on loopback). Digests, so the settings hold no key."""
    gateway_key_tenants: dict[str, TenantName] = Field(default_factory=dict)
    """Gateway API keys that are a tenant's, by SHA-256 hex digest, e.g.
    WARMLOOP_GATEWAY_KEY_TENANTS='{"<digest>": "acme"}': their calls carry the tenant's
    ``cache_salt`` (they share its jobs' cache, no other tenant's), its ``tokens_per_hour``
    is checked before each call (429 once spent) and the tokens a call's answer reports
    go onto its hour (a stream's too: the gateway asks the engine for its usage and
    keeps that event from a client that did not ask). A key not named here keeps a salt
    of its own and no tenant's quota."""
    gateway: GatewayConfig = Field(default_factory=GatewayConfig)
    """The gateway's own knobs, e.g. WARMLOOP_GATEWAY='{"hold_policy": "always_hold"}'
    (its routing, holding and admission weights are ``routing``, ``holding``,
    ``admission``)."""
    token: SecretStr | None = None
    """The CLI user's bearer token (``WARMLOOP_TOKEN`` or ``warmloop login``)."""

    # ---- secured connections (issue 15) ------------------------------------------------
    # Secrets are SecretStr: masked in repr, logs and tracebacks. settings_env hands them
    # to child processes in clear (see _secrets_in_clear_for_children).
    temporal_tls: bool | None = None
    """TLS to the Temporal frontend. None: on when an API key (Temporal Cloud's
    convention), a client certificate, a server CA or a server name is set, else off.
    True: on, verifying the server against the system roots unless
    ``temporal_tls_server_ca`` is set. False: off, even with an API key (the key then
    crosses the network in clear: only for a TLS-terminating proxy on loopback);
    refused with certificate settings."""
    temporal_tls_client_cert: Path | None = None
    """mTLS client certificate (PEM); give ``temporal_tls_client_key`` with it."""
    temporal_tls_client_key: Path | None = None
    """mTLS client private key (PEM) of ``temporal_tls_client_cert``."""
    temporal_tls_server_ca: Path | None = None
    """CA (PEM) the Temporal server's certificate must chain to; None: system roots."""
    temporal_tls_server_name: str | None = None
    """Name sent as SNI and checked against the server's certificate, when it differs
    from the host in ``temporal_address``."""
    temporal_api_key: SecretStr | None = None
    """Temporal Cloud API key, sent as ``Authorization: Bearer``; turns TLS on unless
    ``temporal_tls`` is false."""
    redis_password: SecretStr | None = None
    """Redis AUTH password (with the user in the URL, ``redis://user@host``, for an ACL
    user). Give it here or in ``redis_url``, not both."""
    redis_tls_ca: Path | None = None
    """CA (PEM) the Redis server's certificate must chain to; None: system roots. Needs a
    ``rediss://`` URL (the scheme is what turns TLS on)."""
    redis_tls_client_cert: Path | None = None
    """Client certificate (PEM) for Redis mutual TLS; with ``redis_tls_client_key``."""
    redis_tls_client_key: Path | None = None
    """Private key (PEM) of ``redis_tls_client_cert``."""
    s3_access_key_id: str | None = None
    """Explicit S3 credentials, with ``s3_secret_access_key``. None: boto3's standard chain
    (AWS_* variables, ~/.aws, container and instance roles); placeholder keys only for a
    loopback endpoint (the embedded S3 server) when the chain finds nothing."""
    s3_secret_access_key: SecretStr | None = None
    """Secret of ``s3_access_key_id``."""
    payload_key: SecretStr | None = None
    """AES-256 key (base64 of 32 random bytes) that encrypts workflow payloads (inputs,
    results, signals, activity arguments) before they reach Temporal. Every worker and
    client of the namespace needs it; a process without it cannot read the jobs. None:
    payloads are stored in clear. Make one with ``python -c "import base64, os;
    print(base64.b64encode(os.urandom(32)).decode())"``."""
    payload_key_id: str = Field(default="k1", pattern=r"^[A-Za-z0-9._-]{1,64}$")
    """Id of ``payload_key``, stored beside each payload so the key can be rotated."""
    payload_old_keys: SecretStr | None = None
    """Retired payload keys still needed to read older histories, ``id:base64[,id:base64]``.
    Rotate by moving the current key here and setting a new ``payload_key`` and
    ``payload_key_id``; drop an old key only when no open history uses it."""

    @field_validator("gateway_key_digests")
    @classmethod
    def _digests(cls, v: str | None) -> str | None:
        if v is None:
            return None
        digests = [d.strip().lower() for d in v.split(",") if d.strip()]
        bad = [d for d in digests if not _SHA256_HEX.fullmatch(d)]
        if bad or not digests:
            raise ValueError("gateway_key_digests: give SHA-256 hex digests (64 hex digits "
                             "each, comma-separated) of the accepted keys, not the keys")
        return ",".join(digests)

    @field_validator("gateway_key_tenants")
    @classmethod
    def _key_tenants(cls, v: dict[str, str]) -> dict[str, str]:
        lowered = {k.lower(): t for k, t in v.items()}
        if any(not _SHA256_HEX.fullmatch(k) for k in lowered):
            raise ValueError("gateway_key_tenants: name each key by its SHA-256 hex digest "
                             "(64 hex digits: printf %s \"$KEY\" | sha256sum), not the key")
        return lowered

    @field_validator("engine_calibration")
    @classmethod
    def _known_calibration(cls, v: str) -> str:
        return _preset_name(v)

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, v: Path) -> Path:
        return v.expanduser().resolve()

    @field_validator("temporal_tls_client_cert", "temporal_tls_client_key",
                     "temporal_tls_server_ca", "redis_tls_ca", "redis_tls_client_cert",
                     "redis_tls_client_key")
    @classmethod
    def _absolute_file(cls, v: Path | None) -> Path | None:
        # Absolute, so that a child process started elsewhere reads the same file.
        return None if v is None else v.expanduser().resolve()

    @field_serializer("temporal_api_key", "redis_password", "s3_secret_access_key",
                      "payload_key", "payload_old_keys", "oidc_client_secret",
                      "inbox_session_key", when_used="json")
    def _secrets_in_clear_for_children(self, v: SecretStr | None) -> str | None:
        """JSON dumps carry secrets in clear: ``settings_env`` (infra/stack.py) passes a
        child process its settings as ``model_dump(mode="json")``, and a masked
        ``**********`` there would be every child's password. Hazard: never log a JSON
        dump of the settings; ``repr`` and ``model_dump()`` stay masked."""
        return None if v is None else v.get_secret_value()

    @model_validator(mode="after")
    def _engine_models_one_per_engine(self) -> Settings:
        if self.engine_models is None:
            return self
        if len(self.engine_models) != self.engine_count:
            raise ValueError(
                f"engine_models names {len(self.engine_models)} models for "
                f"{self.engine_count} engines; give one per engine or set "
                "WARMLOOP_ENGINE_COUNT to match")
        bad = [m for m in self.engine_models if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", m)]
        if bad:
            raise ValueError(f"engine_models: {bad} are not model names (letters, digits, "
                             "'.', '_', '-')")
        return self

    def engine_model_path(self, engine: EngineEndpoint) -> Path:
        """The directory an embedded engine serves."""
        return self.model_paths.get(engine.model, self.resolved_model_path)

    @model_validator(mode="after")
    def _step_slot_bounds(self) -> Settings:
        if self.inference_min_steps > self.inference_max_steps:
            raise ValueError(
                f"inference_min_steps {self.inference_min_steps} is above inference_max_steps "
                f"{self.inference_max_steps}; lower WARMLOOP_INFERENCE_MIN_STEPS or raise "
                "WARMLOOP_INFERENCE_MAX_STEPS")
        return self

    @model_validator(mode="after")
    def _secured_connections(self) -> Settings:
        """Half-given or contradictory connection security is refused at start, with
        the setting to change, rather than found as a failed handshake later."""
        _both_or_neither("temporal_tls_client_cert", self.temporal_tls_client_cert,
                         "temporal_tls_client_key", self.temporal_tls_client_key,
                         "an mTLS client certificate needs its private key and the reverse")
        if self.temporal_tls is False:
            given = [n for n in ("temporal_tls_client_cert", "temporal_tls_client_key",
                                 "temporal_tls_server_ca", "temporal_tls_server_name")
                     if getattr(self, n) is not None]
            if given:
                raise ValueError(f"temporal_tls is false but {', '.join(given)} "
                                 "configure TLS; unset them or temporal_tls")
        _both_or_neither("redis_tls_client_cert", self.redis_tls_client_cert,
                         "redis_tls_client_key", self.redis_tls_client_key,
                         "a Redis client certificate needs its private key and the reverse")
        url = urlsplit(self.redis_url)
        if self.redis_password is not None and url.password:
            raise ValueError("the Redis password is given twice, in redis_url and in "
                             "redis_password (the URL's would win); keep one")
        tls_files = [n for n in ("redis_tls_ca", "redis_tls_client_cert",
                                 "redis_tls_client_key") if getattr(self, n) is not None]
        if tls_files and url.scheme != "rediss":
            raise ValueError(f"{', '.join(tls_files)} need TLS: use a rediss:// redis_url "
                             f"(it is {url.scheme}://)")
        _both_or_neither("s3_access_key_id", self.s3_access_key_id,
                         "s3_secret_access_key", self.s3_secret_access_key,
                         "explicit S3 credentials are a pair; set neither to use the "
                         "standard AWS chain")
        if self.payload_key is not None:
            decode_payload_key("payload_key", self.payload_key.get_secret_value())
        if self.inbox_session_key is not None:
            decode_payload_key("inbox_session_key", self.inbox_session_key.get_secret_value())
        old = self.payload_old_key_ring()
        if old and self.payload_key is None:
            raise ValueError("payload_old_keys without payload_key: set the current key too "
                             "(old keys only decrypt; new payloads are encrypted with "
                             "payload_key)")
        if self.payload_key_id in old:
            raise ValueError(f"payload key id {self.payload_key_id!r} is both the current "
                             "key and an old one; give the new key a new id")
        return self

    def payload_old_key_ring(self) -> dict[str, bytes]:
        """``payload_old_keys`` as {key id: key}."""
        if self.payload_old_keys is None:
            return {}
        ring: dict[str, bytes] = {}
        for entry in self.payload_old_keys.get_secret_value().split(","):
            if not entry.strip():
                continue
            key_id, sep, b64 = entry.strip().partition(":")
            if not sep or not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", key_id):
                raise ValueError("payload_old_keys: each entry is id:base64 with an id of "
                                 "letters, digits, '.', '_' or '-'")
            if key_id in ring:
                raise ValueError(f"payload_old_keys: key id {key_id!r} is given twice")
            ring[key_id] = decode_payload_key(f"payload_old_keys[{key_id}]", b64)
        return ring

    @property
    def grounds_arguments(self) -> bool:
        """``grounded_arguments`` with its default resolved."""
        if self.grounded_arguments is not None:
            return self.grounded_arguments
        return self.serves_demo_model

    @property
    def serves_demo_model(self) -> bool:
        """The embedded engines serve one of the shipped trained demo models."""
        return self.model_path is None and self.engine_model in ("demo", "demo-gpu")

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
                **({} if self.engine_models is None else {"model": self.engine_models[i]}),
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

    def engine_calibration_base(self, engine: EngineEndpoint) -> EngineCalibration:
        """What describes ``engine`` until it is measured: its preset, with the
        throughput and GPU hour of the self-hosted price it declares, if it does (the
        default preset is a tiny model on a CPU: a GPU engine declaring its price must
        not be priced, routed and held by that)."""
        base = preset(engine.calibration or self.engine_calibration)
        return base if engine.price is None else base.as_declared(engine.price)

    def engine(self, engine_id: str) -> EngineEndpoint:
        for e in self.engine_endpoints:
            if e.id == engine_id:
                return e
        known = ", ".join(e.id for e in self.engine_endpoints)
        raise ValueError(f"unknown engine {engine_id!r}; configured engines: {known}")

    @property
    def resolved_model_path(self) -> Path:
        if self.model_path is not None:
            return self.model_path
        if self.engine_model == "demo":
            from warmloop.infra.demo_model import ARTIFACT_DIR

            return ARTIFACT_DIR
        if self.engine_model == "demo-gpu":
            from warmloop.infra.demo_model import GPU_ARTIFACT_DIR

            return GPU_ARTIFACT_DIR
        return self.state_dir / "models" / "tiny-llama"


def _preset_name(name: str) -> str:
    if name not in PRESETS:
        raise ValueError(f"unknown calibration preset {name!r}; known: "
                         f"{', '.join(sorted(PRESETS))}")
    return name


def _both_or_neither(a: str, va: object, b: str, vb: object, why: str) -> None:
    if (va is None) != (vb is None):
        given, missing = (a, b) if vb is None else (b, a)
        raise ValueError(f"{given} is set but {missing} is not: {why}")


PAYLOAD_KEY_BYTES = 32


def decode_payload_key(name: str, b64: str) -> bytes:
    """The key that ``b64`` encodes; ValueError naming ``name`` (never the value)."""
    try:
        key = base64.b64decode(b64.strip(), validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{name} is not base64; make a key with python -c \"import base64, "
                         "os; print(base64.b64encode(os.urandom(32)).decode())\"") from None
    if len(key) != PAYLOAD_KEY_BYTES:
        raise ValueError(f"{name} decodes to {len(key)} bytes; an AES-256 key is "
                         f"{PAYLOAD_KEY_BYTES}")
    return key
