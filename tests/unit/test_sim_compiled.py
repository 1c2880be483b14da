"""The compiled simulator's guard: a build stands in for the pure modules only if it was
made from the sources beside them now, by this Python (``warmloop.sim.compiled``). The
build itself and its results: ``tests/integration/test_sim_compiled.py``."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from warmloop.sim import compiled

SHARED = f"0123abcd__mypyc{compiled._abi()}"


def _fake_build(tmp_path: Path, **manifest: object) -> Path:
    built = {}
    for name in [*(f"{m}{compiled._abi()}" for m in compiled.MODULES), SHARED]:
        (tmp_path / name).write_bytes(b"not really a module: " + name.encode())
        built[name] = compiled._sha256(tmp_path / name)
    current = {"sources": compiled.source_digests(), "abi": compiled._abi(),
               "shared": SHARED, "built": built}
    (tmp_path / compiled.MANIFEST).write_text(json.dumps({**current, **manifest}))
    return tmp_path


def test_a_current_build_whose_library_does_not_load_is_refused(tmp_path: Path) -> None:
    """The manifest's checks pass (the real load: tests/integration/test_sim_compiled.py);
    a shared library that does not load leaves the pure modules, and sys.path, alone."""
    build = _fake_build(tmp_path)
    path = ["/the/pure/modules"]
    before = list(sys.path)
    assert compiled.stale_reason(build) is None
    with pytest.warns(RuntimeWarning, match="did not load"):
        assert compiled.activate(build, path) is False
    assert path == ["/the/pure/modules"] and sys.path == before
    assert "0123abcd__mypyc" not in sys.modules


def test_a_build_file_changed_or_missing_is_refused(tmp_path: Path) -> None:
    build = _fake_build(tmp_path)
    (build / SHARED).write_bytes(b"another build's library")
    assert compiled.stale_reason(build) == f"{SHARED} is not the file the build wrote"
    (build / SHARED).unlink()
    assert compiled.stale_reason(build) == f"{SHARED} not built"


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
    assert compiled.stale_reason(build) == f"engine{compiled._abi()} not built"
