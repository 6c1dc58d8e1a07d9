"""Telemetry of a run restarted by the elastic agent, through ``gradsync run``: every step once
in the report, and a resume after a torn metrics line goes on."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from gradsync.checkpoint.store import CheckpointStore
from gradsync.telemetry.records import METRICS_FILE
from tests.support.restart_telemetry import tear_last_line
from tests.support.shared_runs import KILLED_BSP_RESUMED, SharedRun

pytestmark = pytest.mark.e2e


@pytest.mark.timeout(180)
def test_restarted_run_reports_every_step_once(killed_bsp_run: SharedRun) -> None:
    # The shared killed run (tests/e2e/conftest.py): checkpoints every step, telemetry gathered
    # every 10: at the kill (step 17) the restart resumes from step 17 (or 16 or 15, if the
    # background writes of the newer ones were not complete yet); steps 10..16 (10..14) come
    # before it, were never gathered and never run again: their records can only come back
    # with the checkpoint.
    out, stderr = killed_bsp_run.out, killed_bsp_run.stderr
    resumed = "|".join(str(step) for step in KILLED_BSP_RESUMED)
    assert re.search(rf"restart: resuming at step ({resumed})\b", stderr), stderr[-3000:]
    lines = (out / METRICS_FILE).read_text().splitlines()
    keys = [(d["rank"], d["step"]) for d in map(json.loads, lines)]
    assert sorted(keys) == [(rank, step) for rank in range(2) for step in range(30)]
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 30 and [r["steps"] for r in report["ranks"]] == [30, 30]
    per_step = {d["bytes"] for d in map(json.loads, lines)}
    assert len(per_step) == 1 and [r["bytes"] for r in report["ranks"]] == [30 * per_step.pop()] * 2
    # The timeline spans of the killed attempt's steps up to its last gather (each rank wrote
    # them itself there), the restart's from where it resumed, each step's once: before, rank
    # 0 wrote them all at report(), so only the last attempt's were kept (a user tester's).
    computed: dict[int, list[int]] = {0: [], 1: []}
    for span in map(json.loads, (out / "spans.jsonl").read_text().splitlines()):
        if span["name"] == "compute":
            computed[span["rank"]].append(span["step"])
    said = re.search(r"restart: resuming at step (\d+)", stderr)
    assert said is not None
    resumed_at = int(said.group(1))
    for steps in computed.values():
        assert len(steps) == len(set(steps)), sorted(steps)
        assert set(range(10)) | set(range(resumed_at, 30)) <= set(steps), sorted(steps)
    # Present; not asserted empty: on a loaded machine the restart's catch-up can make one
    # rank genuinely slower for a window, which the detector rightly reports.
    assert isinstance(report["stragglers"], list)
    # The checkpoint records its compressor, which a --resume with another one is refused by.
    store = CheckpointStore(out / "checkpoints")
    newest = store.latest()
    assert newest is not None and store.load(newest, 0)["compression"] == "none"


@pytest.mark.timeout(240)
def test_a_resume_after_a_torn_metrics_line_goes_on(
    tmp_path: Path, one_rank_run: SharedRun
) -> None:
    # The shared one-rank run (tests/e2e/conftest.py: 10 steps, a checkpoint every 5), copied.
    out = one_rank_run.copy(tmp_path / "run")
    flags = ["--workload", "mlp", "--params", "20000", "--nproc", "1", "--out", str(out)]
    flags += ["--checkpoint-every", "5", "--no-plots", "--no-progress"]
    torn = json.loads(tear_last_line(out / METRICS_FILE))
    cmd = [sys.executable, "-m", "gradsync", "run", *flags, "--steps", "14", "--resume"]
    more = subprocess.run(cmd, capture_output=True, text=True, timeout=180)
    assert more.returncode == 0, more.stderr[-3000:]
    notice = [line for line in more.stderr.splitlines() if "dropped its last line" in line]
    assert len(notice) == 1 and str(out / METRICS_FILE) in notice[0], more.stderr[-3000:]
    assert notice[0].startswith("gradsync: "), notice[0]
    steps = [d["step"] for d in map(json.loads, (out / METRICS_FILE).read_text().splitlines())]
    assert sorted(steps) == [s for s in range(14) if s != torn["step"]]
    assert json.loads((out / "report.json").read_text())["steps"] == 13
