"""Rank functions for tests/ranks/test_gate_ahead.py: the step gate waited on its own thread
from the block's entry (gradsync.checks.gate_ahead). Module level, so spawned ranks can import
them."""

from __future__ import annotations

import threading
import time
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.workloads import make_workload
from tests.support.ranks import flat_params, make_optimizer

TIMEOUT_S = 2.0  # the Synchronizer's, far below the sleeps below


class _CountingStore:
    """A store that counts the requests made on the training thread and on the gate's."""

    def __init__(self, store: Any, training: int) -> None:
        self._store, self._training = store, training
        self.training = self.gate = 0
        #: the gate thread's requests by method (``add``, ``set``, ``wait``, ...)
        self.gate_by: dict[str, int] = {}

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._store, name)
        if not callable(found):
            return found

        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._training:
                self.training += 1
            elif threading.current_thread().name == "gradsync-gate":
                self.gate += 1
                self.gate_by[name] = self.gate_by.get(name, 0) + 1
            return found(*args, **kwargs)

        return counted


def _train(strategy: str, rank: int, world: int, steps: int, hook: Any = None) -> Any:
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    sync = gs.Synchronizer(model, make_optimizer("sgd", model), strategy, timeout_s=TIMEOUT_S)
    for step in range(steps):
        if hook is not None:
            hook(step, sync)
        with sync.step():
            x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
            loss = w.loss(model, x, y)
            if step == 3:
                # the user's own collective in the block, before gradsync's first one: under
                # the group's timeout, not timeout_s (rank 1 came back late, see below)
                seen = loss.detach().clone()
                dist.all_reduce(seen)
            loss.backward()
        if step == 2 and rank == 1:
            time.sleep(1.6 * TIMEOUT_S)  # an evaluation between steps, past the timeout
    return model, sync


def store_requests_per_step(rank: int, world: int, strategy: str) -> dict[str, Any]:
    """Steps after the first few, counting the store requests of each thread: the gate's
    round trips must be made on its own thread, none on the training thread; and the
    gradsync-gate threads left after close() (none)."""
    counter: list[_CountingStore] = []

    def hook(step: int, sync: gs.Synchronizer) -> None:
        if step == 4:  # the secret agreed at the first gate, the watch's store final
            keyed = sync.watch.store
            counter.append(_CountingStore(keyed.store, threading.get_ident()))
            keyed.store = counter[0]

    model, sync = _train(strategy, rank, world, 10, hook)
    sync.close()
    return {
        "training": counter[0].training,
        "gate": counter[0].gate,
        "gate_by": counter[0].gate_by,
        "params": flat_params(model),
        "steps": sync.step_count,
        "threads": [t.name for t in threading.enumerate() if t.name == "gradsync-gate"],
    }


def loss_before_any_collective(rank: int, world: int) -> dict[str, Any]:
    """A block whose forward fails on rank 1 before the gate was joined: every rank skips the
    step, as when the gate was waited at the block's entry."""
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    sync = gs.Synchronizer(model, make_optimizer("sgd", model), "bsp", timeout_s=TIMEOUT_S)
    skipped, errors = [], []
    for step in range(4):
        try:
            with sync.step() as handle:
                if step == 1 and rank == 1:
                    raise ValueError("a bad batch")
                x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
                w.loss(model, x, y).backward()
            skipped.append(handle.skipped)
        except ValueError as exc:
            errors.append(str(exc))
            skipped.append(True)
    sync.close()
    return {"skipped": skipped, "errors": errors, "params": flat_params(model)}


def interrupted_while_a_peer_is_away(rank: int, world: int) -> dict[str, Any]:
    """Rank 0's block at step 2 ends with a KeyboardInterrupt (a Ctrl-C) while rank 1 is not
    at that step's gate, under a long ``timeout_s``: how long the interrupt took to leave the
    block. Rank 1 comes to close() only later."""
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    sync = gs.Synchronizer(model, make_optimizer("sgd", model), "bsp", timeout_s=60)
    for step in range(2):
        with sync.step():
            x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
            w.loss(model, x, y).backward()
    left_after_s = None
    if rank == 0:
        t0 = time.monotonic()
        try:
            with sync.step():
                raise KeyboardInterrupt
        except KeyboardInterrupt:
            left_after_s = time.monotonic() - t0
    else:
        time.sleep(6)  # longer than the 4 s the test allows rank 0's interrupt
    sync.close()
    return {"left_after_s": left_after_s}


__all__ = [
    "interrupted_while_a_peer_is_away",
    "loss_before_any_collective",
    "store_requests_per_step",
]


#: how late rank 1 reaches step 3's block in ``backward_while_a_peer_is_late``
LATE_S = 1.0


def backward_while_a_peer_is_late(rank: int, world: int) -> dict[str, Any]:
    """``bsp`` with several buckets; at step 3 rank 1 reaches the block ``LATE_S`` late (its
    own code between steps). Rank 0's backward pass goes on meanwhile (its buckets are posted
    once the gate has opened, here at the block's end) and its step waits for the peer there;
    then training goes on as usual. Each step's backward and whole block, timed."""
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, "bsp", bucket_mb=0.002, timeout_s=30.0)
    backward_s, step_s = [], []
    for step in range(6):
        if step == 3 and rank == 1:
            time.sleep(LATE_S)
        entered = time.monotonic()
        with sync.step():
            x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
            loss = w.loss(model, x, y)
            started = time.monotonic()
            loss.backward()
            backward_s.append(time.monotonic() - started)
        step_s.append(time.monotonic() - entered)
    buckets = len(sync.strategy.reducer.buckets)  # type: ignore[attr-defined]
    params = flat_params(model)
    sync.close()
    return {"backward_s": backward_s, "step_s": step_s, "buckets": buckets, "params": params}


def clip_while_a_peer_is_late(rank: int, world: int) -> dict[str, Any]:
    """``bsp``; at step 2 rank 1 reaches the block ``LATE_S`` late, and each rank clips its
    gradients inside the block after backward (the race docs/porting.md warns of). Rank 0's
    buckets are held back until the gate opens at the block's end, so its clip writes them
    before they are posted; rank 1's are in flight. Each rank's first error, and its step."""
    w = make_workload("mlp", seed=2, params=3000)
    model = w.build_model()
    opt = make_optimizer("sgd", model)
    sync = gs.Synchronizer(model, opt, "bsp", bucket_mb=0.002, timeout_s=30.0)
    out: dict[str, Any] = {"error": None, "step": None}
    for step in range(4):
        if step == 2 and rank == 1:
            time.sleep(LATE_S)
        try:
            with sync.step():
                x, y = w.batch(step, 4 * world, rank * 4, rank * 4 + 4)
                w.loss(model, x, y).backward()
                if step == 2:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), 1e-3)
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out = {"error": f"{type(exc).__name__}: {exc}", "step": step}
            break
    sync.close()
    return out
