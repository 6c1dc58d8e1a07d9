"""Rank functions for the tests of streaming DiLoCo's exchanges posted once the step gate has
opened (module level, so spawned ranks import them)."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from tests.support.ranks import flat_params
from tests.support.streaming_ranks import PER_RANK, _optimizer, _workload

#: fragment 0 of ``diloco:4:2:1`` starts after steps 1, 5 and 9, fragment 1 after 3, 7, 11;
#: each is applied one step later
LATE_AT = 5
#: how long the late rank stays in its own code before ``LATE_AT``: far longer than a step
LATE_S = 1.0


def train(
    rank: int,
    world: int,
    *,
    late: bool,
    gate: bool = True,
    metric: bool = False,
    compression: str | None = None,
) -> dict[str, Any]:
    """12 steps of ``diloco:4:2:1`` on the float64 mlp. ``late``: rank 1 sleeps ``LATE_S``
    between steps before step ``LATE_AT``; ``gate``: the step gate on (the default) or off;
    ``metric``: a collective of the script's own on the world's group after every step."""
    w = _workload()
    model = w.build_model()
    between = gs.Limits().between_steps_timeout_s if gate else None
    sync = gs.Synchronizer(
        model,
        _optimizer(model),
        strategy="diloco:4:2:1",
        compression=compression,
        record_spans=True,
        limits=gs.Limits(timeout_s=30, between_steps_timeout_s=between),
    )
    sums = []
    for step in range(12):
        if late and rank == 1 and step == LATE_AT:
            time.sleep(LATE_S)
        with sync.step(samples=PER_RANK):
            lo = rank * PER_RANK
            x, y = w.batch(step, PER_RANK * world, lo, lo + PER_RANK)
            w.loss(model, x, y).backward()
        if metric:
            value = torch.tensor([float(rank + 1)], dtype=torch.float64)
            dist.all_reduce(value)
            sums.append(float(value))
    own_group = sync.strategy._exchange_pg is not None
    sync.report()
    sync.close()
    return {
        "params": flat_params(model),
        "own_group": own_group,
        "posted": [(s.step, s.name) for s in sync.spans if s.name.startswith("outer_post")],
        "sync_s": {s.step: s.dur for s in sync.spans if s.name == "sync"},
        "sums": sums,
    }


def scenarios(rank: int, world: int) -> dict[str, Any]:
    return {
        "late": train(rank, world, late=True),
        "late, metric": train(rank, world, late=True, metric=True),
        "no gate": train(rank, world, late=False, gate=False),
        "late, powersgd": train(rank, world, late=True, compression="powersgd:1"),
    }
