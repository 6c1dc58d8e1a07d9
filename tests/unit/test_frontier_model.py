"""The frontier's held-out transformer (``benchmarks/frontier_model.py``, issue 46): batches that
are a function of (seed, step) and split over ranks as the built-in workloads', a language
with a loss floor, and a model its own optimizer trains."""

from __future__ import annotations

import math

import pytest
import torch

from benchmarks.frontier_model import VOCAB, HeldOutLM

pytestmark = pytest.mark.unit


def test_batches_are_a_function_of_seed_and_step() -> None:
    a, b = HeldOutLM(seed=1), HeldOutLM(seed=1)
    x, y = a.batch(3, 8, 0, 8)
    x2, y2 = b.batch(3, 8, 0, 8)
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert x.dtype == torch.long and x.shape == (8, a.context) and y.shape == x.shape
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one token
    assert not torch.equal(a.batch(4, 8, 0, 8)[0], x)
    assert not torch.equal(HeldOutLM(seed=2).batch(3, 8, 0, 8)[0], x)


def test_rank_shards_are_disjoint_slices_of_one_global_batch() -> None:
    w = HeldOutLM(seed=1)
    x_all, y_all = w.batch(step=3, global_batch=12, start=0, stop=12)
    parts = [w.batch(3, 12, lo, lo + 4) for lo in (0, 4, 8)]
    assert torch.equal(torch.cat([p[0] for p in parts]), x_all)
    assert torch.equal(torch.cat([p[1] for p in parts]), y_all)


def test_the_language_has_a_floor_far_below_a_uniform_guess() -> None:
    w = HeldOutLM(seed=0)
    x, y = w.batch(0, 64, 0, 64)
    floor = w.floor(x, y)
    assert 0.5 < floor < 2.0 < math.log(VOCAB)


def test_loss_decreases_under_its_own_optimizer() -> None:
    torch.set_num_threads(1)
    w = HeldOutLM(seed=0)
    model = w.build_model()
    assert 1_000_000 < sum(p.numel() for p in model.parameters()) < 4_000_000  # 4-16 MB
    opt = w.make_optimizer(model, w.default_lr)
    losses = []
    for step in range(12):
        opt.zero_grad()
        loss = w.loss(model, *w.batch(step, 8, 0, 4))
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[0] == pytest.approx(math.log(VOCAB), rel=0.05)  # a near-uniform start
    assert sum(losses[-3:]) / 3 < losses[0] - 0.5
