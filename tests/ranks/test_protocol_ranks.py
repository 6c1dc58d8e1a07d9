"""The strategy protocol is complete: a strategy written against it alone (``AverageEveryStep``
in ``toy_strategy_ranks``) trains, checkpoints, resumes and reports through the Synchronizer,
on two gloo ranks."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import toy_strategy_ranks

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(240)
def test_a_toy_strategy_trains_checkpoints_resumes_and_reports(tmp_path: Path) -> None:
    steps, save_at = 8, 4
    results = run_ranks(
        toy_strategy_ranks.toy_lifecycle, 2, str(tmp_path / "ckpt"), steps, save_at, timeout_s=200
    )
    for rank, out in enumerate(results):
        assert out["losses"][-1] < out["losses"][0], out["losses"]
        # Averaging every step keeps replicas identical (the divergence check ran every 2 steps).
        assert torch.equal(out["straight"], results[0]["straight"])
        # Resumed from the step-4 checkpoint, the second half lands on the same bits.
        assert torch.equal(out["resumed"], out["straight"]), rank
        # The strategy's own state went through the checkpoint: 4 restored + 4 more averages.
        assert out["toy_state"] == {"averages": steps}
        assert out["resumed_state"] == {"averages": steps}
        # With plain SGD the mean of the local steps is BSP's step.
        torch.testing.assert_close(out["straight"], out["bsp"], rtol=1e-10, atol=1e-12)
        # The resumed run reports every step: the records of the 4 steps before the save, not
        # gathered yet then, came back with the checkpoint.
        assert out["steps_reported"] == [steps, steps]
        assert out["ranks_reported"] == 2
        assert out["bytes"] > 0
        assert out["final_loss"] is not None
        assert any(name.startswith("step") for name in out["checkpoints"]), out["checkpoints"]
