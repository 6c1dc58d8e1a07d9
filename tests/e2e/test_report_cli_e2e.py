"""`gradsync report` run as a module (``python -m gradsync.telemetry.cli``): its exit code and
message on a missing run directory."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


def test_module_entry_point_exit_code(tmp_path: Path) -> None:
    missing = tmp_path / "missing"
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync.telemetry.cli", "report", str(missing)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2
    assert str(missing) in proc.stderr and "Traceback" not in proc.stderr
