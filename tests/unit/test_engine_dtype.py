"""The embedded engines' dtype: bfloat16 only where the CPU computes it natively, and a
KV pool of the same tokens whatever the dtype."""

from __future__ import annotations

from warmloop.infra.stack import Stack, engine_dtype, engine_kv_bytes, native_bf16
from warmloop.workers.settings import Settings

AVX2_HOST = "processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma\nprocessor\t: 1\n"
SAPPHIRE_RAPIDS = "flags\t\t: avx2 avx512f avx512_bf16 amx_bf16 amx_tile\n"
ARM_BF16 = "Features\t: fp asimd bf16 i8mm\n"
ARM_PLAIN = "Features\t: fp asimd\n"


def test_bfloat16_is_chosen_only_where_the_cpu_has_it() -> None:
    assert not native_bf16(AVX2_HOST)
    assert not native_bf16(ARM_PLAIN)
    assert native_bf16(SAPPHIRE_RAPIDS)
    assert native_bf16(ARM_BF16)
    assert native_bf16("")  # no flags to read: vLLM's own default


def test_auto_resolves_by_the_cpu_and_an_explicit_dtype_wins() -> None:
    auto = Settings()
    assert engine_dtype(auto, AVX2_HOST) == "float32"
    assert engine_dtype(auto, SAPPHIRE_RAPIDS) == "bfloat16"
    assert engine_dtype(Settings(engine_dtype="bfloat16"), AVX2_HOST) == "bfloat16"
    assert engine_dtype(Settings(engine_dtype="float32"), SAPPHIRE_RAPIDS) == "float32"


def test_a_float32_engine_gets_the_bytes_for_the_same_tokens() -> None:
    s = Settings(engine_kv_cache_bytes=16 << 20)
    assert engine_kv_bytes(s, "bfloat16") == 16 << 20
    assert engine_kv_bytes(s, "float32") == 32 << 20
    assert engine_kv_bytes(Settings(), "float32") is None  # vLLM's KV space default


def test_the_engine_command_line_carries_the_dtype_and_its_pool() -> None:
    for dtype, pool in (("float32", 32 << 20), ("bfloat16", 16 << 20)):
        s = Settings(engine_count=1, engine_dtype=dtype, engine_kv_cache_bytes=16 << 20)
        argv = Stack(s, log=lambda _: None).engine_parts()[0].argv
        assert argv[argv.index("--dtype") + 1] == dtype
        assert argv[argv.index("--kv-cache-memory-bytes") + 1] == str(pool)
