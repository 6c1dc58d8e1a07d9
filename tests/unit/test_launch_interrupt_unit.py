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


class _Handler:
    """A rendezvous handler as ``stores.close_rendezvous`` sees one."""

    def __init__(self) -> None:
        self.shut = 0

    def shutdown(self) -> bool:
        self.shut += 1
        return True


def _launch_raising(monkeypatch: pytest.MonkeyPatch, exc: BaseException) -> _Handler:
    """``launch`` with torch's launcher replaced by one that makes a rendezvous handler (as
    ours does, through ``stores``) and then raises ``exc``."""
    from gradsync.processes import stores

    handler = _Handler()

    def elastic_launch(config: object, entrypoint: object) -> object:
        def run(*args: object) -> object:
            stores._HANDLERS.append(handler)
            raise exc

        return run

    monkeypatch.setattr(launching, "elastic_launch", elastic_launch)
    monkeypatch.setattr(launching.task_limit, "check_room", lambda *a, **k: None)
    monkeypatch.setattr(launching.forkserver, "start_method", lambda: "spawn")  # no server
    for name in ("OMP_NUM_THREADS", "GRADSYNC_THREADS", "GLOO_SOCKET_IFNAME"):
        monkeypatch.setenv(name, os.environ.get(name, "1"))
    with pytest.raises(type(exc)):
        launching.launch(print, nproc=1)
    assert stores._HANDLERS == []  # forgotten either way
    return handler


def test_a_launch_stopped_by_a_signal_shuts_its_rendezvous_down(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """torch leaves the rendezvous open when its agent stops on a signal, and the handler's
    keep-alive thread making store calls into the process's exit (gradsync.processes.stores:
    close_rendezvous)."""
    from torch.distributed.elastic.multiprocessing.api import SignalException

    handler = _launch_raising(monkeypatch, SignalException("SIGINT", signal.SIGINT))
    assert handler.shut == 1


def test_a_launch_that_fails_otherwise_leaves_the_shutdown_to_torch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    handler = _launch_raising(monkeypatch, RuntimeError("a worker failed"))
    assert handler.shut == 0
