"""A DDP script and its gradsync port (examples/ddp_lm.py, examples/ddp_lm_gradsync.py): a small
diff, and under bsp the same final parameters, bit for bit."""

from __future__ import annotations

import difflib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.torchrun import ROOT, torchrun

ORIGINAL = ROOT / "examples" / "ddp_lm.py"
PORT = ROOT / "examples" / "ddp_lm_gradsync.py"
HEADER = 2  # each file's first two lines name the file itself: its command and docstring


def changed_lines() -> tuple[int, int]:
    """(lines of the DDP script the port removes or rewrites, lines it adds), headers aside."""
    a = ORIGINAL.read_text().splitlines()[HEADER:]
    b = PORT.read_text().splitlines()[HEADER:]
    diff = list(difflib.unified_diff(a, b, lineterm="", n=0))[2:]
    removed = sum(1 for line in diff if line.startswith("-"))
    added = sum(1 for line in diff if line.startswith("+"))
    return removed, added


@pytest.mark.unit
def test_the_port_changes_at_most_15_lines_of_the_ddp_script() -> None:
    removed, added = changed_lines()
    assert removed <= 15 and added <= 15, (removed, added)
    assert ORIGINAL.read_text().splitlines()[0].endswith("examples/ddp_lm.py --steps 40")
    assert PORT.read_text().splitlines()[0].endswith("examples/ddp_lm_gradsync.py --steps 40")


@pytest.mark.e2e
@pytest.mark.timeout(240)
def test_the_port_ends_bitwise_equal_to_the_ddp_script(tmp_path: Path) -> None:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    finals = {}
    for script in (ORIGINAL, PORT):
        out = tmp_path / script.stem
        args = ["--standalone", "--nproc_per_node=2", str(script), "--steps", "8"]
        log = torchrun([*args, "--eval-every", "4", "--out", str(out)], env, timeout_s=110)
        assert "step 8 train loss" in log, log[-2000:]
        assert (out / "checkpoint.pt").exists()  # rank 0's evaluation and checkpoint ran
        finals[script.stem] = torch.load(out / "final.pt", weights_only=True)
    ddp, ours = finals["ddp_lm"], finals["ddp_lm_gradsync"]
    assert ddp.keys() == ours.keys()
    for name in ddp:
        assert torch.equal(ddp[name], ours[name]), name


@pytest.mark.e2e
@pytest.mark.timeout(120)
def test_the_port_also_runs_as_plain_python(tmp_path: Path) -> None:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}
    args = [str(PORT), "--steps", "2", "--eval-every", "2", "--out", str(tmp_path)]
    done = subprocess.run(
        [sys.executable, *args],
        env={**env, "OMP_NUM_THREADS": "1"},
        capture_output=True,
        text=True,
        timeout=110,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert "step 2 train loss" in done.stdout
