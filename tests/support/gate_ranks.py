"""Rank functions for tests/ranks/test_gate.py: the user's code between steps, a block that raises,
ranks at different places. Module level, so spawned ranks can import them."""

from __future__ import annotations

import os
import signal
import time
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync import compat
from gradsync.errors import SyncTimeoutError
from gradsync.workloads import make_workload
from tests.support.ranks import flat_params, make_optimizer

TIMEOUT_S = 2.0  # the Synchronizer's, far below what these scenarios spend elsewhere


def _setup(strategy: str = "bsp", **kw: Any) -> tuple[Any, Any, Any, gs.Synchronizer]:
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, strategy=strategy, timeout_s=TIMEOUT_S, **kw)
    return w, model, opt, sync


def _train_step(w: Any, model: Any, rank: int, world: int, step: int) -> None:
    x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
    w.loss(model, x, y).backward()


def long_evaluation_on_rank_0(rank: int, world: int, strategy: str) -> dict[str, Any]:
    """Rank 0 evaluates for 1.6x the timeout between steps 1 and 2 while the others go on to
    the next step (and wait for it at the step's gate); between steps 3 and 4 every rank
    averages a metric with a collective of its own. Training must go on, as under DDP."""
    w, model, _, sync = _setup(strategy)
    for step in range(6):
        with sync.step():
            _train_step(w, model, rank, world, step)
        if step == 1 and rank == 0:
            time.sleep(1.6 * TIMEOUT_S)  # the evaluation
        if step == 3:
            metric = torch.ones(1)
            dist.all_reduce(metric)  # the user's own collective, under their own timeout
    sync.report()
    return {"params": flat_params(model), "steps": sync.step_count}


def long_evaluation_each(rank: int, world: int, strategies: list[str]) -> dict[str, Any]:
    """``long_evaluation_on_rank_0`` under each strategy in turn, in one process group."""
    return {s: long_evaluation_on_rank_0(rank, world, s) for s in strategies}


def frozen_between_steps(
    rank: int, world: int, frozen: int | None = None, **kw: Any
) -> dict[str, Any]:
    """Rank ``frozen`` (the last one by default) is stopped (SIGSTOP) between steps 2 and 3:
    the others must fail within the timeout, not wait for it as for a rank in its own code. (A
    process that merely stops beating while it runs is busy, holding the GIL: waited for,
    tests/ranks/test_gate_hardening.py.) ``kw``: more settings of the Synchronizer."""
    frozen = world - 1 if frozen is None else frozen
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())
    w, model, _, sync = _setup(**kw)
    for step in range(3):
        with sync.step():
            _train_step(w, model, rank, world, step)
    if rank == frozen:
        time.sleep(1.0)  # alive in its own code for a while: its heartbeat is seen
        os.kill(os.getpid(), signal.SIGSTOP)  # until the others have their error
        return {"stayed_away": True}
    return step_while_stopped(w, model, sync, rank, world, compat.default_store(), pids[frozen])


def step_while_stopped(
    w: Any, model: Any, sync: gs.Synchronizer, rank: int, world: int, store: Any, stopped: int
) -> dict[str, Any]:
    """A survivor's step 3 while process ``stopped`` is SIGSTOPped: its error and how long it
    took to fail. The last survivor to fail (counted in ``store``, which must still answer)
    lets the stopped one go on: a peer that beats again would be waited for."""
    started = time.monotonic()
    try:
        with sync.step():
            _train_step(w, model, rank, world, 3)
    except SyncTimeoutError as exc:
        waited = time.monotonic() - started
        if int(store.add("test/frozen/failed", 1)) == world - 1:
            os.kill(stopped, signal.SIGCONT)
        return {"error": str(exc), "waited": waited}
    return {"error": None}


class Boom(ValueError):
    """The user's exception."""


def raises_in_block(rank: int, world: int, strategy: str, where: str) -> dict[str, Any]:
    """Rank 1's block raises at step 3 (``where``: before its backward pass, or after it,
    and after it with rank 0 reaching step 3 a second late, so that rank 1's buckets are
    held back for the step gate when it raises); the user catches it and trains on. Every
    rank must skip step 3 together (bsp) and stay in step: same step counts, identical
    replicas at the end."""
    w, model, _, sync = _setup(strategy)
    skipped, reasons, caught = [], [], []
    for step in range(6):
        if rank == 0 and step == 3 and where.endswith("rank 0 late"):
            time.sleep(1.0)
        try:
            with sync.step() as h:
                if rank == 1 and step == 3 and where == "before backward":
                    raise Boom("bad batch")
                _train_step(w, model, rank, world, step)
                if rank == 1 and step == 3 and where.startswith("after backward"):
                    raise Boom("bad batch")
        except Boom:
            caught.append(step)
            continue
        if h.skipped:
            skipped.append(step)
            reasons.append(h.skip_reason)
    sync.report()
    return {
        "params": flat_params(model),
        "steps": sync.step_count,
        "skipped": skipped,
        "reasons": reasons,
        "caught": caught,
    }


def raises_in_block_each_way(rank: int, world: int) -> dict[str, Any]:
    """``raises_in_block`` for each (strategy, where) of RAISES, in one process group."""
    return {case: raises_in_block(rank, world, *case) for case in RAISES}


RAISES = [
    ("bsp", "before backward"),
    ("bsp", "after backward"),
    ("bsp", "after backward, rank 0 late"),
    ("local:2", "before backward"),
]


def raises_while_peer_stopped(rank: int, world: int) -> dict[str, Any]:
    """``local:2``: rank 1's block raises at step 3, an exchange step, while rank 0 is stopped
    (SIGSTOP) between steps 2 and 3. The exchange rank 1 still takes part in must first wait
    at the gate, which names rank 0 within the timeout, not wait in the collective for the
    group's own timeout; the failure is a note on rank 1's exception (``_abandon``)."""
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())
    w, model, _, sync = _setup("local:2")
    for step in range(3):
        with sync.step():
            _train_step(w, model, rank, world, step)
    if rank == 0:
        time.sleep(1.0)  # alive in its own code for a while: its heartbeat is seen
        os.kill(os.getpid(), signal.SIGSTOP)  # until rank 1 has its error
        return {"stayed_away": True}
    started = time.monotonic()
    try:
        with sync.step():
            raise Boom("bad batch")
    except Boom as exc:
        notes = list(getattr(exc, "__notes__", []))
    waited = time.monotonic() - started
    os.kill(pids[0], signal.SIGCONT)
    return {"notes": notes, "waited": waited}


def raises_uncaught(rank: int, world: int) -> dict[str, Any]:
    """Rank 1's block raises at step 3 and nothing catches it: the others must fail within
    seconds (not the timeout), naming rank 1 and its exception."""
    w, model, _, sync = gs_setup_long_timeout()
    started = time.monotonic()
    try:
        for step in range(6):
            with sync.step():
                if rank == 1 and step == 3:
                    raise Boom("bad batch")
                _train_step(w, model, rank, world, step)
            started = time.monotonic()
    except SyncTimeoutError as exc:
        return {"error": str(exc), "waited": time.monotonic() - started}
    return {"error": None}


def gs_setup_long_timeout() -> tuple[Any, Any, Any, gs.Synchronizer]:
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    return w, model, opt, gs.Synchronizer(model, opt, timeout_s=60)


def save_on_rank_0_only(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Rank 0 calls sync.save() after step 1; rank 1 goes on to step 2: both must fail within
    the timeout, each saying where the other is."""
    w, model, _, sync = _setup()
    for step in range(2):
        with sync.step():
            _train_step(w, model, rank, world, step)
    try:
        if rank == 0:
            sync.save(directory)
        else:
            with sync.step():
                _train_step(w, model, rank, world, 2)
    except SyncTimeoutError as exc:
        return {"error": str(exc)}
    return {"error": None}
