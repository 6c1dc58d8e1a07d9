"""Rank function for tests/ranks/test_ps_blame.py (module level, so spawned ranks import it)."""

from __future__ import annotations

import time
from typing import Any

import torch

import gradsync as gs
from gradsync.workloads import make_workload

#: the Synchronizer's timeout in the test: short, so the run fails within seconds
TIMEOUT_S = 2.0


def one_worker_busy_between_steps(rank: int, world: int, busy: int) -> dict[str, Any]:
    """Two workers and a server under ``ssp:0``; worker ``busy`` spends over two timeouts in its
    own code between steps 1 and 2 (an evaluation), the other keeps training. Returns the
    error each rank ended with (None: none)."""
    w = make_workload("mlp", seed=3, params=1000, dtype="float32")
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    sync = gs.Synchronizer(model, opt, strategy="ssp:0", timeout_s=TIMEOUT_S)
    try:
        if sync.is_server:
            sync.serve()
            return {"error": None}
        for step in range(6):
            if rank == busy and step == 2:
                time.sleep(2 * TIMEOUT_S + 1)  # the evaluation, past the timeout
            with sync.step():
                w.loss(model, *w.batch(step, 8, rank * 4, rank * 4 + 4)).backward()
        sync.report()
    except Exception as exc:  # noqa: BLE001 - the error is what the test reads
        return {"error": str(exc)}
    return {"error": None}
