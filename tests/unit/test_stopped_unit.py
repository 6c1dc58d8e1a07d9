"""``gradsync.runner.stopped``: a rank stopped by its agent's SIGTERM writes its step records
first, restarts left or not (each record names its attempt, so a restart that counts its steps
from 0 again does not replace them). No signal is sent: the handler is looked at."""

from __future__ import annotations

import signal

import pytest

from gradsync.runner import stopped
from gradsync.runner.stopped import records_kept_when_stopped

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(("restart", "most"), [("0", "0"), ("0", "1"), ("1", "3")])
def test_a_sigterm_writes_the_records_whether_or_not_restarts_are_left(
    monkeypatch: pytest.MonkeyPatch, restart: str, most: str
) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", restart)
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", most)
    before = signal.getsignal(signal.SIGTERM)
    with records_kept_when_stopped():
        inside = signal.getsignal(signal.SIGTERM)
    assert inside is not before and callable(inside), (restart, most)
    assert signal.getsignal(signal.SIGTERM) is before


class _Ended(Exception):
    """Stands in for ``os._exit``: the test's process must go on."""


class _NoTimer:
    """Stands in for the deadline's ``threading.Timer``: no thread left to end the process."""

    def __init__(self, *args: object, **kwargs: object) -> None:
        self.daemon = False

    def start(self) -> None:
        pass


@pytest.mark.timeout(10)  # the defect parked the handler for good: a hang is the failure
def test_a_second_sigterm_during_the_write_leaves_it_to_finish(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The agent's SIGTERM and the run's both reach a rank: the second one's handler runs on
    the thread already writing the records, inside the first. It returns to the write, which
    ends the process at once (it parked there, and the rank ended only at GRACE_S, 5 s)."""
    calls: list[str] = []

    def exit_(status: int) -> None:
        calls.append(f"exit {status}")
        raise _Ended

    def write() -> None:
        calls.append("write")
        handler(signal.SIGTERM, None)  # the second SIGTERM, delivered in the middle of it
        calls.append("written")

    monkeypatch.setattr(stopped.os, "_exit", exit_)
    monkeypatch.setattr(stopped.threading, "Timer", _NoTimer)
    monkeypatch.setattr(stopped, "write_unreported_records", write)
    with records_kept_when_stopped():
        handler = signal.getsignal(signal.SIGTERM)
        assert callable(handler)
        with pytest.raises(_Ended):
            handler(signal.SIGTERM, None)
    assert calls == ["write", "written", f"exit {stopped.STOPPED_STATUS}"]
