"""A parameter frozen when the Synchronizer was built and unfrozen later is refused, naming it,
at the next divergence check: its gradient is no strategy's to exchange, so the replicas would
drift apart (a user-tester's finding: under bsp, zero:1 and zero:2 alike, the run went on until
the divergence check reported a difference in that parameter, up to ``check_every`` steps
later, without saying why)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 1))


def _step(sync: gs.Synchronizer, model: nn.Module) -> None:
    with sync.step():
        model(torch.ones(2, 4)).sum().backward()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["bsp", "local:2"])
def test_a_parameter_unfrozen_after_the_build_is_refused_naming_it(
    one_rank: None, strategy: str
) -> None:
    model = _model()
    for p in model[1].parameters():
        p.requires_grad_(False)
    sync = gs.Synchronizer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy, check_every=2
    )
    try:
        _step(sync, model)
        _step(sync, model)  # checked: nothing unfrozen yet
        model[1].weight.requires_grad_(True)
        _step(sync, model)
        with pytest.raises(UsageError, match=r"parameter '1\.weight' was frozen .* trains now"):
            _step(sync, model)
    finally:
        sync.close()


@pytest.mark.timeout(120)
def test_parameters_frozen_throughout_or_frozen_later_are_not_refused(one_rank: None) -> None:
    model = _model()
    model[1].weight.requires_grad_(False)
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), check_every=1)
    try:
        _step(sync, model)
        model[2].bias.requires_grad_(False)  # frozen after the build: its gradient is just absent
        _step(sync, model)
        sync.report()
    finally:
        sync.close()
