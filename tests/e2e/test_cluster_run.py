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
def test_a_script_on_two_emulated_hosts_matches_loopback_and_cleans_up(tmp_path: Path) -> None:
    """A user's script (the built-in workloads are one too, started the same way) on two
    emulated hosts ends where the same script on loopback ends."""
    script = Path(__file__).resolve().parent.parent / "support" / "user_script.py"
    args = ["--nproc", "2", "--no-plots", "--no-progress"]
    command = ["--", str(script), "12", "{run_dir}/ckpt", "{run_dir}/final.pt"]
    slow = gradsync(
        "run", "--hosts", "2", "--link", "200mbit", "--out", str(tmp_path / "h"), *args, *command
    )
    assert slow.returncode == 0, slow.stderr[-3000:]
    local = gradsync("run", "--out", str(tmp_path / "l"), *args, *command)
    assert local.returncode == 0, local.stderr[-3000:]
    a = json.loads((tmp_path / "h" / "report.json").read_text())
    b = json.loads((tmp_path / "l" / "report.json").read_text())
    assert a["final_loss"] == b["final_loss"]  # same math, only the network differs
    assert a["steps"] == 12 and len(a["ranks"]) == 2
    assert (tmp_path / "h" / "final.pt").exists()  # the script's own output, in its run dir
    netns = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert "gs-" not in netns
