"""A rank of ``gradsync run`` stopped by its elastic agent keeps its step records.

When one rank fails for good, torch's agent stops the others with SIGTERM. Its default action
ends a process at once, running no exit hook, so each survivor lost the step records that no
gather had taken yet (a failure at step 15 left metrics.jsonl with the failed rank's records
alone; telemetry gathers every 10 steps, and a gather is written one gather later). Here a
SIGTERM writes them first (``synchronizer.write_unreported_records``), then ends the process
with the status a SIGTERM gives (143).

Why a thread besides the handler: a Python signal handler runs only when the main thread
returns to Python, and a survivor may be blocked in a collective or a store wait for its
whole timeout; the agent would then wait (30 s) before killing it. ``signal.set_wakeup_fd``
writes the signal's number to a pipe from the C handler at once, which wakes a thread that
writes the records while the main thread stays blocked (such waits release the GIL).

A script that installs a SIGTERM handler of its own keeps it: neither path runs then. Only
where the run ends here: with restarts left, the agent restarts every rank from the newest
checkpoint, which carries the records not gathered (``resume``); written now as well, they
would appear twice.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from gradsync.attached_run import restart_count
from gradsync.synchronizer import write_unreported_records

#: the exit status of a process ended by SIGTERM, as a shell reports it
STOPPED_STATUS = 128 + signal.SIGTERM


def _restarts_left() -> bool:
    most = int(os.environ.get("TORCHELASTIC_MAX_RESTARTS") or 0)
    return restart_count() < most


@contextlib.contextmanager
def records_kept_when_stopped() -> Iterator[None]:
    """While the block runs (a rank's script), a SIGTERM writes this process's step records
    not gathered, then ends it. Nothing changes off the main thread or with restarts left."""
    if threading.current_thread() is not threading.main_thread() or _restarts_left():
        yield
        return
    once = threading.Lock()

    def stop() -> None:
        if once.acquire(blocking=False):
            try:
                write_unreported_records()
            finally:
                os._exit(STOPPED_STATUS)

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C handler must never block on a full pipe

    def on_sigterm(signum: int, frame: object) -> None:
        stop()

    def woken() -> None:
        while data := os.read(read_end, 64):
            # A script that set a SIGTERM handler of its own (a checkpoint on preemption) has
            # its handler run, not this thread's exit.
            if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) is on_sigterm:
                stop()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    watcher = threading.Thread(target=woken, name="gradsync-stopped", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        signal.set_wakeup_fd(previous_fd)
        signal.signal(signal.SIGTERM, previous)
        os.close(write_end)  # the watcher's read returns empty: it ends
        watcher.join(timeout=5)
        os.close(read_end)
