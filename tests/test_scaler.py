"""Mixed precision: a GradScaler drives gradsync's update exactly as it drives DDP's."""

from __future__ import annotations

import pytest
import torch

import gradsync as gs
from gradsync.checks.guards import is_finite
from gradsync.errors import UsageError
from gradsync.testing import run_ranks
from gradsync.workloads import make_workload
from tests import scaler_ranks


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_bsp_with_a_grad_scaler_ends_bitwise_equal_to_ddp_with_one() -> None:
    for out in run_ranks(scaler_ranks.scaler_against_ddp, 2):
        ours, ddp = out["gradsync"], out["ddp"]
        assert torch.equal(ours["params"], ddp["params"])
        assert ours["scales"] == ddp["scales"]
        # One skip, the infinite step, on both ranks; the scale backed off there and grew later.
        expected = [step == scaler_ranks.INF_STEP for step in range(scaler_ranks.STEPS)]
        assert ours["skipped"] == ddp["skipped"] == expected
        assert ours["scales"][-1] > ours["scales"][scaler_ranks.INF_STEP]


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_a_parameter_server_refuses_a_grad_scaler_saying_why() -> None:
    for message in run_ranks(scaler_ranks.scaler_with_a_parameter_server, 2):
        assert "a GradScaler cannot drive async" in message


@pytest.mark.unit
def test_large_finite_gradients_are_not_taken_for_non_finite_ones() -> None:
    big = torch.full((1000,), 1e37)  # finite, but their float32 sum overflows
    assert not torch.isfinite(big.sum())
    assert is_finite(big)
    big[7] = float("inf")
    assert not is_finite(big)


@pytest.mark.unit
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


@pytest.mark.unit
def test_a_scaler_must_be_a_grad_scaler(one_rank: None) -> None:
    w = make_workload("mlp", seed=0, params=2000)
    model = w.build_model()
    with pytest.raises(UsageError, match="scaler must be a torch.amp.GradScaler or None, got str"):
        gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), scaler="fp16")
