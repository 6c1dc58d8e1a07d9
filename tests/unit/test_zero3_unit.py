"""ZeRO stage 3 (``zero:3``, FSDP2 underneath): the units are the blocks of a sequential, and
none with a shared parameter. On ranks: tests/ranks/test_zero3.py."""

from __future__ import annotations

import pytest
import torch

from gradsync import compat
from gradsync.strategies import parse_strategy
from gradsync.strategies.zero3 import ZeroStage3, _units
from gradsync.workloads import make_workload
from tests.support import rank_device

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(compat.fsdp2() is None, reason="this torch has no FSDP2"),
    rank_device.not_on_device(
        "zero:3 refuses a GPU model over gloo, whose collectives FSDP2 needs for CUDA tensors "
        "(tests/ranks/test_gpu_ranks.py checks the refusal)"
    ),
]


def test_the_units_are_the_blocks_of_a_sequential_and_none_with_a_shared_parameter() -> None:
    mlp = make_workload("mlp", seed=0, params=5000).build_model()
    assert _units(mlp) == [m for m in mlp if next(m.parameters(), None) is not None]
    charlm = make_workload("charlm", seed=0).build_model()
    assert _units(charlm) == list(charlm.blocks)  # type: ignore[union-attr]
    tied = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    tied[1].weight = tied[0].weight
    assert _units(tied) == []
    stage = parse_strategy("zero:3")
    assert isinstance(stage, ZeroStage3) and not stage.resizable and not stage.weights_samples
