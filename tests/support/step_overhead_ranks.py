"""Rank functions for tests/ranks/test_step_overhead.py: what a step does not do on the host.
Module level, so spawned ranks can import them."""

from __future__ import annotations

from typing import Any

import torch

import gradsync as gs
from tests.support.ranks import make_optimizer


def buffer_walks(rank: int, world: int, with_buffer: bool) -> dict[str, Any]:
    """Count the step's walks of the model for buffers: none for a model that had none when
    the Synchronizer was made (as DDP), one a step for a model with one, whose value (set on
    rank 0 between steps) still reaches every rank."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Linear(8, 1))
    if with_buffer:
        model.register_buffer("seen", torch.zeros(1))
    sync = gs.Synchronizer(model, make_optimizer("sgd", model), "bsp", timeout_s=30)
    walks = [0]
    walk = model.buffers

    def counted(*args: Any, **kwargs: Any) -> Any:
        walks[0] += 1
        return walk(*args, **kwargs)

    model.buffers = counted  # type: ignore[method-assign]
    for step in range(4):
        if with_buffer and rank == 0:
            model.seen.fill_(step + 1.0)  # a statistic only rank 0 updates
        with sync.step():
            x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step * world + rank))
            model(x).pow(2).mean().backward()
    sync.close()
    seen = float(model.seen) if with_buffer else None
    return {"walks": walks[0], "seen": seen}


def chunked_initial_broadcast(rank: int, world: int) -> dict[str, Any]:
    """Every rank builds its model from its own seed; with broadcast runs of 1 KB (a few
    tensors each, one tensor alone where it is larger) every rank must start from rank 0's
    parameters and buffers, whatever the dtype."""
    import gradsync.synchronizer as synchronizer

    synchronizer.BROADCAST_CHUNK_BYTES = 1024
    torch.manual_seed(100 + rank)
    model = torch.nn.Sequential(
        *[torch.nn.Linear(16, 16) for _ in range(6)], torch.nn.Linear(16, 300)
    )
    model.register_buffer("counts", torch.randint(0, 1000, (40,)))  # int64: its own run
    sync = gs.Synchronizer(model, make_optimizer("sgd", model), "bsp", timeout_s=30)
    state = {k: v.clone() for k, v in model.state_dict().items()}
    sync.close()
    return {"state": state}
