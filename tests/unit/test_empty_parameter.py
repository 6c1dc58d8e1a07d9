"""A parameter with no elements (``nn.Parameter(torch.empty(0))``): zero:2 trains as bsp does
(it raised a bare KeyError in backward), zero:3 refuses it by name at construction (FSDP2
failed inside the first step)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit


class WithEmpty(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 1)
        self.empty = nn.Parameter(torch.empty(0))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.lin(x).sum() + self.empty.sum()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("strategy", ["bsp", "zero:1", "zero:2"])
def test_a_parameter_with_no_elements_trains(one_rank: None, strategy: str) -> None:
    torch.manual_seed(0)
    model = WithEmpty()
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy)
    before = model.lin.weight.detach().clone()
    try:
        for _ in range(2):
            with sync.step():
                sync.model(torch.ones(3, 4)).backward()
    finally:
        sync.close()
    assert not torch.equal(model.lin.weight, before)


@pytest.mark.timeout(60)
def test_zero3_refuses_a_parameter_with_no_elements_by_name(one_rank: None) -> None:
    model = WithEmpty()
    with pytest.raises(UsageError, match="no elements: 'empty'; .* use zero:2"):
        gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), "zero:3")
