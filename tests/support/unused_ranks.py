"""Rank functions for tests/ranks/test_find_unused.py: parameters that no rank, one rank, or
only a no_sync() micro-batch used, under torch DDP and gradsync with find_unused_parameters."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as TorchDDP

import gradsync as gs

STEPS = 4


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.always = nn.Linear(4, 4)
        self.never = nn.Linear(4, 4)
        self.rank0_only = nn.Linear(4, 4)
        self.first_micro_only = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor, rank: int, first_micro: bool) -> torch.Tensor:
        y = self.always(x)
        if rank == 0:
            y = y + self.rank0_only(x)
        if first_micro:
            y = y + self.first_micro_only(x)
        return (y**2).mean()


def _train(rank: int, wrap: Any) -> dict[str, torch.Tensor]:
    raw = Branchy()
    optimizer = torch.optim.SGD(raw.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01)
    model = wrap(raw, optimizer)
    generator = torch.Generator().manual_seed(rank)
    for _ in range(STEPS):
        with model.no_sync():
            model(torch.randn(3, 4, generator=generator), rank, True).backward()
        model(torch.randn(3, 4, generator=generator), rank, False).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return {k: v.detach().clone() for k, v in raw.state_dict().items()}


def front_door_against_ddp(rank: int, world: int) -> dict[str, Any]:
    ddp = _train(rank, lambda m, o: TorchDDP(m, find_unused_parameters=True))
    ours = _train(
        rank, lambda m, o: gs.DistributedDataParallel(m, optimizer=o, find_unused_parameters=True)
    )
    without = _train(rank, lambda m, o: gs.DistributedDataParallel(m, optimizer=o))
    return {"ddp": ddp, "ours": ours, "without": without, "init": Branchy().state_dict()}


def explicit(rank: int, world: int) -> dict[str, Any]:
    """The Synchronizer's own form: the unused parameter's grad is None after the step."""
    model = Branchy()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sync = gs.Synchronizer(model, optimizer, find_unused_parameters=True)
    grads = {}
    for _ in range(2):
        with sync.step() as s:
            model(torch.ones(3, 4), rank, False).backward()
            s.synchronize()
            grads = {n: p.grad is not None for n, p in model.named_parameters()}
    sync.close()
    return grads
