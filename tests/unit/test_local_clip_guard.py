"""``LocalClipGuard`` (``zero:2`` / ``zero:3``'s refusal of torch's ``clip_grad_norm_`` on this
rank's part of the gradient), with no process group: what it refuses, what it lets through."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gradsync.errors import UsageError
from gradsync.strategies.zero_shards import LocalClipGuard

pytestmark = pytest.mark.unit


def _with_grads() -> tuple[nn.Module, list[torch.Tensor]]:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 3), nn.Tanh(), nn.Linear(3, 2))
    model(torch.randn(5, 4)).pow(2).sum().backward()
    return model, [p.grad for p in model.parameters() if p.grad is not None]


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_torch_clip_on_the_shard_is_refused_naming_the_handle(norm_type: float) -> None:
    model, grads = _with_grads()
    before = [g.clone() for g in grads]
    guard = LocalClipGuard("zero:2")
    guard.arm(grads)
    try:
        with pytest.raises(UsageError, match=r"s\.clip_grad_norm_\(max_norm\)"):
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3, norm_type=norm_type)
        with pytest.raises(UsageError, match="zero:2"):  # by hand, a single tensor included
            grads[0].div_(grads[0].norm())
    finally:
        guard.disarm()
    assert all(torch.equal(g, b) for g, b in zip(grads, before, strict=True))  # nothing clipped


def test_reading_logging_and_unscaling_pass() -> None:
    model, grads = _with_grads()
    guard = LocalClipGuard("zero:3")
    guard.arm(grads)
    try:
        norms = [g.norm() for g in grads]  # logging per-tensor norms, and their total
        total = float(torch.stack(norms).norm())
        for g in grads:
            g.mul_(0.5)  # a constant factor (an unscale) is not the shard's norm
        torch.nn.utils.clip_grad_value_(model.parameters(), 0.1)  # elementwise: right on shards
        with guard.exempt():  # gradsync's own clip (the norm combined over the ranks)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
    finally:
        guard.disarm()
    assert total > 0
    assert float(torch.stack([g.norm() for g in grads]).norm()) <= 1e-3 + 1e-6
    # disarmed: torch's clip is the user's again (after the update, or outside ZeRO)
    model(torch.randn(5, 4)).sum().backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
