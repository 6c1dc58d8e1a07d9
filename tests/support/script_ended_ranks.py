"""Rank functions for tests/ranks/test_script_ended.py: a rank whose script ends early while its
process lingers, as ``gradsync run``'s worker does after a script's ``sys.exit(0)``. Module
level, so spawned ranks can import them."""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import gradsync as gs
from gradsync.attached_run import RUN_DIR_ENV
from gradsync.errors import SyncTimeoutError
from gradsync.synchronizer import scripts_ended
from gradsync.workloads import make_workload
from tests.support.ranks import make_optimizer

#: how long the ended rank's process lingers: far longer than the word must take to arrive
LINGER_S = 20.0


def ends_early(rank: int, world: int, directory: str) -> dict[str, Any]:
    """Every rank attached to a run directory (as ``gradsync run``'s are) takes 3 steps; then
    rank 1's script ends (``scripts_ended``, what the worker calls once it returned) and its
    process lingers, while rank 0 starts step 3. Rank 0 must fail within seconds, naming how
    rank 1 ended, not wait for it as for a rank in its own code (up to 1800 s)."""
    os.environ[RUN_DIR_ENV] = directory
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    sync = gs.Synchronizer(model, make_optimizer("sgd", model), timeout_s=60)
    for step in range(3):
        with sync.step():
            x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
            w.loss(model, x, y).backward()
    done = Path(directory) / "rank-0-done"
    if rank == 1:
        scripts_ended("sys.exit(0)")
        deadline = time.monotonic() + LINGER_S
        while not done.exists() and time.monotonic() < deadline:
            time.sleep(0.1)  # lingers until rank 0 is done, at most LINGER_S
        return {"ended": True}
    started = time.monotonic()
    try:
        with sync.step():
            x, y = w.batch(3, 4 * world, 0, 4)
            w.loss(model, x, y).backward()
    except SyncTimeoutError as exc:
        return {"error": str(exc), "waited": time.monotonic() - started}
    finally:
        done.touch()
    return {"error": None}
