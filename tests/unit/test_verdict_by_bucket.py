"""The host's non-finite verdict taken bucket by bucket as each exchange completes (bsp's
``BucketReducer.wait(each=...)``): every bucket is looked at, whichever one holds the NaN."""

from __future__ import annotations

import math

import pytest
import torch

import gradsync as gs
from gradsync.buckets import MB, BucketReducer
from gradsync.checks.guards import all_finite, finite_given_sums, finite_sum
from tests.support.ranks import flat_params

pytestmark = pytest.mark.unit


def test_wait_hands_each_reduced_bucket_over_once_in_order_before_it_returns() -> None:
    params = [torch.zeros(MB // 4, requires_grad=True) for _ in range(3)]  # 1 MiB each

    def exchange(bucket: object) -> torch.futures.Future[torch.Tensor]:
        fut: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        fut.set_result(bucket.buffer() + 1)  # type: ignore[attr-defined]
        return fut

    reducer = BucketReducer(params, 1.0, exchange)
    assert len(reducer.buckets) == 3
    reducer.arm(1)
    for i, p in enumerate(params):
        p.grad = torch.full_like(p, float(i))
    reducer.flush()
    seen: list[torch.Tensor] = []
    reduced = reducer.wait(each=seen.append)
    assert [t.data_ptr() for t in seen] == [t.data_ptr() for t in reduced]
    # bucket index order, which follows the backward's: the last parameter's bucket first
    assert [float(t[0]) for t in seen] == [3.0, 2.0, 1.0]
    reducer.close()


@pytest.mark.parametrize(
    "tensors",
    [
        [torch.ones(4), torch.tensor([1.0, math.nan]), torch.ones(3)],
        [torch.ones(4), torch.ones(2), torch.tensor([-math.inf])],
        [torch.full((4,), 3e38), torch.full((4,), 3e38)],  # sums overflow; values are finite
        [torch.ones(2)],
        [],
    ],
)
def test_sums_taken_beforehand_give_all_finites_verdict(tensors: list[torch.Tensor]) -> None:
    sums = [finite_sum(t) for t in tensors]
    assert finite_given_sums(sums, tensors) == all_finite(tensors)


def _nan_at(param: torch.Tensor, step: int, current: list[int]) -> None:
    param.register_hook(lambda g: g * math.nan if current[0] == step else g)


@pytest.mark.parametrize("which", ["first", "middle", "last"])
def test_a_nan_in_any_bucket_skips_the_step(one_rank: None, which: str) -> None:
    """Plain SGD with momentum: the verdict is the host's, summed bucket by bucket as each
    reduced bucket comes in. The bucket launched first (the output layer's), one in the middle
    and the last one each hold the NaN once; that step alone is skipped."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512), torch.nn.ReLU(), torch.nn.Linear(512, 512), torch.nn.ReLU()
    )
    model.append(torch.nn.Linear(512, 4))
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    sync = gs.Synchronizer(model, opt, strategy="bsp", bucket_mb=0.5, telemetry=False)
    buckets = sync.strategy.reducer.buckets  # type: ignore[attr-defined]
    assert len(buckets) >= 3, [b.nbytes for b in buckets]
    bucket = {"first": buckets[0], "middle": buckets[len(buckets) // 2], "last": buckets[-1]}
    current = [-1]
    nan_at = 3
    _nan_at(bucket[which].parameters()[0], nan_at, current)
    params, skipped = [], []
    for step in range(6):
        current[0] = step
        with sync.step() as s:
            x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
            s.loss = model(x).square().mean()
            s.loss.backward()
        skipped.append(s.skipped)
        params.append(flat_params(model))
    sync.close()
    assert skipped == [step == nan_at for step in range(6)]
    assert torch.equal(params[nan_at - 1], params[nan_at])
    assert not torch.equal(params[nan_at], params[nan_at + 1])
    assert bool(torch.isfinite(params[-1]).all())
