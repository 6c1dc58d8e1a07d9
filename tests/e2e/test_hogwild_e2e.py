"""hogwild through ``gradsync run``: the report's updates applied and their staleness."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.support import hogwild_ranks as ranks

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(180)
def test_gradsync_run_reports_the_updates_applied_and_their_staleness(tmp_path: Path) -> None:
    import json
    import subprocess
    import sys

    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "gradsync", "run", "--strategy", "hogwild", "--nproc", "2",
           "--workload", "mlp", "--steps", "12", "--out", str(out), "--no-plots",
           "--no-progress", "--timeout", "60"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=150)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads((out / "report.json").read_text())["strategy_summary"]
    assert summary["updates_applied"] == 24 and summary["updates_per_rank"] == [12, 12]
    assert 0 <= summary["staleness_mean"] <= summary["staleness_max"]
    assert ranks.leftovers() == []
