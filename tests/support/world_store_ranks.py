"""Rank functions for tests/ranks/test_world_store_stopped.py: the world's store served by rank
0's own process (as under ``gradsync run --max-restarts`` or a script's own ``env://``), and
rank 0 stopped (SIGSTOP). Module level, so spawned ranks can import them."""

from __future__ import annotations

import datetime
import os
import signal
import time
from typing import Any

import torch.distributed as dist

from gradsync import compat
from gradsync.processes.stores import server_store
from tests.support.gate_ranks import TIMEOUT_S, _setup, _train_step, step_while_stopped

#: the process group's own timeout: far beyond what the survivors may take to fail
GROUP_TIMEOUT_S = 60


def _world_store_on_rank_0(rank: int, world: int) -> Any:
    """Remake the default process group over a TCPStore that rank 0's process serves; the
    harness's store (served by the test's process), which stays reachable, for the test's own
    coordination."""
    harness = compat.default_store()
    dist.destroy_process_group()
    timeout = datetime.timedelta(seconds=GROUP_TIMEOUT_S)
    if rank == 0:
        store = server_store("127.0.0.1", 0, timeout=timeout)
        harness.set("test/world_store_port", str(store.port))
    else:
        port = int(harness.get("test/world_store_port"))
        store = dist.TCPStore("127.0.0.1", port, world, False, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=timeout)
    return harness


def rank_0_stopped(rank: int, world: int, strategy: str, where: str) -> dict[str, Any]:
    """Rank 0 serves the world's store and is stopped at step 3: ``where`` "between steps"
    (its peers wait for it at the step gate), "at once" (the same, stopped as its step 2 ends
    while its peers stay 1.5 s in their own code) or "in its step" (after the gate, before its
    backward pass: its peers' exchange times out, and naming who never arrived reads the
    store). The others must fail within about the timeout, naming rank 0 and the store,
    instead of blocking in a store call for ever."""
    harness = _world_store_on_rank_0(rank, world)
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())
    w, model, _, sync = _setup(strategy)
    for step in range(3):
        with sync.step():
            _train_step(w, model, rank, world, step)
    if rank == 0:
        if where == "at once":
            os.kill(os.getpid(), signal.SIGSTOP)
        elif where == "between steps":
            time.sleep(1.0)  # alive in its own code for a while: its heartbeat is seen
            os.kill(os.getpid(), signal.SIGSTOP)  # until the others have their error
        else:
            try:
                with sync.step():
                    time.sleep(1.0)  # every rank passes the gate meanwhile
                    os.kill(os.getpid(), signal.SIGSTOP)
            except Exception:  # noqa: BLE001 - continued, it leaves its block with no backward
                pass
        return {"stayed_away": True}
    if where == "at once":
        # In their own code meanwhile: the heartbeat thread is left in a call first, and this
        # rank's own first call of the step's gate (its key's set) must wait behind it.
        time.sleep(1.5)
    return step_while_stopped(w, model, sync, rank, world, harness, pids[0])


__all__ = ["GROUP_TIMEOUT_S", "TIMEOUT_S", "rank_0_stopped"]
