"""BSP semantics on real gloo ranks: exactness against one process, micro-batches, overlap,
unused parameters."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import ranks

pytestmark = pytest.mark.ranks


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, rel: float = 1e-10) -> None:
    err = (actual - expected).abs().max().item()
    scale = expected.abs().max().item()
    assert err <= rel * scale, f"max abs error {err:.3e} exceeds {rel:g} x {scale:.3e}"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_bsp_equals_single_process_on_global_batch(world: int) -> None:
    results = run_ranks(ranks.exactness, world)
    for name in ("sgd", "adamw"):
        expected = ranks.train_reference(name, steps=10, global_batch=6 * world)
        first = results[0][name]
        _assert_close(first, expected)
        # Not merely close: every replica holds the same bits.
        for other in results[1:]:
            assert torch.equal(other[name], first), f"{name}: replicas differ"
        # The test would be vacuous if training did not move the parameters.
        initial = ranks.train_reference(name, steps=0, global_batch=6 * world)
        assert not torch.allclose(first, initial)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("micro", [1, 4])
def test_micro_batches_equal_one_larger_batch_and_buckets_overlap_backward(micro: int) -> None:
    world, per_rank = 2, 8
    results = run_ranks(ranks.micro_batches, world, micro, per_rank)
    # k micro-batches of 8 / k per rank == one step on the 16-sample global batch.
    expected = ranks.train_reference("sgd", steps=5, global_batch=world * per_rank)
    for r in results:
        _assert_close(r["params"], expected)
    assert torch.equal(results[0]["params"], results[1]["params"])
    for r in results:
        assert r["buckets"] >= 3, r["buckets"]
        for step, t in enumerate(r["timelines"]):
            assert len(t["launches"]) == r["buckets"], (step, t)
            # Communication only on the k-th backward pass: nothing before it begins.
            assert t["launches"][0] > t["final_pass_start"], (step, t)
            # Overlap: a bucket was already in flight while the gradients of the last bucket
            # had yet to be computed (so, strictly before the backward pass ended).
            assert t["launches"][0] < t["last_bucket_first_grad"], (step, t)
            assert t["last_bucket_first_grad"] <= t["backward_end"]


@pytest.mark.timeout(120)
def test_parameter_unused_in_some_steps_does_not_hang_or_desync() -> None:
    results = run_ranks(ranks.unused_parameter, 2, timeout_s=60, collective_timeout_s=20)
    assert torch.equal(results[0], results[1])
