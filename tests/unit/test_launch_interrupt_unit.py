"""What a SIGINT does in a worker started by ``gradsync.processes.launch.launch``, in this process:
a
quiet ``SystemExit(130)`` only outside the entrypoint, and a handler of the user's kept. In
workers: tests/ranks/test_launch_interrupt.py."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator

import pytest

from gradsync.processes import launch as launching

pytestmark = pytest.mark.unit


@pytest.fixture
def _handler_restored() -> Iterator[None]:
    saved = signal.getsignal(signal.SIGINT)
    running, installed = set(launching._RUNNING), list(launching._INSTALLED_BY)
    yield
    signal.signal(signal.SIGINT, saved)
    launching._RUNNING.clear()
    launching._RUNNING.update(running)
    launching._INSTALLED_BY[:] = installed


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


@pytest.mark.usefixtures("_handler_restored")
def test_a_handler_of_the_users_is_kept() -> None:
    def users(signum: int, frame: object) -> None:
        pass

    signal.signal(signal.SIGINT, users)
    launching._leave_quietly_on_interrupt()
    assert signal.getsignal(signal.SIGINT) is users
