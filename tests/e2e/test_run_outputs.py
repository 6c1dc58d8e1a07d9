"""End-to-end: what `gradsync run` itself leaves behind for a run with a slowed rank.

The timeline (trace.json), the three plots, and exactly one live straggler warning for the
slowed rank (one per episode, not one per step), all from the command a user types.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.telemetry.plots import PLOT_FILES

pytestmark = pytest.mark.e2e

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
LIVE_WARNING = "gradsync: straggler: "


@pytest.mark.timeout(240)
def test_run_writes_trace_and_plots_and_warns_once_about_the_slow_rank(tmp_path: Path) -> None:
    out = tmp_path / "run"
    argv = ["run", "--nproc", "2", "--workload", "mlp", "--steps", "40", "--slow", "1:3@10"]
    proc = subprocess.run(
        [sys.executable, "-m", "gradsync", *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=220,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    trace = json.loads((out / "trace.json").read_text())
    spans = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    for rank in (0, 1):  # one process per rank, with compute, communication and idle spans
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"compute", "allreduce[0]", "optimizer"} <= names, names
    assert any(e["name"] == "idle" for e in spans if e["pid"] == 0)  # rank 0 waits for rank 1
    assert {e["args"]["step"] for e in spans if e["name"] == "compute"} == set(range(40))

    for name in PLOT_FILES:
        data = (out / name).read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 10_000, name

    live = [line for line in proc.stderr.splitlines() if line.startswith(LIVE_WARNING)]
    about_rank_1 = [line for line in live if line.startswith(LIVE_WARNING + "rank 1:")]
    assert len(about_rank_1) == 1, live
    assert not [line for line in live if line.startswith(LIVE_WARNING + "rank 0:")], live
    # the final report names it too, and says where the outputs went
    assert "rank 1:" in proc.stdout.split("stragglers")[-1]
    assert str(out / "trace.json") in proc.stdout
