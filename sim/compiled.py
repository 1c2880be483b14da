"""The simulator's hot modules compiled to C with mypyc, for fleets of hundreds of GPUs.

``python -m warmloop.sim.compiled [DIR]`` compiles ``sim/core.py``, ``sim/engine.py``
and ``sim/fleet.py`` (the event loop, the engines and the fleet: where a large run
spends its time) into ``DIR`` (default ``.warmloop/sim-compiled``), about 20 seconds
of one core. ``WARMLOOP_SIM_COMPILED=DIR`` then makes ``import warmloop.sim...`` load
them in place of the pure modules, in that process and the processes it starts (the
variable is read once, when ``warmloop.sim`` is first imported). The policy modules
(``workflows/``) stay the interpreted ones the workers run, so the simulator still asks
the very same code.

The compiled modules run only if they were built from the sources beside them now (a
SHA-256 manifest) by this Python; otherwise the pure modules run and a warning says
why, so an edit to ``sim/engine.py`` is never shadowed by an old build. The results
are the same either way (``tests/integration/test_sim_compiled.py`` checks a run's
every figure)."""

from __future__ import annotations

import argparse
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import warnings
from collections.abc import MutableSequence
from pathlib import Path
from typing import Any

import warmloop

MODULES = ("core", "engine", "fleet")
"""The modules compiled, in ``warmloop/sim/``."""
DEFAULT_DIR = Path(".warmloop/sim-compiled")
MANIFEST = "manifest.json"
ENV = "WARMLOOP_SIM_COMPILED"

_SIM_DIR = Path(__file__).resolve().parent
_PACKAGE_DIR = Path(warmloop.__file__).parent
"""The ``warmloop`` package as imported (in the repository, links to the top-level
folders: ``_SIM_DIR.parent`` would be the repository itself)."""


def _abi() -> str:
    """The extension suffix of this interpreter (a build for another Python won't load)."""
    return importlib.machinery.EXTENSION_SUFFIXES[0]


def source_digests() -> dict[str, str]:
    """SHA-256 of each compiled module's source as it is now."""
    return {m: _sha256(_SIM_DIR / f"{m}.py") for m in MODULES}


def build(out: Path = DEFAULT_DIR) -> Path:
    """Compile ``MODULES`` into ``out`` (replacing what is there) and write its manifest.

    mypyc type-checks the modules with the rest of the package, so it runs on a copy of
    the package's Python files (the repository's ``warmloop/`` is links to the
    top-level folders); the extensions it writes are moved to ``out``. Raises
    ``RuntimeError`` with the compiler's output when the build fails (no C compiler or
    Python headers, a construct mypyc refuses)."""
    digests = source_digests()
    with tempfile.TemporaryDirectory(prefix="warmloop-mypyc-") as tmp:
        root = Path(tmp)
        shutil.copytree(_PACKAGE_DIR, root / "warmloop", symlinks=False,
                        ignore=_python_files_only)
        (root / "mypy.ini").write_text(_MYPY_CONFIG)
        files = [f"warmloop/sim/{m}.py" for m in MODULES]
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "MYPYPATH")}
        proc = subprocess.run(
            [sys.executable, "-c", _SETUP, *files], cwd=root, env=env, capture_output=True,
            text=True, check=False)
        if proc.returncode != 0:
            raise RuntimeError(f"mypyc failed ({proc.returncode}):\n{proc.stdout[-4000:]}"
                               f"\n{proc.stderr[-4000:]}")
        built = [root / "warmloop" / "sim" / f"{m}{_abi()}" for m in MODULES]
        shared = sorted(root.glob(f"*__mypyc{_abi()}"))
        missing = [p.name for p in built if not p.exists()]
        if missing or len(shared) != 1:
            raise RuntimeError(f"mypyc wrote no {missing or 'shared library'} in {root}")
        if out.exists():
            shutil.rmtree(out)
        out.mkdir(parents=True)
        for p in [*built, *shared]:
            shutil.copy2(p, out / p.name)
    built_files = {p.name: _sha256(out / p.name) for p in [*built, *shared]}
    (out / MANIFEST).write_text(json.dumps(
        {"sources": digests, "abi": _abi(), "python": sys.version,
         "shared": shared[0].name, "built": built_files}, indent=2) + "\n")
    return out


def _sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


_SETUP = """
import os, sys
from setuptools import setup
from mypyc.build import mypycify
files = sys.argv[1:]
sys.argv = ["setup.py", "build_ext", "--inplace"]
setup(name="warmloop_sim_compiled", ext_modules=mypycify(files, opt_level="3"))
sys.stdout.flush()
sys.stderr.flush()
os._exit(0)
"""
"""What ``python -m mypyc FILES`` runs (its generated ``setup.py``), but ending with
``os._exit``: the interpreter's teardown of mypy's object graph took ~28 s of the build's
110 here, after every file was written. An error still exits non-zero (it raises before
``os._exit``)."""

_MYPY_CONFIG = """[mypy]
python_version = 3.11
plugins = pydantic.mypy
ignore_missing_imports = True
check_untyped_defs = True
follow_imports = skip

[mypy-warmloop.*]
follow_imports = normal

[mypy-pydantic.*,pydantic_core.*,pydantic_settings.*,typing_extensions,annotated_types.*]
follow_imports = normal
"""
"""The project's own type-checking settings (``pyproject.toml``'s ``[tool.mypy]``), which
mypyc checks the package with: without them (a test's ``PYTHONPATH``, once) it failed on
untyped third-party imports and pydantic constructors the project's mypy accepts. Third-
party packages but pydantic's are not followed (their names are ``Any``): the simulator
uses none of them, but the package imports reach openai, the Agents SDK and temporalio,
some 3,500 modules that took ~20 s of the build to parse and check (now ~3 s). Stubs,
the standard library's among them, are followed all the same."""


def _python_files_only(folder: str, names: list[str]) -> list[str]:
    """``copytree``'s ignore: keep folders and ``.py`` files (no models, caches, builds)."""
    return [n for n in names
            if n == "__pycache__" or (not n.endswith(".py") and not Path(folder, n).is_dir())]


def stale_reason(directory: Path) -> str | None:
    """Why the build in ``directory`` cannot stand in for the sources now (None: it can)."""
    return _checked_manifest(directory)[1]


def _checked_manifest(directory: Path) -> tuple[dict[str, Any], str | None]:
    """The build's manifest and why it is stale (None: current; the manifest is empty
    when it could not be read)."""
    try:
        manifest = json.loads((directory / MANIFEST).read_text())
    except (OSError, ValueError) as e:
        return {}, f"no readable {MANIFEST} in {directory} ({e.__class__.__name__})"
    if manifest.get("abi") != _abi():
        return manifest, f"built for {manifest.get('abi')}, this Python loads {_abi()}"
    changed = [m for m, d in source_digests().items() if manifest.get("sources", {}).get(m) != d]
    if changed:
        return manifest, (f"sim/{', sim/'.join(f'{m}.py' for m in changed)} changed since "
                          "the build")
    built = manifest.get("built", {})
    names = [f"{m}{_abi()}" for m in MODULES] + [manifest.get("shared", "")]
    for name in names:
        path = directory / name
        if not name or name not in built or not path.is_file():
            return manifest, f"{name or 'the shared library'} not built"
        if _sha256(path) != built[name]:
            return manifest, f"{name} is not the file the build wrote"
    return manifest, None


def activate(directory: Path, package_path: MutableSequence[str]) -> bool:
    """Put the build in ``directory`` before the pure modules on ``package_path`` (the
    ``warmloop.sim`` package's ``__path__``) if it is current (the sources it was built
    from, this Python, every file as the build wrote it) and its shared library loads;
    warn and leave the path alone if not. Must run before any of ``MODULES`` is
    imported."""
    directory = directory.resolve()
    manifest, reason = _checked_manifest(directory)
    if reason is not None:
        warnings.warn(f"{ENV}={directory}: running the pure simulator: {reason}; rebuild "
                      "with `python -m warmloop.sim.compiled`", RuntimeWarning, stacklevel=3)
        return False
    # The modules import their shared library by a top-level name (a hash of the module
    # names, the same for every build): load it from this build by its path, so neither
    # another copy on sys.path nor the folder's own files become importable by name.
    shared = manifest["shared"]
    name = shared.removesuffix(_abi())
    if name not in sys.modules:
        try:
            spec = importlib.util.spec_from_file_location(name, directory / shared)
            if spec is None or spec.loader is None:
                raise ImportError(f"no loader for {shared}")
            module = importlib.util.module_from_spec(spec)
            spec.loader.exec_module(module)
        except ImportError as e:
            warnings.warn(f"{ENV}={directory}: running the pure simulator: {shared} did not "
                          f"load ({e})", RuntimeWarning, stacklevel=3)
            return False
        sys.modules[name] = module
    package_path.insert(0, str(directory))
    return True


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("out", nargs="?", type=Path, default=DEFAULT_DIR)
    p.add_argument("--if-stale", action="store_true",
                   help="build only if OUT does not hold a current build")
    args = p.parse_args(argv)
    reason = stale_reason(args.out)
    if args.if_stale and reason is None:
        print(f"{args.out}: current")
        return
    build(args.out)
    print(f"{args.out}: built ({', '.join(MODULES)})")


if __name__ == "__main__":
    main()
