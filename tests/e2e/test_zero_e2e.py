"""ZeRO stage 2 through ``gradsync run``: it trains and reports."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e


# -- the CLI -----------------------------------------------------------------------------------


@pytest.mark.timeout(150)
def test_gradsync_run_with_zero2_trains_and_reports(tmp_path: Path) -> None:
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync", "run", "--nproc", "2", "--workload", "mlp",
         "--params", "3000", "--steps", "6", "--strategy", "zero:2", "--out", str(out),
         "--no-plots"],  # plots: tests/e2e/test_run_outputs.py (a second of a core each)
        capture_output=True,
        text=True,
        timeout=140,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "strategy zero:2" in proc.stdout + proc.stderr and "final loss" in proc.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 6 and len(report["ranks"]) == 2
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["bytes"] > 0 for r in records) and not any(r["skipped"] for r in records)
