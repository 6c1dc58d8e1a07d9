"""Host work a step leaves out (issue 44): a model without buffers is not walked for them at
every step, as DDP skips it; one with buffers still has them broadcast from rank 0. And the
initial broadcast in runs (issue 47: no flat copy of the whole model at construction)."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import step_overhead_ranks

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
def test_a_model_without_buffers_is_not_walked_for_them_each_step() -> None:
    for out in run_ranks(step_overhead_ranks.buffer_walks, 2, False, timeout_s=100):
        assert out["walks"] == 0, out


@pytest.mark.timeout(120)
def test_a_model_with_buffers_still_has_them_broadcast_each_step() -> None:
    for out in run_ranks(step_overhead_ranks.buffer_walks, 2, True, timeout_s=100):
        assert out["walks"] >= 4, out  # at least once a step
        assert out["seen"] == 4.0, out  # rank 0's value at the last step, on every rank


@pytest.mark.timeout(120)
def test_the_initial_broadcast_in_small_runs_gives_every_rank_rank_0s_model() -> None:
    r0, r1 = run_ranks(step_overhead_ranks.chunked_initial_broadcast, 2, timeout_s=100)
    assert r0["state"].keys() == r1["state"].keys()
    for name, value in r0["state"].items():
        assert torch.equal(value, r1["state"][name]), name
