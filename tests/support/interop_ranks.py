"""Rank functions: models and training set-ups people bring, under gradsync and under DDP
(module level, so spawned ranks can import them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

import gradsync as gs

STEPS = 4


class TiedLM(nn.Module):
    """Embedding and output head share one weight, as in GPT-2."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(32, 16)
        self.mix = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(idx))))


def _batch(step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(100 * step + rank)
    idx = torch.randint(32, (8, 6), generator=g)
    return idx, torch.roll(idx, 1, dims=1)


def _loss(model: nn.Module, step: int, rank: int) -> torch.Tensor:
    x, y = _batch(step, rank)
    return nn.functional.cross_entropy(model(x).reshape(-1, 32), y.reshape(-1))


def _state(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _optimizer(model: nn.Module) -> tuple[Any, Any]:
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    return opt, torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)


def tied_weights_against_ddp(
    rank: int, world: int, compiled: bool, bf16_and_clip: bool = False
) -> dict[str, Any]:
    """The tied model with an LR scheduler, under gradsync (compiled with torch.compile's
    aot_eager backend or not) and under DDP; with ``bf16_and_clip``, the forward under bf16
    autocast and the averaged gradient clipped to a max norm."""
    model = TiedLM()
    opt, sched = _optimizer(model)
    net = torch.compile(model, backend="aot_eager") if compiled else model
    sync = gs.Synchronizer(model, opt, check_every=1)
    for step in range(STEPS):
        with sync.step() as s:
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_and_clip):
                loss = _loss(net, step, rank)
            loss.backward()
            if bf16_and_clip:
                s.clip_grad_norm_(0.05)
        sched.step()
    sync.report()
    sync.close()
    ours = _state(model)

    model = TiedLM()
    ddp = DistributedDataParallel(model)
    opt, sched = _optimizer(model)
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16_and_clip):
            loss = _loss(ddp, step, rank)
        loss.backward()
        if bf16_and_clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        opt.step()
        sched.step()
    return {"gradsync": ours, "ddp": _state(model), "tied": model.head.weight is model.embed.weight}
