"""Learning rate for a larger global batch: the linear scaling rule and gradual warmup
(Goyal et al., 2017, "Accurate, Large Minibatch SGD").

Data parallelism multiplies the global batch by the number of workers. The linear scaling rule
multiplies the learning rate by the same factor; gradual warmup ramps it there from the
single-worker rate, because the scaled rate is too large while the network changes fast early
on. ``warmup`` is torch's own ``LinearLR`` with the factor the rule implies, so it chains with
any other scheduler through ``SequentialLR``.
"""

from __future__ import annotations

import torch

from gradsync.errors import UsageError


def scaled_lr(base_lr: float, base_batch: int, global_batch: int) -> float:
    """``base_lr`` tuned for ``base_batch`` samples per step, scaled to ``global_batch``."""
    if not base_lr > 0:
        raise UsageError(f"base_lr must be > 0, got {base_lr}")
    if base_batch < 1 or global_batch < 1:
        raise UsageError(
            f"batch sizes must be >= 1, got base_batch={base_batch}, global_batch={global_batch}"
        )
    return base_lr * global_batch / base_batch


def warmup(
    optimizer: torch.optim.Optimizer, steps: int, *, base_batch: int, global_batch: int
) -> torch.optim.lr_scheduler.LinearLR:
    """Ramp every param group's lr linearly from ``lr * base_batch / global_batch`` (the
    unscaled rate, when ``lr`` was set with :func:`scaled_lr`) to ``lr`` over ``steps`` steps.
    Call its ``step()`` once per training step, after the update, as with any scheduler."""
    if steps < 1:
        raise UsageError(f"warmup steps must be >= 1, got {steps}")
    factor = base_batch / global_batch
    if not 0 < factor <= 1:
        raise UsageError(
            f"warmup starts from base_batch / global_batch = {base_batch}/{global_batch}, "
            "which must be in (0, 1]: the global batch is the larger one"
        )
    return torch.optim.lr_scheduler.LinearLR(
        optimizer, start_factor=factor, end_factor=1.0, total_iters=steps
    )


__all__ = ["scaled_lr", "warmup"]
