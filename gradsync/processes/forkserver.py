"""Where the workers of a local launch and the ranks of ``run_ranks`` are started from: a
forkserver that has imported torch once, on Linux machines without a visible GPU.

Why: a spawned worker imports torch (about 0.8 s of a core here) and, at its first optimizer,
torch._dynamo (about 0.9 s more), before it does anything; a restarted worker pays it again.
A forkserver imports both once and forks each worker from itself, so a worker starts in a few
milliseconds. torch's elastic agent takes the start method as it is (``LaunchConfig``); this
module only decides which one and starts the server with what it should import.

The catch: a forked worker has the process settings the forkserver started with, not the
launching process's settings now: its environment, where its stdout and stderr lead, its
umask, CPU affinity and nice value. So the server is used only while those are what they were
when it started, and only if gradsync started it (a server some other code started has
settings this process cannot see); otherwise workers are spawned, as before. Workers get the
elastic agent's per-rank variables (``RANK``, ...) either way.

Where workers are always spawned (``available``): where a CUDA device is visible (a process
forked after the CUDA driver was initialized cannot use CUDA, and whether importing
``PRELOAD`` initializes it has not been checked on a GPU here), and off Linux (macOS's system
libraries are not safe to use after a fork, which is why Python spawns there by default).

What still differs from a spawned worker:
- the string hash seed: forked workers share the server's (``hash("abc")`` is the same on every
  rank and after a restart), where spawned ones each draw their own. Iterating a set of strings
  gives the same order on every rank here and not under torchrun, so collectives ordered by
  such iteration would pair up here and not there (the ranks of ``run_ranks`` share one seed
  too, so a test would not show it);
- exit: a forked worker ends with ``os._exit`` once its function returns, as multiprocessing's
  forked children do, which skips the interpreter's exit. ``gradsync.runner.worker`` does its
  part for the script it ran, where a spawned worker's interpreter would, after
  multiprocessing's finalizers (gradsync's own: the step records, the checkpoint writer's
  stop): the ``atexit`` handlers run (``weakref.finalize`` callbacks among them), then the
  globals of a script run from its file are dropped and the garbage collected, so a file it
  left open is flushed and closed; the same after a raise or ``sys.exit``. Not done: the
  globals of other modules (and of a ``-m MODULE``) are not dropped, and the worker's
  non-daemon threads are joined after the handlers, not before;
- variables torch sets while it is imported (``TORCHINDUCTOR_CACHE_DIR``) are there from the
  start, where a spawned worker gets them at its first optimizer.

Forked or spawned, multiprocessing sets a worker's start method to the one that started it
(``forkserver``, ``spawn``); ``gradsync.runner.worker`` unsets it while the script runs, as in a
fresh interpreter, so a DataLoader's workers start as under torchrun (forked, on Linux before
Python 3.14) rather than importing the script again.

The random generators do not differ: ``gradsync.processes.forkserver_ready`` reseeds torch's and
numpy's
in each worker, and Python's ``random`` reseeds itself after a fork.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.forkserver
import os
import sys
from pathlib import Path
from typing import Any

import torch

from gradsync import compat
from gradsync.errors import UsageError

__all__ = ["PRELOAD", "START_METHOD_ENV", "available", "start_method"]

#: ``spawn`` here spawns every worker, as before forkserver use (``auto``, the default: fork
#: where ``start_method`` says it is safe).
START_METHOD_ENV = "GRADSYNC_START_METHOD"

#: What the forkserver imports before it forks anything (``forkserver_quiet`` first: a Ctrl-C
#: during the imports is ignored, see its docstring; ``forkserver_ready`` last).
PRELOAD = [
    "gradsync.processes.forkserver_quiet",
    "torch",
    "torch._dynamo",
    "torch.distributed",
    "gradsync.processes.forkserver_ready",
]

# The process settings gradsync started this process's forkserver with; None before it did.
_started_with: dict[str, Any] | None = None

# Set in the launching process by torch's launcher itself (``launch_agent``), for its own signal
# handling when it starts workers: not a difference a worker would see.
_LAUNCHER_OWN = frozenset({"TORCHELASTIC_SIGNALS_TO_HANDLE"})


def _umask() -> int:
    """This process's umask, read from /proc where it can be: ``os.umask`` reads it only by
    setting it, which for a moment would give another thread's new files the wrong mode."""
    try:
        status = Path("/proc/self/status").read_text(encoding="ascii")
    except OSError:
        status = ""
    for line in status.splitlines():
        if line.startswith("Umask:"):
            return int(line.split()[1], 8)
    umask = os.umask(0o022)
    os.umask(umask)
    return umask


def _settings() -> dict[str, Any]:
    """What a forked worker inherits from the server and a spawned one from this process now."""
    outputs: list[tuple[int, int] | None] = []
    for fd in (1, 2):
        try:
            stat = os.fstat(fd)
            outputs.append((stat.st_dev, stat.st_ino))
        except OSError:
            outputs.append(None)
    return {
        "environ": {k: v for k, v in os.environ.items() if k not in _LAUNCHER_OWN},
        "outputs": outputs,
        "umask": _umask(),
        "affinity": sorted(os.sched_getaffinity(0)),
        "nice": os.nice(0),
    }


def available() -> bool:
    """Whether workers may be forked at all: on Linux, with no CUDA device visible."""
    if not sys.platform.startswith("linux"):
        return False
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return False
    return not torch.cuda.is_available()


def start_method() -> str:
    """``"forkserver"`` where its workers would start with this process's settings as they are
    now (starting the server, importing ``PRELOAD``, on the first call); ``"spawn"`` otherwise,
    and always where ``GRADSYNC_START_METHOD=spawn`` asks for it."""
    global _started_with
    asked = os.environ.get(START_METHOD_ENV, "auto")
    if asked not in ("auto", "spawn"):
        raise UsageError(f"{START_METHOD_ENV}={asked!r}: valid values are 'auto' and 'spawn'")
    if asked == "spawn" or not available():
        return "spawn"
    settings = _settings()
    if _started_with is None:
        if compat.forkserver_started():
            return "spawn"
        multiprocessing.set_forkserver_preload(PRELOAD)
        multiprocessing.forkserver.ensure_running()
        _started_with = settings
    return "forkserver" if settings == _started_with else "spawn"
