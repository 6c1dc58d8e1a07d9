"""``bucket_mb="auto"`` on two ranks (issue 48): both keep the same plan, chosen from the
timed steps, and the run ends where a fixed plan's does."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import autotune_ranks as at

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
def test_both_ranks_keep_one_plan_and_train_as_a_fixed_plan_does() -> None:
    tuned = run_ranks(at.train, 2, "auto")
    fixed = run_ranks(at.train, 2, 1.0)
    chosen = [out["summary"]["bucket_mb_auto"]["chosen_mb"] for out in tuned]
    assert chosen[0] == chosen[1] and chosen[0] in tuned[0]["summary"]["bucket_mb_auto"]["tried_mb"]
    assert tuned[0]["summary"]["bucket_mb"] == chosen[0]  # the reducer runs the kept plan
    assert len(tuned[0]["summary"]["bucket_mb_auto"]["tried_mb"]) == 2
    # Said once, once kept, naming the kept plan (it was said before any timing, naming the
    # first plan tried, and twice when that one won).
    (kept,) = tuned[0]["plans"]
    assert f"(bucket_mb {chosen[0]:g}: kept by bucket_mb auto)" in kept, kept
    # A plan changes when buckets leave, not what they sum to (2 ranks: a + b either way).
    for a, b in zip(tuned, fixed, strict=True):
        assert torch.equal(a["final"], b["final"])


@pytest.mark.timeout(60)
def test_auto_refuses_a_compressor_naming_it() -> None:
    for message in run_ranks(at.auto_with_compression, 2):
        assert message is not None and "bucket_mb='auto'" in message and "fp16" in message
        assert "hierarchical" not in message, message  # what was given, not every case
