"""A rank of ``gradsync run`` stopped by its elastic agent keeps its step records.

When a rank fails, torch's agent stops the others with SIGTERM. Its default action ends a
process at once, running no exit hook, so each survivor lost the step records that no gather
had taken yet (a failure at step 15 left metrics.jsonl with the failed rank's records alone;
telemetry gathers every 10 steps, and a gather is written one gather later; in a replica group
of 2 ranks, every step before a kill). Here a SIGTERM writes them first
(``synchronizer.write_unreported_records``: an append, no collective), then ends the process
with the status a SIGTERM gives (143), within ``GRACE_S`` whatever the write waits for.

Why a thread besides the handler: a Python signal handler runs only when the main thread
returns to Python, and a survivor is usually blocked with the dead rank (a collective, a store
wait, its group's torchft quorum) for up to its timeout; the agent would then wait 30 s before
killing it. ``signal.set_wakeup_fd`` writes the signal's number to a pipe from the C handler at
once, which wakes a thread that writes the records while the main thread stays blocked (such
waits release the GIL). Where the handler runs first, on the main thread, it does the same, and
parks there if the thread is already at it, so that training does not step on meanwhile.

When: always, restarts left or not. Each record names its attempt (``StepRecord.attempt``),
and the records of the steps a restart runs again do not appear twice: a script that resumes
through ``sync.load`` drops them there (and writes again, once, the ones its checkpoint
carries); one that resumes from its own checkpoint, or starts over, counts its steps from 0
again, and its attempt's records are read as the run's next steps
(``gradsync.telemetry.records.latest_attempts``). Before, with restarts left, a survivor was
ended at once: a script resumed without ``sync.load`` lost the failed attempt's last records
(every step before a kill at step 15, with telemetry's gather every 10 steps and its write
one gather later). A script that installs a SIGTERM handler of its own keeps it: neither
path acts then.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator

from gradsync.synchronizer import write_unreported_records

#: the exit status of a process ended by SIGTERM, as a shell reports it
STOPPED_STATUS = 128 + signal.SIGTERM
#: how long the write may take before the process ends anyway
GRACE_S = 5.0


@contextlib.contextmanager
def records_kept_when_stopped(heals_forward: bool = False) -> Iterator[None]:
    """While the block runs (a rank's script), a SIGTERM writes this process's step records
    not gathered, then ends it. ``heals_forward``: the rank is in a replica group (its
    restart runs none of its steps again; kept for its callers: the records are written
    either way). Nothing changes off the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    once = threading.Lock()
    entered: set[int] = set()  # the threads in stop()

    def stop() -> None:
        me = threading.get_ident()
        if me in entered:
            # A second SIGTERM (the agent's and the run's both come) whose handler runs on a
            # thread already in here, inside the first call: back to it. Parking here parked
            # the write under it, and the process ended only at GRACE_S (1 stop in 5 of two
            # replica groups took 6 s). Marked before ``once`` is taken: a handler run before
            # the mark does the whole job itself, and one after it returns.
            return
        entered.add(me)
        if not once.acquire(blocking=False):
            threading.Event().wait()  # the other path writes and ends the process: park
        deadline = threading.Timer(GRACE_S, os._exit, args=(STOPPED_STATUS,))
        deadline.daemon = True
        deadline.start()
        try:
            write_unreported_records()
        finally:
            os._exit(STOPPED_STATUS)

    def on_sigterm(signum: int, frame: object) -> None:
        stop()

    read_end, write_end = os.pipe()
    os.set_blocking(write_end, False)  # the C handler must never block on a full pipe

    def woken() -> None:
        while data := os.read(read_end, 64):
            # A script that set a SIGTERM handler of its own has its handler run instead.
            if signal.SIGTERM in data and signal.getsignal(signal.SIGTERM) is on_sigterm:
                stop()

    previous = signal.signal(signal.SIGTERM, on_sigterm)
    previous_fd = signal.set_wakeup_fd(write_end, warn_on_full_buffer=False)
    watcher = threading.Thread(target=woken, name="gradsync-stopped", daemon=True)
    watcher.start()
    try:
        yield
    finally:
        # The handler first: a SIGTERM in between then ends the process as before.
        signal.signal(signal.SIGTERM, previous)
        signal.set_wakeup_fd(previous_fd)
        os.close(write_end)  # the watcher's read returns empty: it ends
        watcher.join(timeout=5)
        os.close(read_end)
