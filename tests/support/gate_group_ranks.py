"""Rank functions for tests/ranks/test_gate_groups.py: the step gate counted in groups
(gradsync.checks.gate_groups). Module level, so spawned ranks can import them."""

from __future__ import annotations

import os
import time
from typing import Any

import gradsync as gs
from gradsync.options import Limits
from gradsync.workloads import make_workload
from tests.support import gate_ranks, proctree
from tests.support.ranks import flat_params, make_optimizer

TIMEOUT_S = 2.0  # the Synchronizer's, far below what these scenarios spend elsewhere
GROUP_SIZE = 3  # on 4 ranks: groups (0, 1, 2) and (3), a group of one among them


def _setup() -> tuple[Any, Any, gs.Synchronizer]:
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    limits = Limits(timeout_s=TIMEOUT_S, gate_group_size=GROUP_SIZE)
    sync = gs.Synchronizer(model, make_optimizer("sgd", model), "bsp", limits=limits)
    return w, model, sync


def _train_step(w: Any, model: Any, rank: int, world: int, step: int) -> None:
    x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
    w.loss(model, x, y).backward()


def _groups_counted(sync: gs.Synchronizer) -> int:
    """How many arrivals the world's store holds for the latest gate: the groups', where the
    gate is grouped, or the ranks'."""
    gate = sync._gate
    assert gate is not None
    name, world = gate._passing.name, sync.world_size
    return sum(bool(sync._watch.store.check([f"{name}/at/{i}"])) for i in range(world))


def late_member(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 (neither its group's first rank nor last) evaluates for 1.6x the timeout
    between steps 1 and 2: its group's ranks wait at their group's store, rank 3 at the
    world's. Training goes on, as with a flat gate."""
    w, model, sync = _setup()
    for step in range(6):
        with sync.step():
            _train_step(w, model, rank, world, step)
        if step == 1 and rank == 1:
            time.sleep(1.6 * TIMEOUT_S)
    sync.report()
    counted = _groups_counted(sync)
    server = sync._gate._server if sync._gate is not None else None
    # Where the group's store listens (rank 0 serves the first group's): the run's address only.
    listening = (
        [x for x in proctree.listeners_of(os.getpid()) if x.endswith(f":{server.port}")]
        if server is not None
        else None
    )
    return {
        "params": flat_params(model),
        "steps": sync.step_count,
        "counted": counted,
        "group_store_listens_on": listening,
    }


def frozen_member(rank: int, world: int, frozen: int = 2) -> dict[str, Any]:
    """Rank ``frozen`` is stopped (SIGSTOP) between steps 2 and 3: its group's ranks (waiting
    at their group's store) and rank 3 (at the world's) must fail within the timeout, naming
    it. Rank 0 serves the first group's store: stopped, that store answers nobody, and its
    group's ranks must still judge it rather than wait in a store call for ever."""
    return gate_ranks.frozen_between_steps(rank, world, frozen, gate_group_size=GROUP_SIZE)
