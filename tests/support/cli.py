"""The ``gradsync`` command as a user runs it, from a test: the venv's interpreter, output kept."""

from __future__ import annotations

import subprocess
import sys


def gradsync(*args: str, timeout: float = 150) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gradsync", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
