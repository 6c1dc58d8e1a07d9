"""The example runs as its first line says: under plain torchrun, not gradsync's launcher."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_charlm.py"


def _torchrun() -> list[str]:
    """The torchrun of the interpreter running the tests (the venv's), not one on PATH."""
    script = Path(sys.executable).parent / "torchrun"
    return [str(script)] if script.exists() else [sys.executable, "-m", "torch.distributed.run"]


def test_example_opens_with_the_command_this_test_runs() -> None:
    first = EXAMPLE.read_text().splitlines()[0]
    assert (
        first == "# torchrun --standalone --nproc_per_node=4 examples/train_charlm.py --steps 100"
    )


@pytest.mark.timeout(180)
def test_example_trains_under_plain_torchrun() -> None:
    # --standalone: a c10d rendezvous on localhost with a free port, so runs cannot collide.
    cmd = [*_torchrun(), "--standalone", "--nproc_per_node=2", str(EXAMPLE), "--steps", "3"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # A session of its own, so a hung run is killed with its workers, not just torchrun.
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )
    try:
        out, _ = proc.communicate(timeout=150)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        pytest.fail(f"example did not finish in 150 s:\n{out[-3000:]}")
    assert proc.returncode == 0, out[-3000:]
    first = re.search(r"^step 0 loss (\d+\.\d+)$", out, re.MULTILINE)
    final = re.search(r"^final loss: (\d+\.\d+)$", out, re.MULTILINE)
    assert first and final, out[-3000:]
    # Three AdamW steps from a fresh model: the loss must have moved down.
    assert float(final.group(1)) < float(first.group(1))
    assert "pace-setter: rank" in out
