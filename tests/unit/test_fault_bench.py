"""bench-faults counts an effect applied twice only when it was: a key the embedded
Redis brings back from its append-only file after a restart is one application."""

from __future__ import annotations

from bench.faults import EffectWatch

KEY = "warmloop:effect:job-1:id:abc"


def watch(sets: dict[tuple[int, str], int], scanned: set[tuple[int, str]],
          epochs: int) -> dict[str, int]:
    w = EffectWatch("redis://127.0.0.1:1/0", "job")
    w._epoch = epochs - 1
    w._sets.update(sets)
    w._scanned |= scanned
    return w.applications()


def test_a_key_kept_across_a_redis_restart_is_one_application() -> None:
    assert watch({(0, KEY): 1}, {(0, KEY), (1, KEY)}, 2) == {KEY: 1}


def test_a_key_set_again_after_a_restart_is_applied_twice() -> None:
    assert watch({(0, KEY): 1, (1, KEY): 1}, {(0, KEY), (1, KEY)}, 2) == {KEY: 2}


def test_an_application_only_a_scan_saw_counts_once() -> None:
    assert watch({}, {(1, KEY)}, 2) == {KEY: 1}
    assert watch({(0, KEY): 1}, {(0, KEY)}, 1) == {KEY: 1}
