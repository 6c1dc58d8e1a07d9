"""The gradient-ready point of a step (``s.synchronize()``), the handle's ``skipped``, and
replicas that agree after ``report()`` even when a local:H / diloco:H run ends mid-period."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import gradient_ready_ranks as gr

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
def test_bsp_clipped_at_the_gradient_ready_point_equals_one_process_clipping() -> None:
    steps = 4
    results = run_ranks(gr.clip_at_the_gradient_ready_point, 2, "bsp", steps, True)
    expected = gr.clipped_reference(2, steps)
    for out in results:
        assert out["ready"] == [True] * steps
        assert torch.equal(out["final"], results[0]["final"])
        # The norm each rank clipped is the mean gradient's: the same on both ranks.
        assert out["norms"] == results[0]["norms"]
        torch.testing.assert_close(out["final"], expected, rtol=1e-10, atol=1e-12)
    assert max(results[0]["norms"]) > gr.MAX_NORM  # the clip did cut


@pytest.mark.timeout(150)
def test_a_parameter_server_worker_pushes_the_gradient_it_clipped() -> None:
    clipped = run_ranks(gr.clip_at_the_gradient_ready_point, 3, "ssp:0", 3, True)
    free = run_ranks(gr.clip_at_the_gradient_ready_point, 3, "ssp:0", 3, False)
    moved = {
        name: float((out["final"] - out["start"]).norm())
        for name, out in (("clipped", clipped[0]), ("free", free[0]))
    }
    assert torch.equal(clipped[0]["final"], clipped[1]["final"])
    # Three steps of at most MAX_NORM each, momentum 0.9, lr 0.1, 2 workers: well under 0.1.
    assert moved["clipped"] < 0.1 < moved["free"], moved


@pytest.mark.timeout(90)
def test_the_handle_says_when_a_step_was_skipped_on_every_rank() -> None:
    for out in run_ranks(gr.skip_is_reported_on_the_handle, 2):
        assert out["ready"] == [True, True, False, True]
        assert out["skipped"] == [False, False, True, False]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["local:4", "diloco:4"])
def test_a_run_ending_mid_period_leaves_identical_replicas(strategy: str) -> None:
    # 6 steps of H=4: the last 2 are an incomplete period, closed by report().
    first, second = run_ranks(gr.periodic_ending_mid_period, 2, strategy, 6)
    assert torch.equal(first, second)


@pytest.mark.timeout(90)
def test_a_clip_racing_the_exchange_is_refused_at_its_first_step() -> None:
    for out in run_ranks(gr.clip_inside_the_block, 2):
        step, message = out["before"]
        assert step == 0, message
        assert "changed in place" in message and "s.synchronize()" in message, message
        assert out["after"] is None  # the documented place for the clip
