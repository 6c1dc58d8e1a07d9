"""The gradient-ready point of a step (``s.synchronize()``): called twice, outside a block, or
followed by a backward pass, it is refused. On ranks: tests/ranks/test_gradient_ready.py."""

from __future__ import annotations

import pytest
import torch

import gradsync as gs
from gradsync.errors import UsageError
from gradsync.workloads import make_workload

pytestmark = pytest.mark.unit


@pytest.fixture
def one_rank_bsp(one_rank: None) -> tuple[gs.Synchronizer, object]:
    w = make_workload("mlp", seed=3, params=2000)
    model = w.build_model()
    return gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1)), w


def test_synchronize_twice_or_outside_a_block_is_refused(one_rank_bsp: tuple) -> None:
    sync, w = one_rank_bsp
    with pytest.raises(UsageError, match="already called in step 0"), sync.step() as s:
        w.loss(sync.model, *w.batch(0, 4, 0, 4)).backward()
        s.synchronize()
        s.synchronize()
    with pytest.raises(UsageError, match="inside a sync.step"):
        s.synchronize()
    sync.close()


def test_a_backward_pass_after_synchronize_is_refused(one_rank_bsp: tuple) -> None:
    sync, w = one_rank_bsp
    with pytest.raises(UsageError, match="backward pass ran after s.synchronize"):  # noqa: SIM117
        with sync.step() as s:
            w.loss(sync.model, *w.batch(0, 4, 0, 4)).backward()
            s.synchronize()
            w.loss(sync.model, *w.batch(1, 4, 0, 4)).backward()
    sync.close()
