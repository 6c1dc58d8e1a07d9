"""Rank functions for the ZeRO peak-memory tests (issue 47): what a stage keeps alive while
it steps, read from inside the step (module level, so spawned ranks can import them)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

import gradsync as gs

WIDTH = 64  # 6 Linear(64, 64) weights of 4096 elements each, no biases
LAYERS = 6
#: rounds of 3000 float64 elements per owner at 2 ranks (half a bucket over the ranks): every
#: weight's chunk ends inside a round that also carries the head of a later weight
BUCKET_MB = 3000 * 8 * 2 * 2 / 1e6
STEPS = 2


def build(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    layers: list[nn.Module] = []
    for _ in range(LAYERS):
        layers += [nn.Linear(WIDTH, WIDTH, bias=False), nn.Tanh()]
    return nn.Sequential(*layers).double()


def _batch(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * step + rank)
    return torch.randn(4, WIDTH, generator=g, dtype=torch.float64)


def live_gradients(rank: int, world: int, spec: str) -> dict[str, Any]:
    """Train ``STEPS`` steps under ``spec``; after every gradient the backward pass finishes
    (once gradsync's own hook has run: ours are registered after it), count the elements of
    the gradients alive (``p.grad`` not None). Returns the most seen and the parameters."""
    model = build()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sync = gs.Synchronizer(model, optimizer, strategy=spec, bucket_mb=BUCKET_MB, timeout_s=30)
    params = list(model.parameters())
    most = [0]

    def count(_: torch.Tensor) -> None:
        live = sum(p.grad.numel() for p in params if p.grad is not None)
        most[0] = max(most[0], live)

    handles = [p.register_post_accumulate_grad_hook(count) for p in params]
    for step in range(STEPS):
        with sync.step():
            model(_batch(step, rank)).square().mean().backward()
    for h in handles:
        h.remove()
    out = {
        "most_live": most[0],
        "tensor": WIDTH * WIDTH,
        "params": torch.cat([p.detach().reshape(-1) for p in params]),
    }
    sync.close()
    return out


def both(rank: int, world: int) -> dict[str, Any]:
    return {spec: live_gradients(rank, world, spec) for spec in ("bsp", "zero:2")}
