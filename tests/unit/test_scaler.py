"""Mixed precision: the GradScaler's checks in one process (large finite gradients, an optimizer
stepped again, what a scaler must be). Against DDP on ranks: tests/ranks/test_scaler_ranks.py."""

from __future__ import annotations

import pytest
import torch

import gradsync as gs
from gradsync.checks.guards import is_finite
from gradsync.errors import UsageError
from gradsync.workloads import make_workload

pytestmark = pytest.mark.unit


def test_large_finite_gradients_are_not_taken_for_non_finite_ones() -> None:
    big = torch.full((1000,), 1e37)  # finite, but their float32 sum overflows
    assert not torch.isfinite(big.sum())
    assert is_finite(big)
    big[7] = float("inf")
    assert not is_finite(big)


def test_an_optimizer_stepped_again_after_the_block_is_refused(one_rank: None) -> None:
    w = make_workload("mlp", seed=0, params=2000)
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu")
    sync = gs.Synchronizer(model, opt, scaler=scaler)
    with sync.step():
        scaler.scale(w.loss(model, *w.batch(0, 4, 0, 4))).backward()
    scaler.step(opt)  # kept from the DDP script: the second update of this step
    scaler.update()
    with pytest.raises(UsageError, match=r"optimizer.step\(\) ran 1 time\(s\) after step 0"):
        sync.step().__enter__()
    sync.close()


def test_an_optimizer_stepped_inside_the_block_is_refused_as_the_block_exits(
    one_rank: None,
) -> None:
    """A port that kept optimizer.step() inside the block: the exit's update is the second of
    the step (a tester's finding: silently, the parameters moved twice, as a DDP loop stepping
    twice would). Refused once the step is complete; the next step is not refused again."""
    w = make_workload("mlp", seed=0, params=2000)
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = gs.Synchronizer(model, opt)
    refused = pytest.raises(UsageError, match=r"optimizer.step\(\) ran 1 time\(s\) inside step 0's")
    with refused, sync.step():
        w.loss(model, *w.batch(0, 4, 0, 4)).backward()
        opt.step()
    with sync.step():  # counted once: a caught error does not follow the loop
        w.loss(model, *w.batch(1, 4, 0, 4)).backward()
    assert sync.step_count == 2
    sync.close()


def test_a_scaler_must_be_a_grad_scaler(one_rank: None) -> None:
    w = make_workload("mlp", seed=0, params=2000)
    model = w.build_model()
    with pytest.raises(UsageError, match="scaler must be a torch.amp.GradScaler or None, got str"):
        gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler="fp16")
