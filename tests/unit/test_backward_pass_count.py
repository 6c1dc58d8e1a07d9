"""``sync.step(micro_batches=K)`` divides the gradient by K: a block that runs another number of
backward passes is refused under every strategy, not trained on with a scaled update (bsp and
zero:1/2 counted them before; the tester found local:H, diloco:H and zero:3 halving the update
for one pass of two). zero:3 counts FSDP2's reduce-scatters, which a world of one does not
post, and the parameter-server workers need server ranks: both on two ranks,
tests/ranks/test_errors_ranks.py."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit

STRATEGIES = ("bsp", "local:2", "diloco:2", "hogwild")


def _sync(strategy: str) -> tuple[gs.Synchronizer, nn.Module]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Linear(3, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    return gs.Synchronizer(model, opt, strategy=strategy), model


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_another_number_of_backward_passes_is_refused(one_rank: None, strategy: str) -> None:
    sync, model = _sync(strategy)
    x = torch.ones(2, 4)
    try:
        for ran in (1, 0, 3):
            refused = pytest.raises(
                UsageError, match=f"micro_batches=2\\) but the block ran {ran} "
            )
            with refused, sync.step(micro_batches=2):
                for _ in range(ran):
                    sync.model(x).sum().backward()
        before = [p.detach().clone() for p in model.parameters()]
        with sync.step(micro_batches=2):  # the announced count still trains
            for _ in range(2):
                sync.model(x).sum().backward()
        after = list(model.parameters())
        assert any(not torch.equal(a, b) for a, b in zip(after, before, strict=True))
    finally:
        sync.close()
