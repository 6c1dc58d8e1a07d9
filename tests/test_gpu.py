"""gradsync with the model on a CUDA device (issue 18): skipped where no GPU is visible.

One GPU cannot host two NCCL ranks, so the multi-rank checks run 2 gloo ranks sharing the
device (gloo reduces CUDA tensors through host memory) and are compared with the same run on
the CPU, and NCCL is checked with one rank under torchrun. Set
``GRADSYNC_GPU_TEST_DEVICE=cpu`` to dry-run these tests on a machine without one.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.testing import run_ranks
from tests.gpu_ranks import (
    DRAWN_ON_DEVICE,
    EXACT,
    FAMILIES,
    TWO_RANK_CONFIGS,
    configs_on_both_devices,
    device_under_test,
    refusal,
)
from tests.torchrun import torchrun

DEVICE = device_under_test()
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device")
ROOT = Path(__file__).resolve().parent.parent
SCRIPT = str(ROOT / "tests" / "gpu_nccl.py")
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in TORCHRUN_ENV}
    env["OMP_NUM_THREADS"] = "1"
    return env


def _one_rank(phase: str, directory: Path, timeout_s: float = 150) -> dict[str, Any]:
    """``tests/gpu_nccl.py PHASE`` under torchrun with one process; its result."""
    out = torchrun(
        ["--standalone", "--nproc-per-node", "1", SCRIPT, phase, str(directory)], _env(), timeout_s
    )
    print(out[-3000:])  # shown with -rA: the figures behind a pass
    return json.loads((directory / f"{phase}.json").read_text())


@functools.cache
def _family(name: str) -> list[Any]:
    """Every configuration of a family on 2 gloo ranks, on the device and on the CPU, in one
    launch; a rank that died is a ``RankFailure`` in its slot."""
    return run_ranks(
        configs_on_both_devices, 2, DEVICE, list(FAMILIES[name]), timeout_s=280,
        collective_timeout_s=60, allow_failures=True,
    )  # fmt: skip


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("family", "strategy", "compression"), TWO_RANK_CONFIGS)
def test_two_gloo_ranks_on_one_device_train_like_the_cpu(
    family: str, strategy: str, compression: str | None
) -> None:
    results = _family(family)
    for rank, result in enumerate(results):
        assert not isinstance(result, Exception), f"rank {rank} ({family} launch): {result}"
    runs = [result[strategy, compression] for result in results]
    for rank, run in enumerate(runs):
        for where, got in run.items():
            assert not isinstance(got, str), f"rank {rank} on {where}:\n{got}"
    workers = [run for run in runs if "params" in run[DEVICE]]
    on_device = [run[DEVICE]["params"] for run in workers]
    assert all(torch.isfinite(p).all() for p in on_device)
    # Replicas agree at the end on the device, as on the CPU.
    for params in on_device[1:]:
        torch.testing.assert_close(params, on_device[0], rtol=0, atol=1e-6)
    losses = workers[0][DEVICE]["losses"]
    assert losses[-1] < losses[0], losses
    # Telemetry timed every step on the device.
    assert all(c > 0 for c in workers[0][DEVICE]["compute"]), workers[0][DEVICE]["compute"]
    if compression in DRAWN_ON_DEVICE:
        return
    cpu, init = workers[0]["cpu"]["params"], workers[0]["cpu"]["init"]
    # Against how far training moved the parameters (8 steps moved them about 6% of their
    # norm): the same arithmetic in another order stays close where nothing is rounded to few
    # bits or selected by rank (a near tie can pick another element, a quantization step
    # another bin, a device's generator other rounding noise); a wrong decode is off by ~1.
    gap = float((on_device[0] - cpu).norm() / (cpu - init).norm())
    assert gap < (1e-2 if (compression or "none") in EXACT else 0.5), gap


@pytest.mark.ranks
@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("strategy", "expected"),
    [("hogwild", "Keep the model on the CPU"), ("zero:3", "use NCCL")],
)
def test_a_strategy_that_cannot_run_on_the_device_over_gloo_says_so(
    strategy: str, expected: str
) -> None:
    if DEVICE == "cpu":
        pytest.skip("the dry run has no device to refuse")
    messages = run_ranks(refusal, 2, DEVICE, strategy, timeout_s=100)
    assert all("cuda" in m and expected in m for m in messages), messages


@pytest.mark.e2e
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


@pytest.mark.e2e
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


@pytest.mark.e2e
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
