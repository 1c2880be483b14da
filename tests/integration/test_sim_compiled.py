"""The simulator compiled with mypyc (``warmloop.sim.compiled``) gives the pure
simulator's results: every recorded fleet case and fidelity scenario of
``tests/unit/test_sim_equivalence.py``, figure for figure and step for step (the
digests), run on a fresh build. Needs a C compiler and Python's headers, as ``make
bench-fleet`` does; no stack (about 40 s: a 20 s build, the cases under it)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from warmloop.sim import compiled

REPO = Path(__file__).resolve().parents[2]


def test_the_compiled_simulator_reproduces_every_recorded_case(tmp_path: Path) -> None:
    build = compiled.build(tmp_path / "sim-compiled")
    env = {**os.environ, compiled.ENV: str(build)}
    probe = subprocess.run(
        [sys.executable, "-c", "import warmloop.sim as s, warmloop.sim.core as c, "
         "warmloop.sim.engine as e, warmloop.sim.fleet as f; "
         "print(s.COMPILED, c.__file__, e.__file__, f.__file__)"],
        env=env, cwd=REPO, capture_output=True, text=True, check=True)
    flag, *files = probe.stdout.split()
    assert flag == "True", probe.stdout + probe.stderr
    assert [Path(f).parent for f in files] == [build.resolve()] * 3
    assert all(f.endswith(compiled._abi()) for f in files)

    cases = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
         "tests/unit/test_sim_equivalence.py", "-k", "matches_the_recorded_baseline"],
        env=env, cwd=REPO, capture_output=True, text=True, check=False)
    assert cases.returncode == 0, cases.stdout[-4000:] + cases.stderr[-2000:]
    assert " passed" in cases.stdout and "failed" not in cases.stdout
