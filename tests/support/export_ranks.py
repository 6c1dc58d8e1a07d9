"""Rank functions for the checkpoint-export tests (module level, so spawned ranks can import
them): train each exportable strategy a few steps, checkpoint, and hand back every rank's
model and optimizer state dicts to compare the export with."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from torch import nn

import gradsync as gs

STEPS = 4
#: the strategies trained on real ranks (hogwild's ranks go on writing the shared parameters
#: after a checkpoint, so their final model is no checkpoint's: tested on one rank)
STRATEGIES = ("bsp", "zero:1", "zero:2", "local:2", "diloco:2", "gossip:2", "noloco:2")
#: ``bsp`` on a model with BatchNorm, whose running statistics differ between the ranks
BATCH_NORM = "bsp-batchnorm"


class Scale(nn.Module):
    """Multiplies by a persistent buffer that training leaves alone: a buffer every replica
    holds alike, so the export's can be compared with every rank's."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.register_buffer("scale", torch.linspace(0.5, 1.5, width))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.scale


def build(batch_norm: bool = False) -> tuple[nn.Module, torch.optim.Optimizer]:
    """A model with a buffer and AdamW with two param groups of their own hyper-parameters,
    as a user's script may have them. ``batch_norm``: BatchNorm's running statistics for the
    buffer, which each rank updates from its own batch (rank 0's are broadcast at the start
    of the next step under ``bsp``, as DDP's ``broadcast_buffers``)."""
    torch.manual_seed(5)
    middle = nn.BatchNorm1d(8) if batch_norm else Scale(8)
    model = nn.Sequential(nn.Linear(6, 8), middle, nn.Tanh(), nn.Linear(8, 3)).double()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    optimizer = torch.optim.AdamW(
        [{"params": weights}, {"params": biases, "lr": 3e-3, "weight_decay": 0.0}],
        lr=1e-2,
        weight_decay=0.01,
    )
    return model, optimizer


def batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(5, 6, generator=g, dtype=torch.float64)


def train(
    spec: str, directory: Path, rank: int, steps: int = STEPS, batch_norm: bool = False
) -> tuple[nn.Module, torch.optim.Optimizer]:
    """``steps`` steps of ``spec``, a checkpoint after every second one (the last at
    ``steps``); the model and optimizer as they are then."""
    model, optimizer = build(batch_norm)
    sync = gs.Synchronizer(model, optimizer, strategy=spec, timeout_s=30)
    try:
        for step in range(steps):
            with sync.step():
                model(batch(step, rank)).pow(2).mean().backward()
            if (step + 1) % 2 == 0:
                sync.save(directory, data_position=step + 1)
    finally:
        sync.close()
    return model, optimizer


def trained(rank: int, world: int, root: str) -> dict[str, dict[str, Any]]:
    """Every strategy of ``STRATEGIES``, each into ``root/<spec>``, and ``bsp`` with BatchNorm
    into ``root/bsp-batchnorm``: this rank's model and optimizer state dicts after the last
    checkpoint."""
    out = {}
    for spec in (*STRATEGIES, BATCH_NORM):
        batch_norm = spec == BATCH_NORM
        name = "bsp" if batch_norm else spec
        model, optimizer = train(
            name, Path(root) / spec.replace(":", "-"), rank, batch_norm=batch_norm
        )
        out[spec] = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    return out
