"""Rank functions for the synchronization-dial tests (importable by spawned ranks)."""

from __future__ import annotations

import time
from typing import Any

import torch

import gradsync as gs
from gradsync import inject
from gradsync.errors import SyncTimeoutError
from gradsync.strategies import DiLoCo
from gradsync.workloads import make_workload
from tests.support.ranks import flat_params

PER_RANK = 4


def train(
    rank: int,
    world: int,
    strategy: Any,
    steps: int,
    *,
    lr: float = 0.05,
    slow: float = 1.0,
    servers: int = 1,
) -> dict[str, Any]:
    """Plain SGD on the float64 mlp, worker 1 computing ``slow`` times as slowly; returns
    parameters, per-step bytes and server stats."""
    w = make_workload("mlp", seed=5, params=3000, dtype="float64")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sync = gs.Synchronizer(model, opt, strategy=strategy, timeout_s=20, servers=servers)
    if slow > 1:
        inject.slow(sync, rank=1, factor=slow)
    if sync.is_server:
        stats = sync.serve()
        return {"server": stats}
    workers = sync.num_workers
    for step in range(steps):
        with sync.step(samples=PER_RANK):
            x, y = w.batch(step, PER_RANK * workers, rank * PER_RANK, (rank + 1) * PER_RANK)
            w.loss(model, x, y).backward()
    report = sync.report()
    mine = [r for r in report.records if r.rank == rank]
    return {
        "params": flat_params(model),
        "bytes": [r.bytes for r in mine],
        "idle": [r.idle for r in mine],
        "barrier": [r.barrier for r in mine],
    }


def equivalences(rank: int, world: int) -> dict[str, Any]:
    return {
        "bsp": train(rank, world, "bsp", 8),
        "local:1": train(rank, world, "local:1", 8),
        "local:4": train(rank, world, "local:4", 8),
        "diloco:4 plain": train(
            rank, world, DiLoCo(4, outer_lr=1.0, outer_momentum=0.0, nesterov=False), 8
        ),
        "diloco:4": train(rank, world, "diloco:4", 8),
    }


def ssp_zero(rank: int, world: int, servers: int = 1) -> dict[str, Any]:
    return train(rank, world, "ssp:0", 10, servers=servers)


def scheduled_groups(rank: int, world: int, strategy: str, servers: int = 1) -> dict[str, Any]:
    """Plain SGD with weights and biases in two param groups of different lr, and an LR
    schedule stepped after every step on every training rank."""
    w = make_workload("mlp", seed=5, params=3000, dtype="float64")
    model = w.build_model()
    named = list(model.named_parameters())
    weights = [p for n, p in named if n.endswith("weight")]
    biases = [p for n, p in named if n.endswith("bias")]
    opt = torch.optim.SGD([{"params": weights, "lr": 0.05}, {"params": biases, "lr": 0.3}], lr=0.1)
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.6**step)
    sync = gs.Synchronizer(model, opt, strategy=strategy, servers=servers, timeout_s=20)
    if sync.is_server:
        return {"server": sync.serve()}
    workers = sync.num_workers
    for step in range(6):
        with sync.step():
            x, y = w.batch(step, PER_RANK * workers, rank * PER_RANK, (rank + 1) * PER_RANK)
            w.loss(model, x, y).backward()
        schedule.step()
    sync.report()
    return {"params": flat_params(model)}


def staleness(rank: int, world: int, spec: str) -> dict[str, Any]:
    # Worker 1 computes 4x as slowly: under async the fast worker runs ahead of it.
    return train(rank, world, spec, 16, slow=4)


def staleness_each(rank: int, world: int, specs: list[str]) -> dict[str, Any]:
    """``staleness`` under each of ``specs`` in turn, in one process group (one start-up)."""
    return {spec: staleness(rank, world, spec) for spec in specs}


def adamw_on_servers(rank: int, world: int) -> dict[str, Any]:
    """The server rebuilds the user's optimizer: AdamW's param group carries keys that its
    constructor does not take."""
    w = make_workload("mlp", seed=5, params=3000)
    model = w.build_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    sync = gs.Synchronizer(model, opt, strategy="ssp:1", timeout_s=20)
    if sync.is_server:
        return {"server": sync.serve()}
    for step in range(4):
        with sync.step():
            x, y = w.batch(step, 8, rank * 4, rank * 4 + 4)
            w.loss(model, x, y).backward()
    sync.report()
    return {"params": flat_params(model)}


def _train_until_failure(rank: int, sync: gs.Synchronizer, w: Any, model: Any) -> dict[str, Any]:
    """Workers: train until a synchronizing wait fails; how long that took, and the error."""
    t0 = time.monotonic()
    try:
        for step in range(5):
            with sync.step():
                x, y = w.batch(step, 8, rank * 4, rank * 4 + 4)
                w.loss(model, x, y).backward()
    except SyncTimeoutError as exc:
        return {"error": f"{type(exc).__name__}: {exc}", "seconds": time.monotonic() - t0}
    return {"error": None, "seconds": time.monotonic() - t0}


def server_dies(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    w = make_workload("mlp", seed=5, params=3000, dtype="float64")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = gs.Synchronizer(model, opt, strategy="ssp:1", timeout_s=timeout_s)
    if sync.is_server:  # serve nothing: vanish without a word at the workers' step 0
        inject.kill()
    return _train_until_failure(rank, sync, w, model)


def server_hangs(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    """The server stays alive, connections open, but never serves (stuck in a long
    computation); it gives up only once every worker has its verdict."""
    w = make_workload("mlp", seed=5, params=3000, dtype="float64")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = gs.Synchronizer(model, opt, strategy="ssp:1", timeout_s=timeout_s)
    if sync.is_server:
        inject.hang(peers=range(sync.num_workers), limit_s=timeout_s + 60)
        return {}
    out = _train_until_failure(rank, sync, w, model)
    inject.release_hang()
    return out


def too_many_servers(rank: int, world: int) -> str:
    """Two servers for a model of one parameter tensor: every rank refuses it."""
    model = torch.nn.Linear(4, 2, bias=False)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    try:
        gs.Synchronizer(model, opt, strategy="async", servers=2, timeout_s=20)
    except gs.UsageError as exc:
        return str(exc)
    return "accepted"
