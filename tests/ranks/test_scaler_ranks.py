"""Mixed precision on gloo ranks: a GradScaler drives gradsync's update exactly as it drives
DDP's; a parameter server refuses one, saying why."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import scaler_ranks

pytestmark = pytest.mark.ranks


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


@pytest.mark.timeout(60)
def test_a_parameter_server_refuses_a_grad_scaler_saying_why() -> None:
    for message in run_ranks(scaler_ranks.scaler_with_a_parameter_server, 2):
        assert "a GradScaler cannot drive async" in message
