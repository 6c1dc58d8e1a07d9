"""Running a script under plain torchrun from a test, with no process left behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def torchrun(args: list[str], env: dict[str, str], timeout_s: float) -> str:
    """``torchrun ARGS`` from the repository root with the test interpreter's torch (the venv's,
    not one on PATH); returns stdout and stderr together. The run gets a session of its own, so
    one past its timeout is killed with its workers, not just the launcher, and the test fails."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"torchrun {' '.join(args)} ran past {timeout_s}s:\n{out[-3000:]}")
    if proc.returncode != 0:
        pytest.fail(f"torchrun {' '.join(args)} exited {proc.returncode}:\n{out[-3000:]}")
    return out
