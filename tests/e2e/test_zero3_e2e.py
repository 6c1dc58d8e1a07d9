"""ZeRO stage 3 through ``gradsync run``: it matches bsp and resumes after a kill."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync import compat
from tests.support import rank_device

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(compat.fsdp2() is None, reason="this torch has no FSDP2"),
    rank_device.not_on_device(
        "zero:3 refuses a GPU model over gloo, whose collectives FSDP2 needs for CUDA tensors "
        "(tests/ranks/test_gpu_ranks.py checks the refusal)"
    ),
]


@pytest.mark.timeout(240)
def test_gradsync_run_with_zero3_matches_bsp_and_resumes_after_a_kill(tmp_path: Path) -> None:
    def run(strategy: str, out: Path, *extra: str) -> dict[str, Any]:
        cmd = [sys.executable, "-m", "gradsync", "run", "--nproc", "2", "--workload", "mlp",
               "--strategy", strategy, "--steps", "12", "--seed", "7", "--out", str(out),
               "--no-plots", "--no-progress", "--timeout", "60", *extra]  # fmt: skip
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
        assert done.returncode == 0, done.stderr[-3000:]
        return json.loads((out / "report.json").read_text())

    bsp = run("bsp", tmp_path / "bsp")
    killed = run(
        "zero:3", tmp_path / "z3", "--checkpoint-every", "1", "--kill", "1:6", "--max-restarts", "1"
    )
    assert killed["steps"] == bsp["steps"]
    assert killed["final_loss"] == pytest.approx(bsp["final_loss"], rel=1e-5)
    # The final model is whole (rank 0 gathered the shards), and the same as bsp's.
    ours = torch.load(tmp_path / "z3" / "final_model.pt", weights_only=True)
    theirs = torch.load(tmp_path / "bsp" / "final_model.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].shape == theirs[k].shape
        assert torch.allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-6), k
