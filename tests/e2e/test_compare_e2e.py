"""`gradsync compare` end to end: each strategy run, a table and plots written."""

from __future__ import annotations

import json
import re
from pathlib import Path

import numpy as np
import pytest

from gradsync.progress import read_heartbeat
from gradsync.telemetry.records import read_records
from tests.support.cli import gradsync

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(240)
def test_compare_runs_each_strategy_and_writes_table_and_plots(tmp_path: Path) -> None:
    out = tmp_path / "cmp"
    proc = gradsync(
        "compare",
        "--strategies",
        "bsp,local:4,ssp:1",
        "--workload",
        "mlp",
        "--nproc",
        "2",
        "--steps",
        "16",
        "--out",
        str(out),
        timeout=220,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    result = json.loads((out / "compare.json").read_text())
    assert [r["strategy"] for r in result["rows"]] == ["bsp", "local:4", "ssp:1"]
    by = {r["strategy"]: r for r in result["rows"]}
    assert by["local:4"]["mb_sent"] == pytest.approx(by["bsp"]["mb_sent"] / 4)
    # ssp pushes a gradient and pulls the parameters back: twice BSP's payload, up to headers
    assert by["ssp:1"]["mb_sent"] == pytest.approx(2 * by["bsp"]["mb_sent"], rel=1e-3)
    for name in ("bsp", "local-4", "ssp-1"):
        assert (out / name / "metrics.jsonl").exists()
        # rank 0's heartbeat, which the comparison's progress line follows, reached the end
        assert read_heartbeat(out / name) == {
            "step": 16,
            "total": 16,
            "loss": pytest.approx(_last_mean_loss(out / name)),
        }
    assert (out / "loss_vs_time.png").exists() and (out / "loss_vs_bytes.png").exists()
    assert "steps→target" in proc.stdout and "local:4" in proc.stdout
    # The final progress line shows the last step's loss, as the earlier ones do, not the
    # moving average
    final = re.findall(r"step 48/48\s+loss (\S+)", proc.stderr)
    assert final and set(final) == {f"{_last_mean_loss(out / 'ssp-1'):.4f}"}


def _last_mean_loss(run_dir: Path) -> float:
    records = read_records(run_dir)
    last = max(r.step for r in records)
    return float(np.mean([r.loss for r in records if r.step == last and r.loss is not None]))
