"""Rank functions for tests/ranks/test_gate_hardening.py: another process in the run's store
(issue 43, item 1) and a rank holding the GIL between steps (item 5)."""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import threading
import time
from typing import Any

import torch.distributed as dist

from gradsync import compat
from gradsync.errors import SyncTimeoutError
from tests.support.gate_ranks import _setup, _train_step
from tests.support.ranks import flat_params

GATES = "gradsync/arrive/gate/"
#: gates the attacker pre-arms ahead of the one it saw (the issue's figure)
AHEAD = 200
STEPS = 12


def _tcp_store() -> Any:
    """The TCPStore under the default group's prefixes: what another process connects to."""
    store = compat.default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return store


def _attack(host: str, port: int, stop: threading.Event, armed: list[str]) -> None:
    """What the issue's tester did, as a client of its own with no credentials: list the keys,
    and on seeing a gate counter add the world size to the counters of the next gates, so
    that no rank ever brings one to the world size."""
    client = dist.TCPStore(host, port, is_master=False, timeout=datetime.timedelta(seconds=10))
    seen: set[str] = set()
    while not stop.is_set():
        for key in client.list_keys():
            head, found, tail = key.partition(GATES)
            if not found or key.endswith("/go") or key in seen:
                continue
            seen.add(key)
            count, step, _ = tail.split("/", 2)
            armed.append(key)
            for k in range(1, AHEAD + 1):
                made = f"{head}{GATES}{int(count) + k}/{int(step) + k}/the step"
                seen.add(made)  # its own, not one it found
                client.add(made, 2)
        time.sleep(0.02)


def trains_beside_an_attacker(rank: int, world: int) -> dict[str, Any]:
    """Rank 0 also runs the attacker, on a connection of its own to the run's store."""
    stop, armed = threading.Event(), []
    if rank == 0:
        tcp = _tcp_store()
        attacker = threading.Thread(
            target=_attack, args=(tcp.host, tcp.port, stop, armed), daemon=True
        )
        attacker.start()
        time.sleep(0.3)  # listening before the first gate
    w, model, _, sync = _setup()
    for step in range(STEPS):
        with sync.step():
            _train_step(w, model, rank, world, step)
        time.sleep(0.05)  # the user's code between steps: time for the attacker to act
    stop.set()
    return {"params": flat_params(model), "steps": sync.step_count, "armed": armed}


HOLD_S = 6.0  # 3x the timeout (2 s), 4x the heartbeat's silence before blame (1.5 s)


def holds_the_gil_between_steps(rank: int, world: int) -> dict[str, Any]:
    """Rank 1 spends ``HOLD_S`` between steps 1 and 2 in a C call that keeps the GIL (ctypes'
    PyDLL does not release it), so its heartbeat thread cannot run: rank 0 must wait for it as
    for ``time.sleep``, not declare it dead."""
    w, model, _, sync = _setup()
    libc = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6")
    waited = 0.0
    for step in range(4):
        started = time.monotonic()
        try:
            with sync.step():
                _train_step(w, model, rank, world, step)
        except SyncTimeoutError as exc:
            return {"error": str(exc)}
        waited = max(waited, time.monotonic() - started)
        if step == 1 and rank == 1:
            libc.sleep(int(HOLD_S))
    # On one machine the kernel answers for every peer: no voucher is started.
    return {
        "error": None,
        "params": flat_params(model),
        "longest_step": waited,
        "vouching": sync.watch.vouching,
    }
