"""gradsync with the model on a CUDA device (issue 18), on 2 gloo ranks: skipped where no GPU is
visible.

One GPU cannot host two NCCL ranks, so the multi-rank checks run 2 gloo ranks sharing the
device (gloo reduces CUDA tensors through host memory) and are compared with the same run on
the CPU; NCCL is checked with one rank under torchrun in tests/e2e/test_gpu.py. Set
``GRADSYNC_GPU_TEST_DEVICE=cpu`` to dry-run these tests on a machine without one."""

from __future__ import annotations

import functools
from typing import Any

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support.gpu_ranks import (
    EXACT,
    FAMILIES,
    TWO_RANK_CONFIGS,
    configs_on_both_devices,
    device_under_test,
    refusal,
)

DEVICE = device_under_test()
pytestmark = [pytest.mark.ranks, pytest.mark.skipif(DEVICE is None, reason="needs a CUDA device")]


@functools.cache
def _family(name: str) -> list[Any]:
    """Every configuration of a family on 2 gloo ranks, on the device and on the CPU, in one
    launch; a rank that died is a ``RankFailure`` in its slot."""
    return run_ranks(
        configs_on_both_devices, 2, DEVICE, list(FAMILIES[name]), timeout_s=280,
        collective_timeout_s=60, allow_failures=True,
    )  # fmt: skip


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
    cpu, init = workers[0]["cpu"]["params"], workers[0]["cpu"]["init"]
    # Against how far training moved the parameters (8 steps moved them about 6% of their
    # norm): the same arithmetic in another order stays close where nothing is rounded to few
    # bits or selected by rank (a near tie can pick another element, a quantization step
    # another bin, a device's generator other rounding noise); a wrong decode is off by ~1.
    gap = float((on_device[0] - cpu).norm() / (cpu - init).norm())
    assert gap < (1e-2 if (compression or "none") in EXACT else 0.5), gap


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
