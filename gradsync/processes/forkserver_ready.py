"""Imported last by the workers' forkserver (``gradsync.processes.forkserver.PRELOAD``): readies it
to fork
workers that start as a spawned worker would.

1. Every object imported so far leaves the garbage collector's reach (``gc.freeze``) before
   anything is forked, as Python's documentation of ``gc.freeze`` recommends before a fork (a
   forked worker shares the server's memory page by page until it writes to a page). Measured:
   on ``charlm`` under ``async`` (2 workers and a server on 2 cores), forked workers computed
   1.5-2.5 ms slower a step than spawned ones without it, and alike with it (3 and 7
   alternating pairs of runs). Why was not established: the collector's own passes are rare
   in a training run (no full collection in 280 BSP steps, RELIABILITY.md).
2. Each forked worker reseeds torch's and numpy's global generators from the system's entropy,
   as a spawned process starts (Python's ``random`` reseeds itself after a fork). Without it
   every worker forked from the server drew the same "random" numbers: the same dropout masks
   and the same augmentations on every rank of a script that does not seed them.
"""

from __future__ import annotations

import gc
import os
import signal
import sys

import torch

_SERVER = os.getpid()


def _reseed() -> None:
    if os.getppid() != _SERVER:
        return  # forked by a worker, not by the server: inherits its parent's state, as usual
    torch.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # no argument: fresh entropy, as at numpy's import


os.register_at_fork(after_in_child=_reseed)
# ``forkserver_quiet`` ignored SIGINT during the imports: Python's forkserver keeps the handler
# it finds here as the one its workers get, which must be Python's own (a KeyboardInterrupt).
if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
    signal.signal(signal.SIGINT, signal.default_int_handler)
gc.freeze()
