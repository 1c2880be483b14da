"""What the wheel installs: ``warmloop`` and nothing else at the top level, so a user's
own ``workflows`` package (Temporal's samples' layout) and warmloop import side by side."""

from __future__ import annotations

import subprocess
import sys
import sysconfig
import textwrap
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).parent.parent.parent


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("dist")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "-w", str(out),
                    str(ROOT)], check=True, capture_output=True, timeout=600)
    (whl,) = out.glob("warmloop-*.whl")
    return whl


def test_the_wheel_holds_only_the_warmloop_package(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    tops = {n.split("/")[0] for n in names}
    assert tops == {"warmloop", f"{wheel.name.split('-py3')[0]}.dist-info"}, tops
    # the four rooms, their data, and none of bench/ or tests/
    for room in ("workflows", "activities", "workers", "infra"):
        assert f"warmloop/{room}/__init__.py" in names
    assert "warmloop/activities/data/ticket_triage/tickets.jsonl" in names
    assert not [n for n in names if "/bench/" in n or "/tests/" in n or "synthetic" in n]
    entry_points = zipfile.ZipFile(wheel).read(
        f"{wheel.name.split('-py3')[0]}.dist-info/entry_points.txt").decode()
    assert "[warmloop.profiles]" in entry_points and "warmloop = warmloop.workers.cli:main" \
        in entry_points


def test_a_fresh_venv_with_the_wheel_imports_a_users_workflows_package_beside_it(
        wheel: Path, tmp_path: Path) -> None:
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    py = venv / "bin" / "python"
    subprocess.run([sys.executable, "-m", "pip", "--python", str(py), "install", "-q",
                    "--no-deps", str(wheel)], check=True, capture_output=True, timeout=300)
    site = subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                          check=True, capture_output=True, text=True).stdout.strip()
    # warmloop's dependencies come from this venv (a line in a .pth is a plain path: this
    # venv's editable warmloop is not loaded there)
    (Path(site) / "deps.pth").write_text(sysconfig.get_path("purelib") + "\n")
    project = tmp_path / "user_project"
    (project / "workflows").mkdir(parents=True)
    (project / "workflows" / "__init__.py").write_text("OWNER = 'user'\n")
    probe = textwrap.dedent("""
        import workflows, warmloop
        from warmloop.workflows.agent_job import AgentJob
        from warmloop import Profile, tool, JobClient, WarmloopPlugin
        print(workflows.OWNER, workflows.__file__, warmloop.__file__, AgentJob.__name__)
    """)
    out = subprocess.run([str(py), "-c", probe], cwd=project, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr
    owner, user_file, warmloop_file, job = out.stdout.split()
    assert (owner, job) == ("user", "AgentJob")
    assert user_file.startswith(str(project))
    assert warmloop_file.startswith(site)
