"""The exit's wait for collectives in flight (``gradsync.exit_safety``, issue 49): it lasts
until gloo has dropped every Python callback gradsync attached and every kept collective is
complete, and names what is still in flight when its bound runs out."""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator

import pytest
import torch

from gradsync import exit_safety

pytestmark = pytest.mark.unit


class _Work:
    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


@pytest.fixture(autouse=True)
def _nothing_kept_between_tests() -> Iterator[None]:
    exit_safety._kept.clear()
    yield
    exit_safety._kept.clear()
    exit_safety._callbacks.clear()  # a failed test's future never completes


def test_a_callback_is_waited_for_until_its_future_has_dropped_it() -> None:
    future: torch.futures.Future[int] = torch.futures.Future()
    child = exit_safety.then(future, lambda f: f.value() + 1)
    (waiting,) = exit_safety.drain(timeout_s=0.05)
    assert waiting.startswith("a callback of ") and waiting.endswith("<lambda>"), waiting
    # Completed on another thread, as gloo completes a collective's future.
    threading.Thread(target=future.set_result, args=(1,)).start()
    assert exit_safety.drain(timeout_s=5) == []
    assert child.wait() == 2


def test_a_kept_collective_is_waited_for_until_it_completes() -> None:
    work = _Work()
    exit_safety.keep("final handshake", work)
    t0 = time.monotonic()
    assert exit_safety.drain(timeout_s=0.1) == ["final handshake"]
    assert time.monotonic() - t0 >= 0.1
    threading.Timer(0.05, lambda: setattr(work, "done", True)).start()
    assert exit_safety.drain(timeout_s=5) == []


def test_a_kept_object_holding_a_work_is_read_through_it() -> None:
    class InFlight:
        def __init__(self) -> None:
            self.work = _Work()

    flight = InFlight()
    exit_safety.keep("telemetry gather in flight", flight)
    assert exit_safety.drain(timeout_s=0.01) == ["telemetry gather in flight"]
    flight.work.done = True
    assert exit_safety.drain(timeout_s=0.01) == []


def test_keeping_under_the_same_name_replaces_the_earlier_one() -> None:
    first, second = _Work(), _Work()
    exit_safety.keep("final handshake", first)
    exit_safety.keep("final handshake", second)
    second.done = True
    assert exit_safety.drain(timeout_s=0.01) == []


def test_the_exit_destroys_only_a_group_gs_init_made(monkeypatch: pytest.MonkeyPatch) -> None:
    destroyed: list[bool] = []
    monkeypatch.setattr(exit_safety, "_destroy_the_group", lambda: destroyed.append(True))
    monkeypatch.setattr(exit_safety, "_owned_group", False)
    exit_safety._at_exit()
    assert destroyed == []
    monkeypatch.setattr(exit_safety, "_owned_group", True)
    exit_safety._at_exit()
    assert destroyed == [True]


def test_the_exit_leaves_the_group_alone_while_something_is_in_flight(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    destroyed: list[bool] = []
    monkeypatch.setattr(exit_safety, "_destroy_the_group", lambda: destroyed.append(True))
    monkeypatch.setattr(exit_safety, "_owned_group", True)
    monkeypatch.setattr(exit_safety, "DRAIN_TIMEOUT_S", 0.01)
    exit_safety.keep("final handshake", _Work())
    with caplog.at_level("WARNING", logger="gradsync.exit"):
        exit_safety._at_exit()
    assert destroyed == []
    assert "still in flight" in caplog.text and "final handshake" in caplog.text


def test_an_exit_on_an_uncaught_exception_waits_only_briefly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A rank that failed does not hold its exit for a peer that will never answer."""
    monkeypatch.setattr(exit_safety, "_destroy_the_group", lambda: None)
    monkeypatch.setattr(sys, "last_value", RuntimeError("the script failed"), raising=False)
    exit_safety.keep("final handshake", _Work())
    t0 = time.monotonic()
    exit_safety._at_exit()
    assert time.monotonic() - t0 < exit_safety.DRAIN_TIMEOUT_S / 2


def test_the_exit_stops_threads_first_and_holds_no_object_alive(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(exit_safety, "_destroy_the_group", lambda: None)
    stopped: list[str] = []

    class Watch:
        def __init__(self, name: str) -> None:
            self.name = name

        def stop(self) -> None:
            stopped.append(self.name)

    kept, dropped = Watch("kept"), Watch("dropped")
    exit_safety.stop_at_exit(kept.stop)
    exit_safety.stop_at_exit(dropped.stop)
    del dropped  # a Synchronizer gone before the exit: nothing to stop, nothing kept alive
    exit_safety._at_exit()
    assert stopped == ["kept"]


def test_a_second_ctrl_c_during_the_exit_prints_no_traceback(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Ctrl-C of ``gradsync run``: a rank already exiting got another SIGINT inside the exit's
    clean-up, and Python printed "Exception ignored in atexit callback" with a traceback
    beside the run's one-line stop (tests/e2e/test_stopped_worker.py, under load)."""
    monkeypatch.setattr(exit_safety, "_destroy_the_group", lambda: None)

    for interrupt in (KeyboardInterrupt(), SystemExit(130)):  # SystemExit: launch's handler

        class Interrupted:
            def __init__(self, raised: BaseException) -> None:
                self.raised = raised

            def stop(self) -> None:
                raise self.raised

        watch = Interrupted(interrupt)
        exit_safety.stop_at_exit(watch.stop)
        try:
            exit_safety._at_exit()
        except (KeyboardInterrupt, SystemExit):  # what atexit printed with its traceback
            pytest.fail(f"a Ctrl-C during the exit's clean-up came out of it: {interrupt!r}")
        finally:
            exit_safety._stoppers.clear()
