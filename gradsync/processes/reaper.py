"""Kill a worker that cannot act on the elastic agent's request to exit because it is stopped.

When a worker group fails, torch's elastic agent sends its workers SIGTERM and waits for them
to exit before it sends SIGKILL. That wait is 30 seconds whatever the launch asked for: the
agent's ``_stop_workers`` calls ``_shutdown()`` with its default, not the configured
``shutdown_timeout`` (torch 2.13; earlier releases have no setting at all). A stopped worker
(SIGSTOP, SIGTSTP: a hang injected by hand or a job-control accident) cannot act on SIGTERM
until someone continues it, so the whole run waited those 30 seconds, after the survivors had
already failed and named it, before it exited.

:class:`StoppedWorkerReaper` watches the workers of the agent's process (its children, or
those of its forkserver: ``gradsync.processes.forkserver``) from a thread and SIGKILLs any that is
stopped while a termination signal is pending: the agent has already asked
it to go, it cannot, and SIGKILL is what it would get at the end of the wait. A worker that is
running, or stopped with no such request (a user pausing the job), is left alone; so is one
stopped by a debugger (``t``). Linux only (it reads /proc); elsewhere it does nothing.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path
from types import TracebackType

from gradsync import procfs

_PROC = Path("/proc")
# The signals the agent forwards to its workers when it stops them (SIGTERM) or when it is itself
# stopped by one (torchrun's TORCHELASTIC_SIGNALS_TO_HANDLE default).
_EXIT_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
_EXIT_MASK = sum(1 << (int(s) - 1) for s in _EXIT_SIGNALS)


def children(pid: int) -> list[int]:
    """The direct children of ``pid``: from each of its threads' ``children`` lists where the
    kernel keeps them (the agent may fork from any thread), else by a scan of every process."""
    tasks = sorted((_PROC / str(pid) / "task").glob("*/children"))
    if tasks:
        found: list[int] = []
        for task in tasks:
            with contextlib.suppress(OSError):
                found.extend(int(c) for c in task.read_text().split())
        return found
    return [child for child, parent in procfs.parents().items() if parent == pid]


def workers(pid: int) -> list[tuple[int, int]]:
    """``(worker, its parent)`` for the processes ``pid`` may have started as workers: its
    children, and the children of its child that is multiprocessing's forkserver (workers
    forked from it, ``gradsync.processes.forkserver``)."""
    found = []
    for child in children(pid):
        found.append((child, pid))
        if _is_forkserver(child):
            found.extend((worker, child) for worker in children(child))
    return found


def _is_forkserver(pid: int) -> bool:
    try:
        command = (_PROC / str(pid) / "cmdline").read_bytes()
    except OSError:
        return False
    return b"from multiprocessing.forkserver import main" in command


def stopped_with_exit_pending(pid: int, parent: int) -> bool:
    """Whether ``pid``, a child of ``parent`` (checked: a pid may have been reused), is stopped
    by a signal (not traced) with SIGTERM, SIGINT, SIGHUP or SIGQUIT pending."""
    try:
        status = (_PROC / str(pid) / "status").read_text()
    except OSError:
        return False
    fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
    if fields.get("PPid", "").strip() != str(parent):
        return False
    if not fields.get("State", "").strip().startswith("T"):
        return False
    pending = int(fields.get("ShdPnd", "0"), 16) | int(fields.get("SigPnd", "0"), 16)
    return bool(pending & _EXIT_MASK)


class StoppedWorkerReaper:
    """A context manager: while open, a daemon thread SIGKILLs every worker of this process
    (``workers``) that is stopped with an exit signal pending (see the module's docstring)."""

    def __init__(self, interval_s: float = 0.2, rescan_s: float = 2.0) -> None:
        self.interval_s = interval_s
        self.rescan_s = rescan_s
        self.killed: list[int] = []
        self._done = threading.Event()
        self._thread: threading.Thread | None = None

    def __enter__(self) -> StoppedWorkerReaper:
        if (_PROC / "self" / "task").is_dir():
            self._thread = threading.Thread(target=self._watch, name="gradsync-reaper", daemon=True)
            self._thread.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def _watch(self) -> None:
        me = os.getpid()
        known: list[tuple[int, int]] = []
        since_scan = float("inf")
        while not self._done.wait(self.interval_s):
            # Finding the children may mean reading every process's stat: do it every few
            # seconds (workers start rarely), and look at the known ones at every tick.
            since_scan += self.interval_s
            if since_scan >= self.rescan_s:
                known, since_scan = workers(me), 0.0
            for child, parent in known:
                if stopped_with_exit_pending(child, parent):
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(child, signal.SIGKILL)
                        self.killed.append(child)
