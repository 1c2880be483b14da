"""The compiled simulator's guard: a build stands in for the pure modules only if it was
made from the sources beside them now, by this Python (``warmloop.sim.compiled``). The
build itself and its results: ``tests/integration/test_sim_compiled.py``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from warmloop.sim import compiled


def _fake_build(tmp_path: Path, **manifest: object) -> Path:
    for m in compiled.MODULES:
        (tmp_path / f"{m}{compiled._abi()}").write_bytes(b"not really a module")
    current = {"sources": compiled.source_digests(), "abi": compiled._abi()}
    (tmp_path / compiled.MANIFEST).write_text(json.dumps({**current, **manifest}))
    return tmp_path


def test_a_current_build_goes_first_on_the_package_path(tmp_path: Path) -> None:
    build = _fake_build(tmp_path)
    path = ["/the/pure/modules"]
    assert compiled.stale_reason(build) is None
    assert compiled.activate(build, path) is True
    assert path == [str(build.resolve()), "/the/pure/modules"]


@pytest.mark.parametrize(("manifest", "reason"), [
    ({"sources": {"core": "0" * 64}}, "changed since the build"),
    ({"abi": ".cpython-27-x86_64-linux-gnu.so"}, "built for .cpython-27"),
])
def test_a_stale_build_is_refused_with_the_reason(tmp_path: Path, manifest: dict[str, object],
                                                   reason: str) -> None:
    build = _fake_build(tmp_path, **manifest)
    path = ["/the/pure/modules"]
    with pytest.warns(RuntimeWarning, match=reason):
        assert compiled.activate(build, path) is False
    assert path == ["/the/pure/modules"]


def test_a_missing_or_unreadable_build_is_refused(tmp_path: Path) -> None:
    assert "no readable manifest.json" in (compiled.stale_reason(tmp_path / "absent") or "")
    (tmp_path / compiled.MANIFEST).write_text("{not json")
    assert "no readable manifest.json" in (compiled.stale_reason(tmp_path) or "")
    (tmp_path / "b").mkdir()
    build = _fake_build(tmp_path / "b")
    (build / f"engine{compiled._abi()}").unlink()
    assert compiled.stale_reason(build) == "engine not built"
