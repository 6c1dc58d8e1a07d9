"""ZeRO stage 3 through ``gradsync run``: it matches bsp and resumes after a kill."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from gradsync import compat
from tests.support import rank_device
from tests.support.shared_runs import FAULT_COMMON, SharedRun

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(compat.fsdp2() is None, reason="this torch has no FSDP2"),
    rank_device.not_on_device(
        "zero:3 refuses a GPU model over gloo, whose collectives FSDP2 needs for CUDA tensors "
        "(tests/ranks/test_gpu_ranks.py checks the refusal)"
    ),
]


@pytest.mark.timeout(240)
def test_gradsync_run_with_zero3_matches_bsp_and_resumes_after_a_kill(
    tmp_path: Path, clean_bsp_run: SharedRun
) -> None:
    # bsp's run is the one test_fault_e2e compares with too (tests/e2e/conftest.py): the same
    # 2 ranks, workload and steps as zero:3's here
    out = tmp_path / "z3"
    cmd = [sys.executable, "-m", "gradsync", "run", "--nproc", "2", *FAULT_COMMON,
           "--strategy", "zero:3", "--out", str(out), "--timeout", "60",
           "--checkpoint-every", "1", "--kill", "1:6", "--max-restarts", "1"]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=200)
    assert done.returncode == 0, done.stderr[-3000:]
    killed = json.loads((out / "report.json").read_text())
    bsp = json.loads((clean_bsp_run.out / "report.json").read_text())
    assert killed["steps"] == bsp["steps"]
    assert killed["final_loss"] == pytest.approx(bsp["final_loss"], rel=1e-5)
    # The final model is whole (rank 0 gathered the shards), and the same as bsp's.
    ours = torch.load(out / "final_model.pt", weights_only=True)
    theirs = torch.load(clean_bsp_run.out / "final_model.pt", weights_only=True)
    assert ours.keys() == theirs.keys()
    for k in ours:
        assert ours[k].shape == theirs[k].shape
        assert torch.allclose(ours[k], theirs[k], rtol=1e-4, atol=1e-6), k
