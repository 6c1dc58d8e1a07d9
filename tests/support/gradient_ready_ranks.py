"""Rank functions for the gradient-ready point (``s.synchronize()``) and final agreement
(module level, so spawned ranks can import them)."""

from __future__ import annotations

import os
from typing import Any

import torch

import gradsync as gs
from gradsync import inject
from gradsync.compression.base import Compressor
from gradsync.workloads import make_workload

MAX_NORM = 0.05
PER_RANK = 4


def _mlp() -> Any:
    return make_workload("mlp", seed=3, params=5000, dtype="float64")


def _flat(model: torch.nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in model.parameters()])


def clipped_reference(world: int, steps: int) -> torch.Tensor:
    """One process on the global batch, clipping the mean gradient: what BSP must equal."""
    w = _mlp()
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    for step in range(steps):
        opt.zero_grad()
        x, y = w.batch(step, PER_RANK * world, 0, PER_RANK * world)
        w.loss(model, x, y).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        opt.step()
    return _flat(model)


def _claim_host(rank: int, allreduce: str) -> None:
    """Under ``allreduce="hierarchical"``: ranks 0 and 1 on one host (its intra-host reduce
    and broadcast), any third on another (the leaders' exchange, a compressor's hook)."""
    if allreduce == "hierarchical":
        os.environ["GRADSYNC_HOST"] = f"host-{min(rank // 2, 1)}"


def clip_at_the_gradient_ready_point(
    rank: int,
    world: int,
    strategy: str,
    steps: int,
    clip: bool,
    compression: str | Compressor | None = None,
    allreduce: str = "ring",
) -> dict[str, Any]:
    """Two micro-batches a step; clip at ``s.synchronize()`` (or not)."""
    _claim_host(rank, allreduce)
    w = _mlp()
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    start = _flat(model)
    sync = gs.Synchronizer(
        model,
        opt,
        strategy=strategy,
        bucket_mb=0.01,
        check_every=1,
        compression=compression,
        allreduce=allreduce,
    )
    if sync.is_server:
        sync.serve()
        return {}
    gb = PER_RANK * sync.num_workers
    norms, ready = [], []
    for step in range(steps):
        with sync.step(micro_batches=2) as s:
            for half in range(2):
                lo = rank * PER_RANK + half * PER_RANK // 2
                x, y = w.batch(step, gb, lo, lo + PER_RANK // 2)
                w.loss(model, x, y).backward()
            ready.append(s.synchronize())
            if clip:
                norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)))
    sync.report()
    return {"final": _flat(model), "start": start, "norms": norms, "ready": ready}


def skip_is_reported_on_the_handle(rank: int, world: int) -> dict[str, Any]:
    w = _mlp()
    model = w.build_model()
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    inject.nan_gradient(sync, rank=1, step=2)
    ready, skipped = [], []
    for step in range(4):
        with sync.step() as s:
            x, y = w.batch(step, PER_RANK * world, rank * PER_RANK, (rank + 1) * PER_RANK)
            w.loss(model, x, y).backward()
            ready.append(s.synchronize())
        skipped.append(s.skipped)
    sync.report()
    return {"ready": ready, "skipped": skipped}


def periodic_ending_mid_period(rank: int, world: int, strategy: str, steps: int) -> torch.Tensor:
    w = _mlp()
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = gs.Synchronizer(model, opt, strategy=strategy, check_every=0)
    for step in range(steps):
        with sync.step():
            x, y = w.batch(step, PER_RANK * world, rank * PER_RANK, (rank + 1) * PER_RANK)
            w.loss(model, x, y).backward()
    sync.report()
    return _flat(model)


def accumulate(rank: int, world: int, strategy: str, accumulation: str, divide: bool) -> Any:
    """Two micro-batches a step; ``divide``: each loss divided by 2, as DDP scripts do. Plain
    SGD: under ssp:0 the two workers' pushes may land in either order, which only rounding
    can tell apart without momentum."""
    w = _mlp()
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = gs.Synchronizer(model, opt, strategy=strategy, accumulation=accumulation)
    if sync.is_server:
        sync.serve()
        return None
    gb = PER_RANK * sync.num_workers
    for step in range(4):
        with sync.step(micro_batches=2):
            for half in range(2):
                lo = rank * PER_RANK + half * PER_RANK // 2
                loss = w.loss(model, *w.batch(step, gb, lo, lo + PER_RANK // 2))
                (loss / 2 if divide else loss).backward()
    sync.report()
    return _flat(model)


def accumulate_each_way(rank: int, world: int, strategy: str) -> Any:
    """``accumulate`` three ways in one process group (one start-up): the mean convention, the
    DDP style under ``accumulation="sum"``, and the DDP style left under the mean."""
    return [
        accumulate(rank, world, strategy, accumulation, divide)
        for accumulation, divide in (("mean", False), ("sum", True), ("mean", True))
    ]


def mismatched_models(rank: int, world: int, kind: str) -> str | None:
    """Rank 1 builds a different model: a transposed layer of the same size, or one more."""
    from torch import nn

    from gradsync.errors import UsageError

    layers: list[nn.Module] = [nn.Linear(16, 8), nn.Linear(8, 1)]
    if rank == 1 and kind == "transposed":
        layers[0] = nn.Linear(8, 16, bias=False)
        layers.insert(1, nn.Linear(16, 8))
    if rank == 1 and kind == "extra":
        layers.append(nn.Linear(1, 1))
    model = nn.Sequential(*layers)
    try:
        gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), timeout_s=10)
    except UsageError as exc:
        return str(exc)
    return None


def nan_on_one_parameter_server_worker(rank: int, world: int, compression: str | None) -> Any:
    """Worker 1's gradient is NaN at step 2 under async with one server."""
    w = _mlp()
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sync = gs.Synchronizer(model, opt, strategy="async", compression=compression)
    if sync.is_server:
        return {"server": sync.serve()}
    inject.nan_gradient(sync, rank=1, step=2)
    skipped = []
    for step in range(6):
        with sync.step() as s:
            w.loss(model, *w.batch(step, 8, rank * 4, rank * 4 + 4)).backward()
        skipped.append(s.skipped)
    report = sync.report()
    return {
        "finite": bool(torch.isfinite(_flat(model)).all()),
        "skipped": skipped,
        "skipped_steps": report.skipped_steps,
    }


def clip_inside_the_block(
    rank: int, world: int, compression: str | Compressor | None = None, allreduce: str = "ring"
) -> dict[str, Any]:
    """Issue 42, trap 2: the clip inside the block before ``s.synchronize()`` (refused at the
    first step, on every rank), then after it in another Synchronizer, then through
    ``s.clip_grad_norm_`` in a third (no error for either)."""
    from gradsync.errors import UsageError

    _claim_host(rank, allreduce)
    out: dict[str, Any] = {}
    for where in ("before", "after", "handle"):
        w = _mlp()
        model = w.build_model()
        sync = gs.Synchronizer(
            model,
            torch.optim.SGD(model.parameters(), lr=0.1),
            timeout_s=20,
            compression=compression,
            allreduce=allreduce,
        )
        try:
            for step in range(3):
                with sync.step() as s:
                    x, y = w.batch(step, PER_RANK * world, rank * PER_RANK, (rank + 1) * PER_RANK)
                    w.loss(model, x, y).backward()
                    if where == "after":
                        s.synchronize()
                    if where == "handle":
                        s.clip_grad_norm_(MAX_NORM)
                    else:
                        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
            out[where] = None
        except UsageError as exc:
            out[where] = (step, str(exc))
        finally:
            sync.close()
    return out
