"""Host work a step leaves out (issue 44): a model without buffers is not walked for them at
every step, as DDP skips it; one with buffers still has them broadcast from rank 0."""

from __future__ import annotations

import pytest

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
