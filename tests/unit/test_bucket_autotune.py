"""``bucket_mb="auto"`` (issue 48): which plans are tried, which step runs which, and which plan
is kept from the step times the ranks agree on."""

from __future__ import annotations

import pytest

from gradsync.bucket_autotune import STEPS_PER_PLAN, WARMUP_STEPS, BucketTuner, candidates
from gradsync.spec import default_bucket_mb

pytestmark = pytest.mark.unit


def test_the_candidates_are_the_default_plan_then_25_and_1_mb_capped_at_the_gradient() -> None:
    assert candidates(200.0) == [25.0, 1.0]  # the default plan is 25 MB there
    assert candidates(40.0) == [default_bucket_mb(40.0), 25.0, 1.0]
    # A 4.7 MB gradient: 25 MB buckets are one bucket of the whole (after the first).
    assert candidates(4.7) == [1.0, 4.7]
    assert candidates(0.5) == [1.0]


def test_each_plan_runs_its_steps_after_the_warm_up_then_the_fastest_is_kept() -> None:
    tuner = BucketTuner([4.0, 25.0, 1.0])
    seconds = {4.0: 0.030, 25.0: 0.040, 1.0: 0.020}
    ran = []
    while tuner.deciding and not tuner.ready_to_decide:
        plan = tuner.plan_for_next_step()
        ran.append(plan)
        tuner.record(seconds[plan] + (1.0 if len(ran) == 1 else 0.0))  # a slow first step
    assert (
        ran
        == [4.0] * (WARMUP_STEPS + STEPS_PER_PLAN)
        + [25.0] * STEPS_PER_PLAN
        + [1.0] * STEPS_PER_PLAN
    )
    assert tuner.medians() == [0.030, 0.040, 0.020]  # the warm-up's slow step not counted
    assert tuner.decide(tuner.medians()) == 1.0
    assert not tuner.deciding and tuner.plan_for_next_step() == 1.0
    tuner.record(5.0)  # later steps change nothing
    assert tuner.plan_for_next_step() == 1.0


def test_the_decision_follows_the_agreed_times_not_this_ranks() -> None:
    tuner = BucketTuner([4.0, 25.0])
    for _ in range(WARMUP_STEPS + 2 * STEPS_PER_PLAN):
        tuner.record(0.01)
    assert tuner.ready_to_decide
    # This rank saw no difference; the slowest rank was slower under 4 MB buckets.
    assert tuner.decide([0.05, 0.02]) == 25.0
    assert "4 MB 50.0 ms" in tuner.describe([0.05, 0.02])


def test_a_single_candidate_is_kept_without_timing() -> None:
    tuner = BucketTuner([1.0])
    assert not tuner.deciding and tuner.plan_for_next_step() == 1.0


def test_sizes_that_give_the_same_buckets_are_one_plan() -> None:
    import torch

    from gradsync.buckets import MB, distinct_plans

    def mlp(hidden: int) -> list[torch.Tensor]:
        # The benchmark's mlp's shapes (meta: sizes only): 64 -> hidden -> hidden -> 16.
        shapes = [(hidden, 64), (hidden,), (hidden, hidden), (hidden,), (16, hidden), (16,)]
        return [torch.empty(s, device="meta") for s in shapes]

    # 38 MB: its 37 MB weight is a bucket of its own under any cap up to 25 MB, and the rest
    # fits under 1 MB either side of it: 4.8, 25 and 1 MB are the same three buckets.
    big = mlp(3122)
    total = sum(p.numel() * 4 for p in big) / MB
    assert distinct_plans(big, candidates(total)) == [default_bucket_mb(total)]
    # Many tensors of 0.5 MiB: each size is its own plan, kept in the order given.
    many = [torch.empty(MB // 8, device="meta") for _ in range(80)]
    assert distinct_plans(many, candidates(40.0)) == [default_bucket_mb(40.0), 25.0, 1.0]
