"""The worker of tests/e2e/test_cluster_liveness.py, one per emulated host, under torchrun with the
script's own process group (no gradsync run, no secret handed over): rank 1, on another host
than rank 0, spends ``HOLD_S`` between steps 1 and 2 in a C call that keeps the GIL, then
stops itself (SIGSTOP) between steps 3 and 4. Each rank writes what it saw to
``$GRADSYNC_TEST_OUT/rank<r>.json``."""

from __future__ import annotations

import ctypes
import ctypes.util
import datetime
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gradsync.errors import SyncTimeoutError
from tests.support.gate_ranks import _setup, _train_step
from tests.support.ranks import flat_params

OUT_ENV = "GRADSYNC_TEST_OUT"
HOLD_S = 6.0  # 3x the timeout (2 s), 4x a heartbeat's silence before blame (1.5 s)
#: bounds the wait for rank 1 in its own code: a stopped rank taken for a busy one fails the
#: test with the gate's message instead of hanging it
BETWEEN_S = 30.0


def _await_voucher(sync: Any, limit_s: float = 60.0) -> bool:
    """Whether this rank's voucher is writing, waited for up to ``limit_s`` (it imports torch,
    seconds on a loaded machine): what is tested is the peer's reading of it."""
    deadline = time.monotonic() + limit_s
    while not sync.watch.vouching and time.monotonic() < deadline:
        time.sleep(0.1)
    return bool(sync.watch.vouching)


def _holds_the_gil(sync: Any, rank: int, world: int, w: Any, model: Any) -> dict[str, Any]:
    """Steps 0-3; rank 1 holds the GIL between steps 1 and 2."""
    libc = ctypes.PyDLL(ctypes.util.find_library("c") or "libc.so.6")
    seen: dict[str, Any] = {"error": None, "longest_step": 0.0}
    for step in range(4):
        started = time.monotonic()
        try:
            with sync.step():
                _train_step(w, model, rank, world, step)
        except SyncTimeoutError as exc:
            return {**seen, "error": str(exc)}
        seen["longest_step"] = max(seen["longest_step"], time.monotonic() - started)
        if step == 1 and rank == 1:
            seen["vouching"] = _await_voucher(sync)
            libc.sleep(int(HOLD_S))  # PyDLL: the GIL is held throughout
    return {**seen, "params": flat_params(model).tolist()}


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=120))
    rank, world = dist.get_rank(), dist.get_world_size()
    pids = [0] * world
    dist.all_gather_object(pids, os.getpid())  # the emulated hosts share one pid namespace
    w, model, _, sync = _setup(between_steps_timeout_s=BETWEEN_S)
    out = Path(os.environ[OUT_ENV]) / f"rank{rank}.json"
    result = _holds_the_gil(sync, rank, world, w, model)
    if result["error"] is None and rank == 1:
        result["vouching_before_stop"] = _await_voucher(sync)
        out.write_text(json.dumps(result))
        time.sleep(1.0)  # alive in its own code for a while: rank 0 sees it there
        os.kill(os.getpid(), signal.SIGSTOP)  # until rank 0 has its error
    elif result["error"] is None:
        started = time.monotonic()
        try:
            with sync.step():
                _train_step(w, model, rank, world, 4)
        except SyncTimeoutError as exc:
            result["stopped"] = str(exc)
            result["waited_for_stopped"] = time.monotonic() - started
        os.kill(pids[1], signal.SIGCONT)
        out.write_text(json.dumps(result))
    else:
        out.write_text(json.dumps(result))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
