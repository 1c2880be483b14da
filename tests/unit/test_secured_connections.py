"""Secured connections (issue 15, part 3): Temporal TLS / API key, Redis AUTH and TLS,
S3 credentials from the AWS chain only, the KV-events socket on one interface, and
secrets that survive the hand-over to child processes. A real password-protected
redis-server proves AUTH; the rest inspects what the clients are built with."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from pydantic import ValidationError
from redis.asyncio.connection import SSLConnection
from redis.exceptions import AuthenticationError
from temporalio.client import Client, TLSConfig
from temporalio.contrib.pydantic import pydantic_data_converter
from temporalio.converter import DefaultFailureConverterWithEncodedAttributes

from tests.unit.engine_fakes import free_port
from warmloop.activities.registry import EngineHeartbeat, EngineRegistry
from warmloop.infra.stack import Stack, find_redis_server, settings_env
from warmloop.workers import clients
from warmloop.workers.clients import (
    PLACEHOLDER_S3_KEY,
    SecureConnectionError,
    StackNotRunningError,
    build_redis,
    build_s3,
    connect,
    redis_options,
)
from warmloop.workers.codec import EncryptionCodec
from warmloop.workers.fleet import fleet_offers
from warmloop.workers.settings import EngineEndpoint, Settings, check_kv_events_endpoint

KEY = "MDEyMzQ1Njc4OWFiY2RlZjAxMjM0NTY3ODlhYmNkZWY="  # base64 of 32 bytes
OLD_KEY = "ZmVkY2JhOTg3NjU0MzIxMGZlZGNiYTk4NzY1NDMyMTA="
SECRET = "hunter2-not-for-logs"

# ---- settings: refused at start, with the setting to change --------------------------


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"temporal_tls_client_cert": "/c.pem"},
         "temporal_tls_client_cert is set but temporal_tls_client_key is not"),
        ({"temporal_tls_client_key": "/k.pem"},
         "temporal_tls_client_key is set but temporal_tls_client_cert is not"),
        ({"temporal_tls": False, "temporal_tls_server_ca": "/ca.pem"},
         "temporal_tls is false but temporal_tls_server_ca configure TLS"),
        ({"redis_url": "redis://:pw@127.0.0.1:6379/0", "redis_password": SECRET},
         "the Redis password is given twice"),
        ({"redis_tls_ca": "/ca.pem"}, "redis_tls_ca need TLS: use a rediss:// redis_url"),
        ({"redis_url": "rediss://h:6379/0", "redis_tls_client_cert": "/c.pem"},
         "redis_tls_client_cert is set but redis_tls_client_key is not"),
        ({"s3_access_key_id": "AKIA1"},
         "s3_access_key_id is set but s3_secret_access_key is not"),
        ({"s3_secret_access_key": SECRET},
         "s3_secret_access_key is set but s3_access_key_id is not"),
        ({"payload_key": SECRET}, "payload_key is not base64"),
        ({"payload_key": "c2hvcnQ="}, "payload_key decodes to 5 bytes; an AES-256 key is 32"),
        ({"payload_key": KEY, "payload_key_id": "k:1"}, "String should match pattern"),
        ({"payload_old_keys": f"k0:{OLD_KEY}"}, "payload_old_keys without payload_key"),
        ({"payload_key": KEY, "payload_old_keys": f"k1:{OLD_KEY}"},
         "payload key id 'k1' is both the current key and an old one"),
        ({"payload_key": KEY, "payload_old_keys": SECRET},
         "payload_old_keys: each entry is id:base64"),
        ({"payload_key": KEY, "payload_old_keys": f"k0:{OLD_KEY},k0:{OLD_KEY}"},
         "key id 'k0' is given twice"),
        ({"payload_key": KEY, "payload_old_keys": f"k0:{SECRET}"},
         "payload_old_keys[k0] is not base64"),
    ],
)
def test_settings_refuse_half_given_or_contradictory_security(fields: dict[str, Any],
                                                              message: str) -> None:
    with pytest.raises(ValidationError) as e:
        Settings(**fields)
    assert message in str(e.value)
    assert SECRET not in str(e.value), "a refused secret must not be echoed"


def test_secrets_are_masked_but_reach_child_processes(monkeypatch: pytest.MonkeyPatch,
                                                      tmp_path: Path) -> None:
    s = Settings(temporal_api_key=SECRET, redis_password=SECRET, payload_key=KEY,
                 payload_old_keys=f"k0:{OLD_KEY}", s3_access_key_id="AKIA1",
                 s3_secret_access_key=SECRET, temporal_tls_client_cert="cert.pem",
                 temporal_tls_client_key="key.pem")
    assert SECRET not in repr(s) and KEY not in repr(s)
    assert SECRET not in str(s.model_dump())
    # A child started by the stack reads its settings from settings_env's variables.
    monkeypatch.chdir(tmp_path)  # relative paths were made absolute in the parent
    for name, value in settings_env(s).items():
        monkeypatch.setenv(name, value)
    child = Settings()
    assert child.temporal_api_key is not None
    assert child.temporal_api_key.get_secret_value() == SECRET
    assert child.redis_password is not None and child.redis_password.get_secret_value() == SECRET
    assert child.payload_key is not None and child.payload_key.get_secret_value() == KEY
    assert child.payload_old_key_ring() == s.payload_old_key_ring()
    assert child.s3_secret_access_key is not None
    assert child.s3_secret_access_key.get_secret_value() == SECRET
    assert child.temporal_tls_client_cert == s.temporal_tls_client_cert
    assert s.temporal_tls_client_cert is not None and s.temporal_tls_client_cert.is_absolute()
    assert child.temporal_tls is None  # unset stays unset ("null"), not false


# ---- Temporal: TLS, mTLS, API key, codec ----------------------------------------------


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> dict[str, Any]:
    """Client.connect's arguments, instead of a connection."""
    seen: dict[str, Any] = {}

    async def fake_connect(target_host: str, **kwargs: Any) -> Client:
        seen.update(kwargs, target_host=target_host)
        return object()  # type: ignore[return-value]

    monkeypatch.setattr(Client, "connect", fake_connect)
    return seen


async def test_plain_connection_by_default(captured: dict[str, Any]) -> None:
    await connect(Settings())
    assert captured["target_host"] == "127.0.0.1:7233"
    assert captured["tls"] is False and captured["api_key"] is None
    assert captured["data_converter"] is pydantic_data_converter


async def test_mtls_reads_the_pair_and_the_ca_at_start(captured: dict[str, Any],
                                                       tmp_path: Path) -> None:
    for name in ("cert", "key", "ca"):
        (tmp_path / f"{name}.pem").write_bytes(f"--{name}--".encode())
    await connect(Settings(temporal_address="ns.acct.tmprl.cloud:7233",
                           temporal_tls_client_cert=tmp_path / "cert.pem",
                           temporal_tls_client_key=tmp_path / "key.pem",
                           temporal_tls_server_ca=tmp_path / "ca.pem",
                           temporal_tls_server_name="temporal.internal"))
    assert captured["tls"] == TLSConfig(server_root_ca_cert=b"--ca--",
                                        domain="temporal.internal",
                                        client_cert=b"--cert--", client_private_key=b"--key--")
    assert captured["api_key"] is None


async def test_server_ca_alone_is_tls_without_a_client_certificate(
        captured: dict[str, Any], tmp_path: Path) -> None:
    (tmp_path / "ca.pem").write_bytes(b"--ca--")
    await connect(Settings(temporal_tls_server_ca=tmp_path / "ca.pem"))
    assert captured["tls"] == TLSConfig(server_root_ca_cert=b"--ca--")


@pytest.mark.parametrize(
    ("fields", "tls"),
    [
        ({"temporal_tls": True}, True),
        ({"temporal_api_key": SECRET}, True),  # Temporal Cloud: API keys go over TLS
        ({"temporal_api_key": SECRET, "temporal_tls": False}, False),  # explicit opt-out
        ({"temporal_tls": False}, False),
    ],
)
async def test_tls_switch_and_api_key(captured: dict[str, Any], fields: dict[str, Any],
                                      tls: bool) -> None:
    await connect(Settings(**fields))
    assert captured["tls"] is tls
    assert captured["api_key"] == (SECRET if "temporal_api_key" in fields else None)


async def test_unreadable_certificate_names_the_setting(captured: dict[str, Any],
                                                        tmp_path: Path) -> None:
    (tmp_path / "key.pem").write_bytes(b"k")
    with pytest.raises(SecureConnectionError,
                       match=r"cannot read WARMLOOP_TEMPORAL_TLS_CLIENT_CERT \(.*missing.pem\)"):
        await connect(Settings(temporal_tls_client_cert=tmp_path / "missing.pem",
                               temporal_tls_client_key=tmp_path / "key.pem"))
    assert not captured, "nothing is sent before the files are read"


async def test_connection_failure_over_tls_points_at_the_tls_settings(
        monkeypatch: pytest.MonkeyPatch) -> None:
    async def refused(target_host: str, **kwargs: Any) -> Client:
        raise RuntimeError("Failed client connect: transport error")

    monkeypatch.setattr(Client, "connect", refused)
    with pytest.raises(StackNotRunningError, match="over TLS with an API key") as e:
        await connect(Settings(temporal_api_key=SECRET))
    assert "WARMLOOP_TEMPORAL_API_KEY" in str(e.value) and SECRET not in str(e.value)
    with pytest.raises(StackNotRunningError, match="warmloop dev up"):
        await connect(Settings())


async def test_payload_key_gives_the_encrypting_converter(captured: dict[str, Any]) -> None:
    await connect(Settings(payload_key=KEY, payload_key_id="k2",
                           payload_old_keys=f"k0:{OLD_KEY}"))
    dc = captured["data_converter"]
    assert isinstance(dc.payload_codec, EncryptionCodec)
    assert dc.payload_codec.key_id == "k2" and dc.payload_codec.key_ids == ["k0", "k2"]
    assert dc.payload_converter_class is pydantic_data_converter.payload_converter_class
    assert dc.failure_converter_class is DefaultFailureConverterWithEncodedAttributes


def test_every_temporal_client_goes_through_connect() -> None:
    """No process code builds its own Temporal client (it would skip TLS and the codec)."""
    root = Path(clients.__file__).resolve().parent.parent
    offenders = [
        str(f.relative_to(root)) for d in ("workers", "infra", "bench", "activities")
        for f in sorted((root / d).rglob("*.py"))
        if f.name != "clients.py" and "await Client.connect(" in f.read_text()
    ]
    assert offenders == []


# ---- Redis: AUTH against a real server, TLS options ------------------------------------


@pytest.fixture
def protected_redis() -> Iterator[str]:
    """A throwaway redis-server that requires SECRET; yields its redis:// URL."""
    port = free_port()
    proc = subprocess.Popen(
        [find_redis_server(), "--bind", "127.0.0.1", "--port", str(port), "--save", "",
         "--appendonly", "no", "--requirepass", SECRET],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                    break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"redis-server did not listen on {port}") from None
                time.sleep(0.02)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait(timeout=10)


async def test_redis_password_authenticates(protected_redis: str) -> None:
    r = build_redis(Settings(redis_url=protected_redis, redis_password=SECRET))
    try:
        await r.set("warmloop:test", "ok")
        assert await r.get("warmloop:test") == b"ok"
    finally:
        await r.aclose()


@pytest.mark.parametrize("password", [None, "wrong"])
async def test_redis_without_the_password_is_refused_at_once(protected_redis: str,
                                                             password: str | None) -> None:
    r = build_redis(Settings(redis_url=protected_redis, redis_password=password))
    try:
        started = time.monotonic()
        with pytest.raises(AuthenticationError):
            await r.get("warmloop:test")
        # Not retried as a dropped connection (about 7 s with the pool's health checks).
        assert time.monotonic() - started < 1.0
    finally:
        await r.aclose()


async def test_fleet_check_reads_a_protected_registry(protected_redis: str) -> None:
    settings = Settings(redis_url=protected_redis, redis_password=SECRET)
    r = build_redis(settings)
    try:
        await EngineRegistry(r, ttl_s=30).heartbeat(EngineHeartbeat(
            engine_id="gpu0", task_queue="engine.gpu0", model="big", url="http://gpu0:8000",
            healthy=True, priced=True, at=time.time()))
    finally:
        await r.aclose()
    offers = await fleet_offers(settings)
    assert [(o.engine_id, o.model) for o in offers] == [("gpu0", "big")]


def test_redis_tls_options(tmp_path: Path) -> None:
    s = Settings(redis_url="rediss://alice@redis.internal:6380/0", redis_password=SECRET,
                 redis_tls_ca=tmp_path / "ca.pem", redis_tls_client_cert=tmp_path / "c.pem",
                 redis_tls_client_key=tmp_path / "k.pem")
    assert redis_options(s) == {"password": SECRET, "ssl_ca_certs": str(tmp_path / "ca.pem"),
                                "ssl_certfile": str(tmp_path / "c.pem"),
                                "ssl_keyfile": str(tmp_path / "k.pem")}
    pool = build_redis(s).connection_pool
    assert pool.connection_class is SSLConnection
    assert pool.connection_kwargs["username"] == "alice"
    assert pool.connection_kwargs["password"] == SECRET
    assert pool.connection_kwargs["ssl_ca_certs"] == str(tmp_path / "ca.pem")
    assert redis_options(Settings()) == {}


def test_no_redis_client_is_built_from_the_url_alone() -> None:
    """Process code builds Redis clients with build_redis or redis_options (AUTH, TLS).
    Left: the stack's start-up check of its own embedded, unprotected Redis, and the
    CLI (workers/cli.py), which another change owns."""
    root = Path(clients.__file__).resolve().parent.parent
    allowed = {"infra/stack.py", "workers/cli.py"}
    call = re.compile(r"from_url\((?P<args>[^()]*(?:\([^()]*\)[^()]*)*)\)")
    offenders = [
        f"{f.relative_to(root)}: from_url({m['args']})"
        for d in ("workers", "infra", "activities") for f in sorted((root / d).rglob("*.py"))
        if str(f.relative_to(root)) not in allowed
        for m in call.finditer(f.read_text())
        if "redis_url" in m["args"] and "redis_options" not in m["args"]
        and f.name != "clients.py"
    ]
    assert offenders == []


# ---- S3: the standard AWS chain unless explicitly set ----------------------------------


@pytest.fixture
def aws_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> pytest.MonkeyPatch:
    """An AWS chain that finds nothing unless a test gives it something: no AWS_*
    variables, no ~/.aws files, no instance metadata service."""
    import os

    for name in list(os.environ):
        if name.startswith("AWS_") and name != "AWS_CA_BUNDLE":
            monkeypatch.delenv(name)
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "aws-config"))
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "aws-credentials"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    return monkeypatch


def _s3_keys(settings: Settings) -> tuple[str, str] | None:
    creds = build_s3(settings)._request_signer._credentials
    if creds is None:
        return None
    frozen = creds.get_frozen_credentials()
    return frozen.access_key, frozen.secret_key


LOOPBACK = "http://127.0.0.1:9010"


def test_s3_uses_the_environment_chain_not_a_placeholder(aws_env: pytest.MonkeyPatch) -> None:
    aws_env.setenv("AWS_ACCESS_KEY_ID", "AKIAENV")
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    assert _s3_keys(Settings(s3_endpoint_url=None)) == ("AKIAENV", "env-secret")
    assert _s3_keys(Settings(s3_endpoint_url=LOOPBACK)) == ("AKIAENV", "env-secret")


def test_s3_uses_a_shared_credentials_profile(aws_env: pytest.MonkeyPatch,
                                              tmp_path: Path) -> None:
    (tmp_path / "aws-credentials").write_text(
        "[default]\naws_access_key_id = AKIAFILE\naws_secret_access_key = file-secret\n")
    assert _s3_keys(Settings(s3_endpoint_url=None)) == ("AKIAFILE", "file-secret")


def test_s3_explicit_settings_win(aws_env: pytest.MonkeyPatch) -> None:
    aws_env.setenv("AWS_ACCESS_KEY_ID", "AKIAENV")
    aws_env.setenv("AWS_SECRET_ACCESS_KEY", "env-secret")
    s = Settings(s3_endpoint_url="https://s3.example.com", s3_access_key_id="AKIASET",
                 s3_secret_access_key=SECRET)
    assert _s3_keys(s) == ("AKIASET", SECRET)


@pytest.mark.parametrize("endpoint", [LOOPBACK, "http://localhost:9010", "http://[::1]:9010"])
def test_s3_placeholder_only_for_a_loopback_endpoint(aws_env: pytest.MonkeyPatch,
                                                     endpoint: str) -> None:
    assert _s3_keys(Settings(s3_endpoint_url=endpoint)) == (PLACEHOLDER_S3_KEY,
                                                            PLACEHOLDER_S3_KEY)


@pytest.mark.parametrize("endpoint", [None, "https://s3.example.com", "http://10.0.0.5:9000"])
def test_s3_no_placeholder_elsewhere(aws_env: pytest.MonkeyPatch, endpoint: str | None) -> None:
    assert _s3_keys(Settings(s3_endpoint_url=endpoint)) is None


def test_every_s3_client_goes_through_build_s3() -> None:
    root = Path(clients.__file__).resolve().parent.parent
    offenders = [
        str(f.relative_to(root)) for d in ("workers", "infra", "bench", "activities")
        for f in sorted((root / d).rglob("*.py"))
        if f.name != "clients.py" and 'client("s3"' in f.read_text().replace("'", '"')
    ]
    assert offenders == []


# ---- KV events: bound to one interface, never a wildcard -------------------------------


@pytest.mark.parametrize("endpoint", [
    "tcp://*:5557", "tcp://0.0.0.0:5557", "tcp://0:5557", "tcp://[::]:5557",
    "tcp://[::1]:5557", "tcp://::1:5557", "tcp://224.0.0.1:5557", "tcp://127.1:5557",
    "ipc:///tmp/kv.sock", "inproc://kv", "tcp://127.0.0.1", "tcp://127.0.0.1:99999",
    "tcp://127.0.0.1:5557/x",
])
def test_kv_events_endpoint_refuses_wildcards_and_what_vllm_would_bind(endpoint: str) -> None:
    with pytest.raises(ValidationError, match="kv_events"):
        EngineEndpoint(id="gpu0", url="http://gpu0:8000", kv_events=endpoint)


@pytest.mark.parametrize("endpoint", [
    "tcp://127.0.0.1:5557", "tcp://10.0.0.5:5557", "tcp://worker-0.internal:5557",
    "tcp://eth0:5557",
])
def test_kv_events_endpoint_accepts_loopback_or_one_interface(endpoint: str) -> None:
    assert EngineEndpoint(id="gpu0", url="http://gpu0:8000", kv_events=endpoint).kv_events \
        == endpoint
    assert check_kv_events_endpoint(endpoint) == endpoint


def test_engines_from_the_environment_refuse_a_wildcard(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WARMLOOP_ENGINES", json.dumps(
        [{"id": "gpu0", "url": "http://gpu0:8000", "kv_events": "tcp://0.0.0.0:5557"}]))
    with pytest.raises(ValidationError, match="would bind every interface"):
        Settings()


def test_embedded_engines_publish_to_loopback() -> None:
    """The embedded engines' --kv-events-config names a loopback endpoint, which vLLM
    connects to (it binds only '*', '::', ipc and inproc endpoints) and the inference
    worker binds."""
    stack = Stack(Settings(engine_count=2), log=lambda _: None)
    configs = []
    for part in stack.engine_parts():
        i = part.argv.index("--kv-events-config")
        configs.append(json.loads(part.argv[i + 1]))
    assert [c["endpoint"] for c in configs] == ["tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"]
    for c in configs:
        assert "*" not in c["endpoint"] and "::" not in c["endpoint"]
        assert c.get("replay_endpoint") is None  # vLLM would bind a replay socket
    # The client-side check agrees with what `dev up` starts.
    for e in Stack(Settings(), log=lambda _: None).settings.engine_endpoints:
        assert e.kv_events is not None and check_kv_events_endpoint(e.kv_events)
