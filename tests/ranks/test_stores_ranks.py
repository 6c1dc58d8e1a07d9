"""gradsync.processes.reaper's rule on real children: a stopped child, or a stopped worker forked
from the
forkserver, is killed only once it has been asked to exit."""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from gradsync.processes.reaper import (
    StoppedWorkerReaper,
    children,
    stopped_with_exit_pending,
    workers,
)

pytestmark = pytest.mark.ranks


# A worker that handles SIGTERM, as torch's do: a stopped one keeps the signal pending (one with
# the default action would be killed by the kernel at once, stopped or not).
_HANDLES_SIGTERM = (
    "import signal, time; signal.signal(signal.SIGTERM, lambda *a: None); "
    "print('ready', flush=True); time.sleep(60)"
)


def _stopped_child() -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _HANDLES_SIGTERM], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None and child.stdout.readline() == "ready\n"
    os.kill(child.pid, signal.SIGSTOP)
    return child


def _wait_until(condition: Callable[[], bool], timeout_s: float = 10) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition never met"
        time.sleep(0.02)


@pytest.mark.timeout(60)
def test_the_reaper_kills_a_stopped_child_only_once_asked_to_exit() -> None:
    asked = paused = None
    try:
        asked, paused = _stopped_child(), _stopped_child()
        me = os.getpid()
        assert {asked.pid, paused.pid} <= set(children(me))
        os.kill(asked.pid, signal.SIGTERM)  # stays pending: the process is stopped
        _wait_until(lambda: stopped_with_exit_pending(asked.pid, me))
        assert not stopped_with_exit_pending(asked.pid, me + 1)  # not its parent
        _wait_until(lambda: _state(paused.pid) == "T")
        assert not stopped_with_exit_pending(paused.pid, me)
        with StoppedWorkerReaper(interval_s=0.05, rescan_s=0.05) as reaper:
            assert asked.wait(timeout=10) == -signal.SIGKILL
            time.sleep(0.3)
        assert reaper.killed == [asked.pid]
        assert paused.poll() is None  # a pause is the user's business
    finally:
        for p in (asked, paused):
            if p is not None:
                p.kill()
                p.communicate(timeout=10)


def _state(pid: int) -> str:
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]


def _pause() -> None:
    signal.signal(signal.SIGTERM, lambda *a: None)  # as torch's workers: SIGTERM stays pending
    os.kill(os.getpid(), signal.SIGSTOP)
    time.sleep(60)


@pytest.mark.timeout(60)
def test_the_reaper_kills_a_stopped_worker_forked_from_the_forkserver() -> None:
    """Workers of a launch are the forkserver's children, not the agent's
    (gradsync.processes.forkserver)."""
    ctx = multiprocessing.get_context("forkserver")
    worker = ctx.Process(target=_pause, daemon=True)
    worker.start()
    try:
        _wait_until(lambda: _state(worker.pid) == "T")
        server = next(parent for pid, parent in workers(os.getpid()) if pid == worker.pid)
        assert server != os.getpid()  # a grandchild: children() alone would miss it
        os.kill(worker.pid, signal.SIGTERM)  # stays pending: the process is stopped
        with StoppedWorkerReaper(interval_s=0.05, rescan_s=0.05) as reaper:
            worker.join(timeout=10)
        assert worker.exitcode == -signal.SIGKILL
        assert reaper.killed == [worker.pid]
    finally:
        worker.kill()
        worker.join(timeout=10)
