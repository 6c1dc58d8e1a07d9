"""Rank functions for mixed precision: gradsync with a GradScaler against DDP with one (module
level, so spawned ranks can import them)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch.nn.parallel import DistributedDataParallel

import gradsync as gs
from gradsync import inject
from gradsync.errors import UsageError
from gradsync.workloads import make_workload

PER_RANK = 4
STEPS = 6
INF_STEP = 2  # rank 1's gradient is infinite at this step, under both


def _scaler() -> torch.amp.GradScaler:
    # growth_interval 2: the scale grows during the run too, not only backs off
    return torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2)


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def _batch(w: Any, step: int, rank: int, world: int) -> tuple[torch.Tensor, torch.Tensor]:
    return w.batch(step, PER_RANK * world, rank * PER_RANK, (rank + 1) * PER_RANK)


def _gradsync(rank: int, world: int) -> dict[str, Any]:
    w = make_workload("mlp", seed=3, params=5000)
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = _scaler()
    sync = gs.Synchronizer(model, opt, scaler=scaler)
    inject.nan_gradient(sync, rank=1, step=INF_STEP, value=math.inf)
    scales, skipped = [], []
    for step in range(STEPS):
        with sync.step() as s:
            scaler.scale(w.loss(model, *_batch(w, step, rank, world))).backward()
            s.synchronize()
            scaler.unscale_(opt)
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        scales.append(scaler.get_scale())
        skipped.append(s.skipped)
    sync.report()
    sync.close()
    return {"params": _flat(model), "scales": scales, "skipped": skipped}


def _ddp(rank: int, world: int) -> dict[str, Any]:
    w = make_workload("mlp", seed=3, params=5000)
    model = w.build_model()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = _scaler()
    scales, skipped = [], []
    for step in range(STEPS):
        opt.zero_grad(set_to_none=True)
        hooks = []
        if rank == 1 and step == INF_STEP:  # before DDP's reducer sees the gradient
            hooks = [
                p.register_hook(lambda g: torch.full_like(g, math.inf)) for p in model.parameters()
            ]
        scaler.scale(w.loss(ddp, *_batch(w, step, rank, world))).backward()
        for h in hooks:
            h.remove()
        scaler.unscale_(opt)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        before = scaler.get_scale()
        scaler.step(opt)
        scaler.update()
        scales.append(scaler.get_scale())
        skipped.append(scaler.get_scale() < before)
    return {"params": _flat(model), "scales": scales, "skipped": skipped}


def scaler_against_ddp(rank: int, world: int) -> dict[str, Any]:
    return {"gradsync": _gradsync(rank, world), "ddp": _ddp(rank, world)}


def scaler_with_a_parameter_server(rank: int, world: int) -> str:
    w = make_workload("mlp", seed=3, params=5000)
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        gs.Synchronizer(model, opt, strategy="async", scaler=_scaler())
    except UsageError as exc:
        return str(exc)
    return "accepted"
