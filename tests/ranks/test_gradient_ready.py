"""The gradient-ready point of a step (``s.synchronize()``), the handle's ``skipped``, and
replicas that agree after ``report()`` even when a local:H / diloco:H run ends mid-period."""

from __future__ import annotations

import pytest
import torch

from gradsync.compression import Compressor, error_feedback, powersgd
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


#: (compression, allreduce, ranks): the plain in-place sum; compressors that write their mean
#: into the bucket (a cast back, int8's and an error-feedback top-k's decode, PowerSGD's
#: first steps: an all-reduce then a division, and its low-rank steps); the hierarchy (2
#: ranks on one host: its reduce and broadcast; 3 on two hosts: the leaders' exchange too,
#: compressed)
EXCHANGES = [
    (None, "ring", 2),
    ("fp16", "ring", 2),
    ("int8", "ring", 2),
    ("topk:0.1", "ring", 2),
    ("powersgd:2", "ring", 2),
    pytest.param(
        error_feedback(powersgd(2, start_iter=0)), "ring", 2, id="powersgd:2-low-rank-ring-2"
    ),
    (None, "hierarchical", 2),
    ("fp16", "hierarchical", 3),
]


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("compression", "allreduce", "world"), EXCHANGES)
def test_a_clip_racing_the_exchange_is_refused_at_its_first_step(
    compression: str | Compressor | None, allreduce: str, world: int
) -> None:
    for rank, out in enumerate(run_ranks(gr.clip_inside_the_block, world, compression, allreduce)):
        assert out["before"] is not None, f"rank {rank}: the clip in flight was not refused"
        step, message = out["before"]
        assert step == 0, message
        assert "changed in place" in message and "s.synchronize()" in message, message
        assert out["after"] is None  # the documented place for the clip
        assert out["handle"] is None  # and the handle's clip, which synchronizes first


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("compression", "allreduce", "world"), EXCHANGES[1:])
def test_a_clip_at_the_gradient_ready_point_is_not_refused_under_any_exchange(
    compression: str | Compressor | None, allreduce: str, world: int
) -> None:
    # Several buckets and two micro-batches a step, as the plain sum's exactness test above.
    steps = 3
    args = ("bsp", steps, True, compression, allreduce)
    results = run_ranks(gr.clip_at_the_gradient_ready_point, world, *args)
    for out in results:
        assert out["ready"] == [True] * steps
        assert torch.equal(out["final"], results[0]["final"])
        assert out["norms"] == results[0]["norms"]
    assert max(results[0]["norms"]) > gr.MAX_NORM  # the clip did cut
