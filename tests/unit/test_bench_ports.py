"""Bench stacks never share a port with each other or with `warmloop dev up`: a bench
left running (killed before its teardown) must not break the next one, nor a bench the
developer's own stack."""

from __future__ import annotations

from urllib.parse import urlparse

import pytest

from bench import gateway, hedge
from bench.common import (
    BENCH_OFFSETS,
    MAX_BENCH_ENGINES,
    MIN_BENCH_KV_BYTES,
    bench_ports,
    bench_settings,
)
from warmloop.workers.settings import Settings


def stack_ports(s: Settings) -> dict[str, int]:
    """Every port a stack of these settings listens on (its engines' and KV event
    publishers' for the most engines a bench runs)."""
    out = {"temporal": int(s.temporal_address.rsplit(":", 1)[1]),
           "temporal_ui": s.temporal_ui_port, "redis": urlparse(s.redis_url).port or 6379,
           "s3": urlparse(s.s3_endpoint_url or "").port or 80, "inbox": s.inbox_port,
           "gateway": s.gateway_port}
    kv_events = s.engine_kv_events_base_port
    for i in range(MAX_BENCH_ENGINES):
        out[f"engine{i}"] = s.engine_base_port + i
        if kv_events is not None:
            out[f"kv_events{i}"] = kv_events + i
    return out


def test_no_two_stacks_share_a_port() -> None:
    owners: dict[int, str] = {}
    stacks = {name: stack_ports(bench_settings(name, engines=1, kv_cache_bytes=1 << 26))
              for name in BENCH_OFFSETS}
    stacks["dev"] = stack_ports(Settings(_env_file=None))  # type: ignore[call-arg]
    fixed = {"routing peer (sglang-router, --peer-port)": 8290, "its metrics": 8290 + 20_000,
             "gateway bench's gateway": gateway.GATEWAY_PORT,
             "gateway bench's sglang-router": gateway.SGLANG_PORT,
             "gateway bench's vllm-router": gateway.VLLM_ROUTER_PORT,
             "hedge bench's tool": hedge.TOOL_PORT, "eval-model's engine": 8790}
    for name, ports in stacks.items():
        for part, port in ports.items():
            who = f"{name}.{part}"
            assert port not in owners, f"{who} and {owners[port]} share port {port}"
            owners[port] = who
    for who, port in fixed.items():
        assert port not in owners, f"{who} and {owners[port]} share port {port}"
        owners[port] = who


def test_an_unknown_bench_or_offset_is_refused() -> None:
    with pytest.raises(ValueError, match="BENCH_OFFSETS"):
        bench_settings("nobody", engines=1, kv_cache_bytes=1 << 26)
    with pytest.raises(ValueError, match="0-99"):
        bench_ports(100)
    with pytest.raises(ValueError, match="engines"):
        bench_settings("routing", engines=MAX_BENCH_ENGINES + 1, kv_cache_bytes=1 << 26)


def test_a_pool_too_small_for_one_request_is_refused_before_start_up() -> None:
    # a 12 MiB pool looks like 6,144 tokens but vLLM offers 6,016 of them, and refuses
    # the engine after minutes of start-up; the bench says so at once, with the floor
    with pytest.raises(ValueError, match=f"at least {MIN_BENCH_KV_BYTES:,}"):
        bench_settings("routing", engines=2, kv_cache_bytes=12 * 1024 * 1024)
    assert bench_settings("routing", engines=2, kv_cache_bytes=MIN_BENCH_KV_BYTES)
