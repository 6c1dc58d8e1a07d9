"""``find_unused_parameters=True`` as DDP's under bsp: a parameter that no rank used in a step
keeps ``grad`` None, so an optimizer with momentum and weight decay leaves it alone; one used
on one rank, or only in a ``no_sync()`` micro-batch, is exchanged as usual (a tester found the
unused one moving under gradsync where DDP left it still)."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import unused_ranks

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
def test_the_front_door_ends_bit_for_bit_where_ddp_does_with_unused_parameters() -> None:
    for out in run_ranks(unused_ranks.front_door_against_ddp, 2, timeout_s=110):
        for name, value in out["ddp"].items():
            assert torch.equal(out["ours"][name], value), name
        assert torch.equal(out["ddp"]["never.weight"], out["init"]["never.weight"])
        # without the flag the unused parameter decays (zero gradient, weight decay)
        assert not torch.equal(out["without"]["never.weight"], out["init"]["never.weight"])


@pytest.mark.timeout(60)
def test_the_unused_parameter_has_no_gradient_at_the_gradient_ready_point() -> None:
    for grads in run_ranks(unused_ranks.explicit, 2, timeout_s=50):
        assert grads["never.weight"] is False and grads["always.weight"] is True
        assert grads["rank0_only.weight"] is True  # used on rank 0: every rank gets the mean
