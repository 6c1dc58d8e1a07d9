"""Rank functions for guard, diagnosis, divergence and balance tests."""

from __future__ import annotations

import time
from typing import Any

import torch

import gradsync as gs
from gradsync import inject
from gradsync.balance import ShardBalancer
from gradsync.errors import DivergenceError, SyncTimeoutError
from gradsync.workloads import make_workload
from tests.support.ranks import flat_params, make_optimizer


def nan_once(rank: int, world: int, compression: str | None) -> dict[str, Any]:
    """Rank 1's gradient turns NaN at step 3; everyone must skip step 3 and only step 3."""
    w = make_workload("mlp", seed=2, params=3000, dtype="float64")
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, compression=compression, bucket_mb=0.005)
    inject.nan_gradient(sync, rank=1, step=3)
    snapshots = []
    for step in range(8):
        with sync.step():
            x, y = w.batch(step, 8, rank * 4, rank * 4 + 4)
            w.loss(model, x, y).backward()
        snapshots.append(flat_params(model))
    report = sync.report()
    return {
        "skipped": sorted({r.step for r in report.records if r.skipped}),
        "report_skipped": report.skipped_steps,
        "unchanged_at_skip": torch.equal(snapshots[2], snapshots[3]),
        "params": flat_params(model),
    }


class _StayedAway(Exception):
    """A hung rank's way out of its step block once its peers have their diagnosis."""


def hang_at_step_5(rank: int, world: int, timeout_s: float) -> dict[str, Any]:
    """The last rank stops participating at step 5 without a word."""
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, timeout_s=timeout_s)
    started = time.monotonic()
    try:
        for step in range(10):
            with sync.step():
                if rank == world - 1 and step == 5:
                    # Stuck inside its step (its peers have passed the step's gate) until
                    # every other rank has its diagnosis; then it leaves by an exception.
                    inject.hang()
                    raise _StayedAway
                x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
                w.loss(model, x, y).backward()
            started = time.monotonic()
    except _StayedAway:
        return {"stayed_away": True}
    except SyncTimeoutError as exc:
        waited = time.monotonic() - started
        inject.release_hang()
        return {"error": str(exc), "waited": waited}
    return {"error": None}


def hang_before_averaging(rank: int, world: int, strategy: str) -> dict[str, Any]:
    """local:4 / diloco:4: the last rank stops before the averaging step 7 (steps 4-7 local)."""
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    # Staying away between steps is waited for up to between_steps_timeout_s (the user's
    # code, such as an evaluation, runs there): keep that short here.
    sync = gs.Synchronizer(model, opt, strategy=strategy, timeout_s=3, between_steps_timeout_s=3)
    started = time.monotonic()
    try:
        for step in range(8):
            if rank == world - 1 and step == 7:
                inject.hang()  # until every other rank has its diagnosis
                return {"stayed_away": True}
            started = time.monotonic()
            with sync.step():
                x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
                w.loss(model, x, y).backward()
    except SyncTimeoutError as exc:
        waited = time.monotonic() - started
        inject.release_hang()
        return {"error": str(exc), "waited": waited}
    return {"error": None}


def skips_report(rank: int, world: int) -> dict[str, Any]:
    """The last rank trains every step but never calls report(). The others are slow in the
    last step, so it waits at that step's exchange long enough to record its arrival there:
    that must not count as arriving at report()'s final check."""
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, timeout_s=3, between_steps_timeout_s=3)
    for step in range(6):
        with sync.step():
            if step == 5 and rank != world - 1:
                time.sleep(2 * sync.watch.arrive_after_s)  # before backward launches buckets
            x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
            w.loss(model, x, y).backward()
    if rank == world - 1:
        # Through the watch's store: gradsync's keys are named by the run's secret (issue 43).
        key = f"{sync.watch.prefix}/{rank}"
        store = sync.watch.store
        recorded = store.get(key).decode() if store.check([key]) else None
        inject.hang()  # until every other rank has its diagnosis
        return {"stayed_away": True, "recorded": recorded}
    started = time.monotonic()
    try:
        sync.report()
    except SyncTimeoutError as exc:
        waited = time.monotonic() - started
        inject.release_hang()
        return {"error": str(exc), "waited": waited}
    return {"error": None}


def perturbed(rank: int, world: int) -> dict[str, Any]:
    w = make_workload("mlp", seed=2, params=3000, dtype="float64")
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, check_every=5)
    done = []
    try:
        for step in range(16):
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


def perturbed_before_the_end(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's parameter changes after the last periodic check: only report()'s catches it."""
    w = make_workload("mlp", seed=2, params=3000, dtype="float64")
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, check_every=5)
    for step in range(8):  # periodic check after step 4 only
        with sync.step():
            x, y = w.batch(step, 8, rank * 4, rank * 4 + 4)
            w.loss(model, x, y).backward()
        if step == 6 and rank == 1:
            with torch.no_grad():
                model[0].weight[0, 0] += 1e-3
    try:
        sync.report()
    except DivergenceError as exc:
        return {"error": str(exc), "steps": sync.step_count}
    return {"error": None, "steps": sync.step_count}


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
    """Rank 1 is 3x slower during steps 10-49 (telemetry every 10 steps, the default); shards
    should follow it there and back."""
    w = make_workload("mlp", seed=3, params=200_000)
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, balance=True)
    inject.slow(sync, rank=1, factor=3, start=10, end=50)
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
