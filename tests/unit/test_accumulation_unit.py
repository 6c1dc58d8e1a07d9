"""The accumulation conventions (``accumulation="mean"`` / ``"sum"``): an unknown one is refused
naming the valid ones. The two conventions compared on ranks: tests/ranks/test_accumulation.py."""

from __future__ import annotations

import pytest
import torch

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.workloads import make_workload

pytestmark = pytest.mark.unit


def test_an_unknown_accumulation_names_the_valid_ones(one_rank: None) -> None:
    w = make_workload("mlp", seed=0, params=2000)
    model = w.build_model()
    with pytest.raises(UsageError, match="accumulation must be one of mean, sum, got 'avg'"):
        gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), accumulation="avg")
