"""`gradsync run --hosts`: the training workers on an emulated cluster, end to end."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from gradsync.cluster import requirements_missing
from tests.support.cli import gradsync

pytestmark = pytest.mark.e2e

MISSING = requirements_missing()


@pytest.mark.skipif(MISSING is not None, reason=f"emulated cluster unavailable: {MISSING}")
@pytest.mark.timeout(240)
def test_run_on_two_emulated_hosts_matches_loopback_and_cleans_up(tmp_path: Path) -> None:
    args = ["--nproc", "2", "--workload", "mlp", "--steps", "12", "--no-plots", "--no-progress"]
    slow = gradsync("run", "--hosts", "2", "--link", "200mbit", "--out", str(tmp_path / "h"), *args)
    assert slow.returncode == 0, slow.stderr[-3000:]
    local = gradsync("run", "--out", str(tmp_path / "l"), *args)
    assert local.returncode == 0, local.stderr[-3000:]
    a = json.loads((tmp_path / "h" / "report.json").read_text())
    b = json.loads((tmp_path / "l" / "report.json").read_text())
    assert a["final_loss"] == b["final_loss"]  # same math, only the network differs
    assert a["steps"] == 12 and len(a["ranks"]) == 2
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "gs-" not in netns


def test_hosts_flag_validation() -> None:
    bad = gradsync("run", "--hosts", "3", "--nproc", "2", timeout=60)
    assert bad.returncode == 2 and "do not split evenly over --hosts 3" in bad.stderr
    rate = gradsync("run", "--hosts", "2", "--link", "fast", "--nproc", "2", timeout=60)
    assert rate.returncode == 2 and "bad link rate 'fast'" in rate.stderr


@pytest.mark.skipif(MISSING is not None, reason=f"emulated cluster unavailable: {MISSING}")
@pytest.mark.timeout(240)
def test_a_user_script_runs_on_the_emulated_hosts_too(tmp_path: Path) -> None:
    script = Path(__file__).resolve().parent.parent / "support" / "user_script.py"
    out = tmp_path / "h"
    run = gradsync(
        "run", "--hosts", "2", "--nproc", "2", "--no-plots", "--out", str(out), "--",
        str(script), "12", "{run_dir}/ckpt", "{run_dir}/final.pt",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert report["steps"] == 12 and len(report["ranks"]) == 2
    assert (out / "final.pt").exists()  # the script's own output, in its run directory
