"""``gradsync.runner.stopped``: a rank stopped by its agent's SIGTERM writes its step records
first, restarts left or not (each record names its attempt, so a restart that counts its steps
from 0 again does not replace them). No signal is sent: the handler is looked at."""

from __future__ import annotations

import signal

import pytest

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
