"""What a SIGINT does in a worker started by ``gradsync.launch.launch``: a ``KeyboardInterrupt``
inside the entrypoint (the user's code may catch it), a quiet ``SystemExit(130)`` once it
escapes or outside it, and a plain ``KeyboardInterrupt`` in processes forked from a worker."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Iterator

import pytest

from gradsync import launch as launching


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


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_the_entrypoint_can_catch_its_own_interrupt() -> None:
    assert launching.launch(catches_its_interrupt, nproc=1) == {0: "caught"}


@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_a_process_forked_by_a_worker_gets_a_keyboard_interrupt() -> None:
    assert launching.launch(forked_child_interrupt, nproc=1) == {0: 7}


@pytest.fixture
def _handler_restored() -> Iterator[None]:
    saved = signal.getsignal(signal.SIGINT)
    running, installed = set(launching._RUNNING), list(launching._INSTALLED_BY)
    yield
    signal.signal(signal.SIGINT, saved)
    launching._RUNNING.clear()
    launching._RUNNING.update(running)
    launching._INSTALLED_BY[:] = installed


@pytest.mark.unit
@pytest.mark.usefixtures("_handler_restored")
def test_the_interrupt_leaves_quietly_only_outside_the_entrypoint() -> None:
    signal.signal(signal.SIGINT, signal.default_int_handler)
    launching._leave_quietly_on_interrupt()
    assert signal.getsignal(signal.SIGINT) is launching._on_interrupt
    with pytest.raises(SystemExit) as left:
        launching._on_interrupt(signal.SIGINT, None)
    assert left.value.code == 130
    launching._RUNNING.add(os.getpid())
    with pytest.raises(KeyboardInterrupt):
        launching._on_interrupt(signal.SIGINT, None)
    launching._RUNNING.clear()
    launching._INSTALLED_BY[:] = [os.getpid() + 1]  # as in a process forked from a worker
    with pytest.raises(KeyboardInterrupt):
        launching._on_interrupt(signal.SIGINT, None)


@pytest.mark.unit
@pytest.mark.usefixtures("_handler_restored")
def test_a_handler_of_the_users_is_kept() -> None:
    def users(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGINT, users)
    launching._leave_quietly_on_interrupt()
    assert signal.getsignal(signal.SIGINT) is users
