"""Rank function for tests/ranks/test_first_update_ranks.py: fused SGD with momentum whose
first two steps are non-finite on one rank only, on two gloo ranks (issue 44's edge: the
device verdict must wait for the first applied update, on every rank alike)."""

from __future__ import annotations

from typing import Any

import torch

import gradsync as gs
from gradsync import inject
from gradsync.workloads import make_workload

STRATEGIES = ("bsp", "zero:1", "zero:2")
STEPS, NAN_STEPS = 5, (0, 1)


def both_loops(rank: int, world: int) -> dict[str, Any]:
    """Per strategy, the fused run and the non-fused reference: the parameters after each
    step, whether the optimizer held state after the non-finite steps, and whether its
    momentum buffers are finite at the end."""
    return {
        f"{strategy} {fused}": _train(rank, world, strategy, fused)
        for strategy in STRATEGIES
        for fused in (True, False)
    }


def _train(rank: int, world: int, strategy: str, fused: bool) -> dict[str, Any]:
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    loop = {"fused": True} if fused else {"foreach": False}
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9, **loop)
    sync = gs.Synchronizer(model, opt, strategy=strategy, telemetry=False)
    for step in NAN_STEPS:  # rank 1's only: rank 0 skips through the exchange alone
        inject.nan_gradient(sync, rank=1, step=step)
    params, state_early = [], None
    for step in range(STEPS):
        with sync.step():
            x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
            w.loss(model, x, y).backward()
        if step == NAN_STEPS[-1]:
            state_early = bool(opt.state)
        params.append(torch.cat([p.detach().reshape(-1) for p in model.parameters()]))
    sync.close()
    buffers = [s["momentum_buffer"] for s in opt.state.values()]
    return {
        "params": params,
        "state_early": state_early,
        "finite_buffers": all(bool(torch.isfinite(b).all()) for b in buffers),
    }
