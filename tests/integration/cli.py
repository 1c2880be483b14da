"""Running the real `warmloop` CLI in a subprocess, as a user would."""

from __future__ import annotations

import os
import subprocess
import sys


def warmloop(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    """`warmloop ARGS...` with a wide terminal, so tables are not folded."""
    return subprocess.run([sys.executable, "-m", "warmloop.workers.cli", *args],
                          capture_output=True, text=True, timeout=timeout_s,
                          env={**os.environ, "COLUMNS": "200"})
