"""gradsync with the model on a CUDA device (issue 18), one rank on NCCL under torchrun (the
script is tests/support/gpu_nccl.py): skipped where no GPU is visible. Two gloo ranks sharing
the device: tests/ranks/test_gpu_ranks.py. Set ``GRADSYNC_GPU_TEST_DEVICE=cpu`` to dry-run these
tests on a machine without one."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.support.gpu_ranks import (
    device_under_test,
)
from tests.support.torchrun import torchrun

DEVICE = device_under_test()
pytestmark = [pytest.mark.e2e, pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device")]
ROOT = Path(__file__).resolve().parents[2]
SCRIPT = str(ROOT / "tests" / "support" / "gpu_nccl.py")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _one_rank(phase: str, directory: Path, timeout_s: float = 150) -> dict[str, Any]:
    """``tests/support/gpu_nccl.py PHASE`` under torchrun with one process; its result."""
    out = torchrun(
        ["--standalone", "--nproc-per-node", "1", SCRIPT, phase, str(directory)], _env(), timeout_s
    )
    print(out[-3000:])  # shown with -rA: the figures behind a pass
    return json.loads((directory / f"{phase}.json").read_text())


@pytest.mark.timeout(200)
def test_one_rank_on_nccl_trains_the_dial_and_every_compressor(tmp_path: Path) -> None:
    result = _one_rank("dial", tmp_path)
    if DEVICE == "cuda":
        assert result["backend"] == "nccl"
    failed = {k: v["error"] for k, v in result.items() if isinstance(v, dict) and "error" in v}
    assert not failed, json.dumps(failed, indent=1)
    for key, run in result.items():
        if key == "backend":
            continue
        assert run["devices"] == [torch.device(DEVICE).type], (key, run)
        assert run["steps"] == 8 and run["losses"][-1] < run["losses"][0], (key, run)


@pytest.mark.timeout(200)
def test_device_steps_are_timed_on_the_device_not_by_their_launch(tmp_path: Path) -> None:
    t = _one_rank("timing", tmp_path)
    if DEVICE == "cpu":
        return  # the dry run checks the plumbing: on the CPU, launch is the time
    # The host returns from backward long before the device is done: a host clock would
    # report the launch time. The telemetry's compute is the device's.
    assert t["launch"] < 0.5 * t["synced"], t
    assert 0.7 * t["synced"] < t["compute"] < 1.3 * t["synced"], t
    # synchronize() in the block waits on the host for the backward too: not sync time.
    assert 0.7 * t["synced"] < t["compute_with_synchronize"] < 1.3 * t["synced"], t
    # torch.profiler's kernels per step against the telemetry's whole step.
    kernels = t["profiler_kernels"]
    assert 0.7 * kernels < t["compute"] + t["sync"] < 1.5 * kernels, t


@pytest.mark.timeout(300)
def test_a_checkpoint_saved_on_the_device_loads_on_the_cpu_and_back(tmp_path: Path) -> None:
    saved = _one_rank("save", tmp_path)
    assert saved["device"].startswith(DEVICE), saved
    done = subprocess.run(
        [sys.executable, SCRIPT, "cpu", str(tmp_path)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    cpu = json.loads((tmp_path / "cpu.json").read_text())
    assert cpu["device"] == "cpu" and cpu["on_device"] == ["cpu"], cpu
    assert cpu["bitwise"], "the state loaded on the CPU differs from the state saved"
    back = _one_rank("back", tmp_path)
    assert back["on_device"] == [torch.device(DEVICE).type], back
    assert back["bitwise"], "the state loaded back on the device differs from the CPU's"
    assert back["step"] == 12 and back["loss"] == back["loss"], back
