"""``gradsync run`` then ``gradsync checkpoint export``: the export is the run's final model."""

from __future__ import annotations

import functools
import warnings
from pathlib import Path

import pytest
import torch
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import gradsync as gs
from gradsync.checkpoint import CheckpointWarning
from tests.support.cli import gradsync
from tests.support.export import assert_same, dcp_load
from tests.support.overlap import overlapped

pytestmark = pytest.mark.e2e


# -- end to end: gradsync run, then gradsync checkpoint export -------------------------------------


@pytest.mark.timeout(300)
def test_a_run_exported_by_the_command_is_its_final_model(tmp_path: Path, one_rank: None) -> None:
    """``gradsync run --nproc 2 --workload charlm --steps 6 --checkpoint-every 3``, then
    ``gradsync checkpoint export``: the exported model loads strictly into a fresh charlm and
    is bitwise the run's final model; the optimizer state loads into a fresh optimizer and is
    what ``sync.load`` of the same checkpoint gives one rank (bsp resumes on another world
    size); DCP gives the same tensors."""
    from gradsync.workloads import make_workload

    run = tmp_path / "run"
    flags = ["--workload", "charlm", "--steps", "6", "--checkpoint-every", "3", "--no-plots"]
    proc = gradsync("run", "--nproc", "2", "--out", str(run), *flags, "--no-progress", timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "charlm.pt"
    # the two exports read the run and write files of their own: started at once
    # (tests/support/overlap.py), each a process of one core's work on 2 cores
    exports = {
        "torch": functools.partial(
            gradsync, "checkpoint", "export", str(run), str(out), timeout=120
        ),
        "dcp": functools.partial(
            gradsync, "checkpoint", "export", str(run / "checkpoints"),
            str(tmp_path / "charlm.dcp"), "--to", "dcp", timeout=120,
        ),
    }  # fmt: skip
    with overlapped(exports) as done:
        proc = done.result("torch")
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "exported the checkpoint of step 6 (bsp, 2 ranks" in proc.stderr
        proc = done.result("dcp")
        assert proc.returncode == 0, proc.stderr[-3000:]

    exported = torch.load(out, weights_only=True)
    assert exported["step"] == 6 and exported["extra"] == {"data_position": 6}
    workload = make_workload("charlm", seed=0)
    model = workload.build_model()
    model.load_state_dict(exported["model"], strict=True)
    final = torch.load(run / "final_model.pt", weights_only=True)
    assert_same(model.state_dict(), final, "the run's final model")
    optimizer = workload.make_optimizer(model, workload.default_lr)
    optimizer.load_state_dict(exported["optimizer"])

    # gradsync's own loader, on one rank, of the same checkpoint
    resumed_model = workload.build_model()
    resumed_optimizer = workload.make_optimizer(resumed_model, workload.default_lr)
    sync = gs.Synchronizer(resumed_model, resumed_optimizer, strategy="bsp", timeout_s=60)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            assert sync.load(run / "checkpoints") is not None
    finally:
        sync.close()
    assert_same(model.state_dict(), resumed_model.state_dict(), "sync.load's model")
    assert_same(optimizer.state_dict(), resumed_optimizer.state_dict(), "sync.load's optimizer")

    fresh = workload.build_model()
    template = {"model": fresh.state_dict()}
    dcp_load(tmp_path / "charlm.dcp", template)
    assert_same(fresh.state_dict(), final, "DCP's model, loaded in place")
    dcp_to_torch_save(tmp_path / "charlm.dcp", tmp_path / "from-dcp.pt")
    whole = torch.load(tmp_path / "from-dcp.pt", weights_only=True)
    whole["optimizer"]["state"] = {int(k): v for k, v in whole["optimizer"]["state"].items()}
    assert_same(whole, exported, "DCP, read back whole")
