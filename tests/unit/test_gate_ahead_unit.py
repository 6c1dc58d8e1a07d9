"""GateAhead (gradsync.checks.gate_ahead) on a fake gate: arm returns at once, join waits for
the wait and raises its error at every join of that step, stop cancels a wait in flight."""

from __future__ import annotations

import signal
import threading
import time
from typing import Any

import pytest

from gradsync.checks.gate_ahead import GateAhead
from gradsync.errors import SyncTimeoutError

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


class _FakeWatch:
    """How long the world's store has been silent, as the test sets it."""

    def __init__(self) -> None:
        self.silent = 0.0

    def store_silence(self) -> float:
        return self.silent


class _FakeGate:
    silence_limit_s = 2.0

    def __init__(self, error: BaseException | None = None) -> None:
        self.watch = _FakeWatch()
        self.release = threading.Event()
        self.error = error
        self.waits: list[tuple[int, str]] = []
        self.threads: list[str] = []
        self.cancelled = False
        self.returned = 0  # waits that have ended

    def ensure(self, step: int, what: str) -> None:
        self.waits.append((step, what))
        self.threads.append(threading.current_thread().name)
        try:
            while not self.release.wait(0.01):
                if self.cancelled:
                    raise SyncTimeoutError("cancelled")
        finally:
            self.returned += 1
        if self.error is not None:
            raise self.error

    def cancel(self) -> None:
        self.cancelled = True

    def silent_store_error(self) -> SyncTimeoutError:
        return SyncTimeoutError(f"silent for {self.watch.silent:g}s")


def _ahead(gate: _FakeGate) -> Any:
    return GateAhead(gate)  # type: ignore[arg-type]


def test_arm_returns_at_once_and_join_waits_for_the_gate() -> None:
    gate = _FakeGate()
    ahead = _ahead(gate)
    t0 = time.monotonic()
    ahead.arm(3, "the step")
    assert time.monotonic() - t0 < 0.5 and ahead.pending
    joined = threading.Event()
    joiner = threading.Thread(target=lambda: (ahead.join(), joined.set()))
    joiner.start()
    assert not joined.wait(0.2)  # the gate has not opened
    gate.release.set()
    assert joined.wait(5)
    joiner.join()
    assert gate.waits == [(3, "the step")] and gate.threads == ["gradsync-gate"]
    assert not ahead.pending
    ahead.join()  # nothing armed: returns
    ahead.stop()


def test_a_failed_gate_is_raised_at_every_join_until_the_next_arm() -> None:
    gate = _FakeGate(SyncTimeoutError("rank 1 never arrived"))
    gate.release.set()
    ahead = _ahead(gate)
    ahead.arm(0, "the step")
    for _ in range(3):  # every collective of the step is refused, not only the first
        with pytest.raises(SyncTimeoutError, match="rank 1 never arrived"):
            ahead.join()
    gate.error = None
    ahead.arm(1, "the step")
    ahead.join()
    ahead.stop()


def test_arming_twice_without_a_join_is_refused() -> None:
    gate = _FakeGate()
    gate.release.set()
    ahead = _ahead(gate)
    ahead.arm(0, "the step")
    with pytest.raises(RuntimeError, match="already armed"):
        ahead.arm(1, "the step")
    ahead.join()
    ahead.stop()


def test_stop_cancels_a_wait_in_flight_and_ends_the_thread() -> None:
    gate = _FakeGate()
    ahead = _ahead(gate)
    ahead.arm(0, "the step")
    while not gate.waits:
        time.sleep(0.01)
    ahead.stop()
    assert gate.cancelled
    assert not [t for t in threading.enumerate() if t.name == "gradsync-gate"]
    with pytest.raises(SyncTimeoutError, match="cancelled"):
        ahead.join()


class _Interrupted(Exception):
    pass


def _raise_interrupted(signum: int, frame: Any) -> None:
    raise _Interrupted


def test_a_signal_taken_by_the_gate_thread_reaches_the_joining_main_thread() -> None:
    """A process-directed signal (a Ctrl-C) may land on the gate's thread; its Python handler
    runs on the main thread, which must not sit in an untimed wait meanwhile (a worker waited
    out the gate, and torch's launcher its 30 s grace, before it). Sent to the gate's thread
    here, so that it lands there every time."""
    gate = _FakeGate()
    ahead = _ahead(gate)
    previous = signal.signal(signal.SIGUSR1, _raise_interrupted)
    try:
        ahead.arm(1, "the step")
        thread = ahead._thread
        assert thread is not None and thread.ident is not None
        threading.Timer(0.2, signal.pthread_kill, (thread.ident, signal.SIGUSR1)).start()
        threading.Timer(10, gate.release.set).start()  # without the fix: join ends here
        t0 = time.monotonic()
        with pytest.raises(_Interrupted):
            ahead.join()
        assert time.monotonic() - t0 < 5
    finally:
        signal.signal(signal.SIGUSR1, previous)
        gate.release.set()
        ahead.stop()


def test_a_silent_store_fails_the_join_after_the_timeout_and_every_later_wait_at_once() -> None:
    """The gate's thread stays in a store call that a stopped server never answers
    (gradsync.checks.answered): the joiner gives up once the store has been silent for the
    gate's timeout, not before, and the thread is not waited for again."""
    gate = _FakeGate()
    ahead = _ahead(gate)
    ahead.arm(1, "the step")
    gate.watch.silent = gate.silence_limit_s - 0.5  # silent, but not for long enough yet
    joined: list[BaseException] = []

    def join() -> None:
        try:
            ahead.join()
        except SyncTimeoutError as exc:
            joined.append(exc)

    joiner = threading.Thread(target=join)
    joiner.start()
    joiner.join(0.5)
    assert joiner.is_alive() and not joined  # still waiting for the gate
    gate.watch.silent = gate.silence_limit_s
    joiner.join(5)
    assert not joiner.is_alive() and str(joined[0]) == "silent for 2s"
    with pytest.raises(SyncTimeoutError, match="silent for 2s"):
        ahead.join()  # the same error at every join of that step
    ahead.arm(2, "the next step")  # the thread is still in its call: no second wait begins
    with pytest.raises(SyncTimeoutError, match="silent for 2s"):
        ahead.join()
    assert gate.waits == [(1, "the step")]
    gate.release.set()  # the store answers again: the thread comes back from its call
    deadline = time.monotonic() + 5
    while gate.returned < 1 and time.monotonic() < deadline:
        time.sleep(0.01)
    gate.release = threading.Event()  # the next wait blocks until released
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        ahead.arm(3, "a later step")  # a wait begins once the thread is back, not before
        if ahead.pending:
            break
        with pytest.raises(SyncTimeoutError, match="silent for 2s"):
            ahead.join()
        time.sleep(0.05)
    assert ahead.pending
    gate.watch.silent = 0.0
    gate.release.set()
    ahead.join()
    assert gate.waits == [(1, "the step"), (3, "a later step")]
    ahead.stop()


def test_a_thread_stranded_in_the_store_is_not_waited_for_at_stop() -> None:
    gate = _FakeGate()
    ahead = _ahead(gate)
    ahead.arm(1, "the step")
    gate.watch.silent = gate.silence_limit_s
    with pytest.raises(SyncTimeoutError, match="silent for 2s"):
        ahead.join()
    t0 = time.monotonic()
    ahead.stop()  # does not wait for a thread stranded in the store
    assert time.monotonic() - t0 < 1.0
    gate.release.set()
