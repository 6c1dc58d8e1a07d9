"""Models and set-ups users bring: tied weights, torch.compile, LR schedulers, bf16 autocast,
clipping."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import interop_ranks

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
def test_tied_weights_with_a_scheduler_are_bitwise_equal_to_ddp() -> None:
    for out in run_ranks(interop_ranks.tied_weights_against_ddp, 2, False):
        assert out["tied"]
        assert out["gradsync"].keys() == out["ddp"].keys()
        for name, value in out["ddp"].items():
            assert torch.equal(out["gradsync"][name], value), name


@pytest.mark.timeout(120)
def test_bf16_autocast_and_max_norm_clipping_are_bitwise_equal_to_ddp() -> None:
    for out in run_ranks(interop_ranks.tied_weights_against_ddp, 2, False, True):
        for name, value in out["ddp"].items():
            assert torch.equal(out["gradsync"][name], value), name


@pytest.mark.timeout(180)
def test_a_compiled_model_trains_as_the_eager_one() -> None:
    for out in run_ranks(interop_ranks.tied_weights_against_ddp, 2, True, timeout_s=170):
        for name, value in out["ddp"].items():
            torch.testing.assert_close(out["gradsync"][name], value, rtol=1e-5, atol=1e-6)
