"""Rank functions for guard, diagnosis, divergence and balance tests."""

from __future__ import annotations

import time
from typing import Any

import torch

import gradsync as gs
from gradsync.balance import ShardBalancer
from gradsync.errors import DivergenceError, SyncTimeoutError
from gradsync.workloads import make_workload
from tests.ranks import flat_params, make_optimizer


def nan_once(rank: int, world: int, compression: str | None) -> dict[str, Any]:
    """Rank 1's gradient turns NaN at step 3; everyone must skip step 3 and only step 3."""
    w = make_workload("mlp", seed=2, params=3000, dtype="float64")
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, compression=compression, bucket_mb=0.005)
    snapshots = []
    for step in range(8):
        with sync.step():
            x, y = w.batch(step, 8, rank * 4, rank * 4 + 4)
            loss = w.loss(model, x, y)
            if step == 3 and rank == 1:
                loss = loss * float("nan")
            loss.backward()
        snapshots.append(flat_params(model))
    report = sync.report()
    return {
        "skipped": sorted({r.step for r in report.records if r.skipped}),
        "report_skipped": report.skipped_steps,
        "unchanged_at_skip": torch.equal(snapshots[2], snapshots[3]),
        "params": flat_params(model),
    }


def hang_at_step_5(rank: int, world: int) -> dict[str, Any]:
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, timeout_s=4)
    started = time.monotonic()
    try:
        for step in range(10):
            if rank == 1 and step == 5:
                time.sleep(15)  # stops participating without a word
                return {"slept": True}
            with sync.step():
                x, y = w.batch(step, 8, rank * 4, rank * 4 + 4)
                w.loss(model, x, y).backward()
            started = time.monotonic()
    except SyncTimeoutError as exc:
        return {"error": str(exc), "waited": time.monotonic() - started}
    return {"error": None}


def perturbed(rank: int, world: int) -> dict[str, Any]:
    w = make_workload("mlp", seed=2, params=3000, dtype="float64")
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, check_every=5)
    done = []
    try:
        for step in range(12):
            with sync.step():
                x, y = w.batch(step, 8, rank * 4, rank * 4 + 4)
                w.loss(model, x, y).backward()
            done.append(step)
            if step == 6 and rank == 1:
                with torch.no_grad():
                    model[2].bias[0] += 1e-3  # one element of one tensor, on one rank
    except DivergenceError as exc:
        return {"error": str(exc), "completed": done}
    return {"error": None, "completed": done}


def uneven_shares(rank: int, world: int, optimizer: str) -> torch.Tensor:
    """Deliberately unequal fixed shards: the update must still be the global-batch mean."""
    w = make_workload("mlp", seed=3, params=5000, dtype="float64")
    model = w.build_model()
    opt = make_optimizer(optimizer, model)
    shares = [1.0, 3.0, 2.0][:world]
    sync = gs.Synchronizer(model, opt, balance=ShardBalancer(world, shares=shares, adapt=False))
    gb = 6 * world
    for step in range(10):
        sizes = sync.shard_sizes(gb)
        lo = sum(sizes[:rank])
        with sync.step():
            x, y = w.batch(step, gb, lo, lo + sizes[rank])
            w.loss(model, x, y).backward()
    return flat_params(model)


def adaptive_shares(rank: int, world: int) -> list[list[int]]:
    """Rank 1 is 3x slower during steps 10-39; shards should follow it there and back."""
    w = make_workload("mlp", seed=3, params=200_000)
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, balance=True, telemetry_every=5, slow="1:3@10-40")
    gb = 512  # enough samples that compute, not the fixed per-step cost, dominates
    history = []
    for step in range(90):
        sizes = sync.shard_sizes(gb)
        history.append(sizes)
        lo = sum(sizes[:rank])
        with sync.step():
            x, y = w.batch(step, gb, lo, lo + sizes[rank])
            w.loss(model, x, y).backward()
    return history
