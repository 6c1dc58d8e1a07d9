"""The linear scaling rule and gradual warmup (Goyal et al.)."""

from __future__ import annotations

import pytest
import torch

import gradsync as gs
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit


def test_the_rate_scales_with_the_global_batch() -> None:
    assert gs.scaled_lr(0.1, 256, 1024) == pytest.approx(0.4)
    assert gs.scaled_lr(0.1, 256, 256) == pytest.approx(0.1)


def test_warmup_ramps_from_the_unscaled_rate_to_the_scaled_one() -> None:
    lr = gs.scaled_lr(0.1, 256, 1024)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    sched = gs.warmup(opt, 4, base_batch=256, global_batch=1024)
    seen = []
    for _ in range(6):
        seen.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert seen[0] == pytest.approx(0.1)
    assert seen[4] == pytest.approx(0.4) and seen[5] == pytest.approx(0.4)
    assert all(a < b for a, b in zip(seen[:4], seen[1:5], strict=True))


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: gs.scaled_lr(0.0, 256, 512), "base_lr must be > 0, got 0.0"),
        (lambda: gs.scaled_lr(0.1, 0, 512), "base_batch=0, global_batch=512"),
        (
            lambda: gs.warmup(
                torch.optim.SGD([torch.zeros(1)], lr=1), 0, base_batch=1, global_batch=2
            ),
            "warmup steps must be >= 1, got 0",
        ),
        (
            lambda: gs.warmup(
                torch.optim.SGD([torch.zeros(1)], lr=1), 3, base_batch=4, global_batch=2
            ),
            "4/2",
        ),
    ],
)
def test_bad_values_are_named(call: object, message: str) -> None:
    with pytest.raises(UsageError, match=message):
        call()  # type: ignore[operator]
