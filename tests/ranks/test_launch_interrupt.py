"""What a SIGINT does in a worker started by ``gradsync.processes.launch.launch``: a
``KeyboardInterrupt``
inside the entrypoint (the user's code may catch it), a quiet ``SystemExit(130)`` once it
escapes or outside it, and a plain ``KeyboardInterrupt`` in processes forked from a worker."""

from __future__ import annotations

import os
import signal
import time

import pytest

from gradsync.processes import launch as launching

pytestmark = pytest.mark.ranks


def catches_its_interrupt() -> str:
    try:
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(10)
        return "not interrupted"
    except KeyboardInterrupt:
        return "caught"


def forked_child_interrupt() -> int:
    """A process forked inside the entrypoint (as a DataLoader's worker is): its exit code,
    7 where the SIGINT reached it as a KeyboardInterrupt."""
    pid = os.fork()
    if pid == 0:
        try:
            os.kill(os.getpid(), signal.SIGINT)
            time.sleep(10)
            os._exit(1)
        except KeyboardInterrupt:
            os._exit(7)
        except SystemExit:
            os._exit(8)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def both() -> tuple[str, int]:
    """One worker for both tests (a launch from the test process spawns its worker, which
    imports torch: seconds of a core): its own interrupt first, then its forked child's."""
    return catches_its_interrupt(), forked_child_interrupt()


@pytest.fixture(scope="module")
def seen() -> tuple[str, int]:
    return launching.launch(both, nproc=1)[0]


@pytest.mark.timeout(120)
def test_the_entrypoint_can_catch_its_own_interrupt(seen: tuple[str, int]) -> None:
    assert seen[0] == "caught"


@pytest.mark.timeout(120)
def test_a_process_forked_by_a_worker_gets_a_keyboard_interrupt(seen: tuple[str, int]) -> None:
    assert seen[1] == 7
