"""Rank functions for the synchronization-dial tests (importable by spawned ranks)."""

from __future__ import annotations

import os
import signal
from typing import Any

import torch

import gradsync as gs
from gradsync.strategies import DiLoCo
from gradsync.workloads import make_workload
from tests.ranks import flat_params

PER_RANK = 4


def train(
    rank: int, world: int, strategy: Any, steps: int, *, lr: float = 0.05, slow: str | None = None
) -> dict[str, Any]:
    """Plain SGD on the float64 mlp; returns parameters, per-step bytes and server stats."""
    w = make_workload("mlp", seed=5, params=3000, dtype="float64")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    sync = gs.Synchronizer(model, opt, strategy=strategy, slow=slow, timeout_s=20)
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


def ssp_zero(rank: int, world: int) -> dict[str, Any]:
    return train(rank, world, "ssp:0", 10)


def staleness(rank: int, world: int, spec: str) -> dict[str, Any]:
    # Worker 1 computes 4x as slowly: under async the fast worker runs ahead of it.
    return train(rank, world, spec, 16, slow="1:4")


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


def server_dies(rank: int, world: int) -> dict[str, Any]:
    w = make_workload("mlp", seed=5, params=3000, dtype="float64")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = gs.Synchronizer(model, opt, strategy="ssp:1", timeout_s=10)
    if sync.is_server:
        for _ in range(3):  # serve nothing, then vanish without a word at the workers' step 0
            pass
        os.kill(os.getpid(), signal.SIGKILL)
    for step in range(5):
        with sync.step():
            x, y = w.batch(step, 8, rank * 4, rank * 4 + 4)
            w.loss(model, x, y).backward()
    return {}
