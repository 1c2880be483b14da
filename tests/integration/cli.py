"""Running the real `warmloop` CLI in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys


def warmloop(*args: str, timeout_s: float = 600, token: str | None = None
             ) -> subprocess.CompletedProcess[str]:
    """`warmloop ARGS...` with a wide terminal, so tables are not folded; ``token``: the
    user's WARMLOOP_TOKEN (approval commands)."""
    env = {**os.environ, "COLUMNS": "200"}
    if token is not None:
        env["WARMLOOP_TOKEN"] = token
    return subprocess.run([sys.executable, "-m", "warmloop.workers.cli", *args],
                          capture_output=True, text=True, timeout=timeout_s, env=env)
