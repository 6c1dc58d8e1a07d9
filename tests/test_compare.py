"""`gradsync compare` end to end, and its curve arithmetic."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gradsync.compare import curve_from_records, parse_strategies, summarize
from gradsync.telemetry.records import StepRecord
from tests.test_cli_run import gradsync


def _records(losses: list[float], step_s: float, nbytes: int) -> list[StepRecord]:
    return [
        StepRecord(r, s, 100.0 + s * step_s, step_s / 2, step_s / 2, 0.0, 0.0, 4, nbytes, loss=v)
        for s, v in enumerate(losses)
        for r in (0, 1)
    ]


def test_target_is_reached_on_the_smoothed_curve(tmp_path: Path) -> None:
    fast = curve_from_records("fast", _records([1.0] * 5 + [0.1] * 25, 0.1, 10))
    slow = curve_from_records("slow", _records([1.0] * 20 + [0.5] * 10, 0.1, 1))
    assert fast.bytes[-1] == 2 * 30 * 10  # cumulative over both ranks
    assert np.isclose(fast.seconds[-1], 3.0)
    # the 10-step moving average crosses 0.55 only once enough low values are in the window
    assert fast.first_below(0.55) == 9
    result = summarize([fast, slow], None, tmp_path)
    assert result["target_loss"] == pytest.approx(0.5)  # default: the worst final loss
    rows = {r["strategy"]: r for r in result["rows"]}
    assert rows["fast"]["steps_to_target"] < rows["slow"]["steps_to_target"]
    assert rows["slow"]["steps_to_target"] == 30
    assert json.loads((tmp_path / "compare.json").read_text())["rows"][0]["strategy"] == "fast"
    assert (tmp_path / "loss_vs_time.png").stat().st_size > 0


def test_strategy_list_errors() -> None:
    with pytest.raises(ValueError, match="valid: bsp"):
        parse_strategies("bsp,gossip")
    with pytest.raises(ValueError, match="twice"):
        parse_strategies("bsp,bsp")
    with pytest.raises(ValueError, match="at least one"):
        parse_strategies(" , ")


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
    for name in ("bsp", "local-4", "ssp-1"):
        assert (out / name / "metrics.jsonl").exists()
    assert (out / "loss_vs_time.png").exists() and (out / "loss_vs_bytes.png").exists()
    assert "steps→target" in proc.stdout and "local:4" in proc.stdout
