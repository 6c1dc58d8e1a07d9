"""A rank that fails where the elastic agent restarts its group says why on stderr in one line
(gradsync.runner.worker): a restart shows none of a failed attempt's errors by itself."""

from __future__ import annotations

import pytest

from gradsync.errors import SyncTimeoutError
from gradsync.runner import worker

pytestmark = pytest.mark.unit


def _restarts(monkeypatch: pytest.MonkeyPatch, done: int, allowed: int) -> None:
    monkeypatch.setenv("TORCHELASTIC_RESTART_COUNT", str(done))
    monkeypatch.setenv("TORCHELASTIC_MAX_RESTARTS", str(allowed))
    monkeypatch.setattr(worker.runtime, "rank", lambda: 1)


def test_a_failure_before_a_restart_is_said_in_one_line(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _restarts(monkeypatch, 0, 1)
    worker._said_before_restart(SyncTimeoutError("step 3: the step failed\nmore detail"))
    err = capsys.readouterr().err
    assert err == (
        "gradsync: rank 1 failed, and the run restarts: SyncTimeoutError: step 3: the step failed\n"
    )


@pytest.mark.parametrize(
    ("done", "allowed", "exc"),
    [
        (1, 1, SyncTimeoutError("x")),  # the restarts are spent: the run's own line says it
        (0, 0, SyncTimeoutError("x")),  # no restarts at all
        (0, 1, KeyboardInterrupt()),  # not a failure of the rank's own
    ],
)
def test_nothing_is_said_where_the_run_does_not_restart(
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
    done: int,
    allowed: int,
    exc: BaseException,
) -> None:
    _restarts(monkeypatch, done, allowed)
    worker._said_before_restart(exc)
    assert capsys.readouterr().err == ""
