"""Rank functions: a BatchNorm model under gradsync and under DDP (module level, so spawned
ranks can import them)."""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync as gs

STEPS = 4


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Linear(16, 1))


def _batch(step: int, micro: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + 10 * micro + rank)
    x = torch.randn(8, 6, generator=g) * (1 + rank)  # ranks see different statistics
    return x, x.sum(dim=1, keepdim=True)


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _gradsync(rank: int, k: int, broadcast_buffers: bool) -> dict[str, torch.Tensor]:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = gs.Synchronizer(
        model, opt, accumulation="sum", broadcast_buffers=broadcast_buffers, check_every=0
    )
    for step in range(STEPS):
        with sync.step(micro_batches=k):
            for micro in range(k):
                x, y = _batch(step, micro, rank)
                (nn.functional.mse_loss(model(x), y) / k).backward()
    sync.report()
    sync.close()
    return _state(model)


def _ddp(rank: int, k: int) -> dict[str, torch.Tensor]:
    model = _model()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        for micro in range(k):
            with nullcontext() if micro == k - 1 else ddp.no_sync():
                x, y = _batch(step, micro, rank)
                (nn.functional.mse_loss(ddp(x), y) / k).backward()
        opt.step()
    return _state(model)


def buffers_against_ddp(rank: int, world: int, k: int) -> dict[str, Any]:
    return {
        "gradsync": _gradsync(rank, k, True),
        "ddp": _ddp(rank, k),
        "unsynced": _gradsync(rank, k, False),
    }
