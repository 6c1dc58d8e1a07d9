"""Where the workers of a local launch and the ranks of ``run_ranks`` are started from: a
forkserver that has imported torch once, where the platform has one.

Why: a spawned worker imports torch (about 0.8 s of a core here) and, at its first optimizer,
torch._dynamo (about 0.9 s more), before it does anything; a restarted worker pays it again.
A forkserver imports both once and forks each worker from itself, so a worker starts in a few
milliseconds. torch's elastic agent takes the start method as it is (``LaunchConfig``); this
module only decides which one and starts the server with what it should import.

The catch: a forked worker has the environment the forkserver started with, not the launching
process's environment now. So the server is used only while the environment is the one it
started with, and only if gradsync started it (a server some other code started has an
environment this process cannot see); otherwise workers are spawned, as before. Workers get
the elastic agent's per-rank variables (``RANK``, ...) either way. Where a CUDA device is
visible, workers are always spawned (``available``).

Two more differences from a spawned worker, both handled or harmless here: a forked worker
inherits the server's random generators (``gradsync.forkserver_ready`` reseeds torch's and
numpy's in each, as a spawned process starts), and it ends with ``os._exit`` once its function
returns, as multiprocessing's forked children do, so handlers it registered with ``atexit``
(``weakref.finalize`` included) do not run: gradsync's worker closes what it opened itself
(``worker.run_worker``), and a checkpoint writer left open by a failing worker writes its
newest snapshot, as after a kill.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os

import torch

from gradsync import compat

__all__ = ["PRELOAD", "available", "start_method"]

#: What the forkserver imports before it forks anything.
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "gradsync.forkserver_ready"]

# The environment gradsync started this process's forkserver with; None before it did.
_started_with: dict[str, str] | None = None

# Set in the launching process by torch's launcher itself (``launch_agent``), for its own signal
# handling when it starts workers: not a difference a worker would see.
_LAUNCHER_OWN = frozenset({"TORCHELASTIC_SIGNALS_TO_HANDLE"})


def _environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in _LAUNCHER_OWN}


def available() -> bool:
    """Whether workers may be forked: this platform has a forkserver (Linux and macOS, not
    Windows) and this machine has no CUDA device. A process forked after the CUDA driver was
    initialized cannot use CUDA, and whether importing ``PRELOAD`` initializes it has not been
    checked on a GPU here: where a GPU is visible, workers are spawned, as before."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    return not torch.cuda.is_available()


def start_method() -> str:
    """``"forkserver"`` where its workers would see this process's environment as it is now
    (starting the server, importing ``PRELOAD``, on the first call); ``"spawn"`` otherwise."""
    global _started_with
    if not available():
        return "spawn"
    environ = _environ()
    if _started_with is None:
        if compat.forkserver_started():
            return "spawn"
        multiprocessing.set_forkserver_preload(PRELOAD)
        multiprocessing.forkserver.ensure_running()
        _started_with = environ
    return "forkserver" if environ == _started_with else "spawn"
