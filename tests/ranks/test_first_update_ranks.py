"""Two gloo ranks, fused SGD with momentum, NaN gradients on rank 1 at steps 0 and 1: every
rank keeps the host's verdict until the first applied update (step 2), so no momentum buffer
is made by a skipped step and the run follows a non-fused SGD run's (issue 44). The unit tier
checks the same in a world of one, zero:3 too (tests/unit/test_first_applied_update.py)."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import first_update_ranks as f

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
def test_two_non_finite_first_steps_leave_no_garbage_momentum_on_any_rank() -> None:
    by_rank = run_ranks(f.both_loops, 2, timeout_s=110)
    for strategy in f.STRATEGIES:
        r0, r1 = (out[f"{strategy} True"] for out in by_rank)
        plain = by_rank[0][f"{strategy} False"]
        for r in (r0, r1):
            assert not r["state_early"], strategy  # no buffer made by a skipped step
            assert r["finite_buffers"], strategy
        assert torch.equal(r0["params"][0], r0["params"][1]), strategy  # both skipped
        for step in range(f.STEPS):
            assert torch.equal(r0["params"][step], r1["params"][step]), (strategy, step)
            # The fused kernel rounds differently from the per-tensor loop: close, not bitwise.
            close = torch.allclose(r0["params"][step], plain["params"][step], rtol=1e-5, atol=1e-6)
            assert close, (strategy, step)
