"""Rank function for the compression convergence test (module level, so spawned ranks import it).

Every configuration trains its own ``charlm`` replica from the same seed on the same batches,
one after the other inside one process group (one start-up for all of them), through the public
API: ``gs.Synchronizer(model, opt, strategy="bsp", compression=spec)``. The final loss is a
held-out loss on fixed evaluation batches, the same for every configuration, rather than the
noisy training loss of the last steps.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.workloads import Workload, make_workload

#: Evaluation batches are ``batch(EVAL_STEP + i, ...)``: step indices no training run reaches.
EVAL_STEP = 1_000_000
EVAL_BATCHES = 8
EVAL_GLOBAL_BATCH = 32


def held_out_loss(workload: Workload, model: torch.nn.Module, rank: int, world: int) -> float:
    """Mean cross-entropy over the fixed evaluation batches; each rank takes its slice."""
    per = EVAL_GLOBAL_BATCH // world
    total = torch.zeros(1, dtype=torch.float64)
    model.eval()
    with torch.no_grad():
        for i in range(EVAL_BATCHES):
            x, y = workload.batch(EVAL_STEP + i, EVAL_GLOBAL_BATCH, rank * per, (rank + 1) * per)
            total += float(workload.loss(model, x, y))
    model.train()
    dist.all_reduce(total)
    return float(total) / (EVAL_BATCHES * world)


def train_each(
    rank: int,
    world: int,
    specs: list[str],
    steps: int,
    seed: int,
    per_rank: int,
    sgd_lr: float | None = None,
) -> dict[str, dict[str, float]]:
    """Train ``charlm`` for ``steps`` BSP steps with each compression spec (``"none"``: plain
    all-reduce) and the workload's own optimizer (AdamW) and learning rate, or SGD with
    momentum 0.9 at ``sgd_lr``; return, per spec, the held-out loss and the mean over ranks of
    the last 10 steps' training loss."""
    torch.set_num_threads(1)
    workload = make_workload("charlm", seed=seed)
    global_batch = per_rank * world
    lo, hi = rank * per_rank, (rank + 1) * per_rank
    out: dict[str, dict[str, float]] = {}
    for spec in specs:
        model = workload.build_model()
        opt = (
            workload.make_optimizer(model, workload.default_lr)
            if sgd_lr is None
            else torch.optim.SGD(model.parameters(), lr=sgd_lr, momentum=0.9)
        )
        sync = gs.Synchronizer(model, opt, strategy="bsp", compression=spec, telemetry=False)
        losses: list[float] = []
        for step in range(steps):
            with sync.step():
                x, y = workload.batch(step, global_batch, lo, hi)
                loss = workload.loss(model, x, y)
                loss.backward()
            losses.append(float(loss.detach()))
        train = torch.tensor(sum(losses[-10:]) / len(losses[-10:]), dtype=torch.float64)
        dist.all_reduce(train)
        out[spec] = {
            "held_out": held_out_loss(workload, model, rank, world),
            "train": float(train) / world,
        }
        sync.close()
    return out
