"""The elastic agent's restart count, read in one place: unset is 0, a count is itself, and a
value that is no count is refused with one message everywhere it is read (it was taken for 0
in one place, for no restarts left in another and a bare ValueError in two)."""

from __future__ import annotations

import pytest

from gradsync import attached_run, runtime
from gradsync.errors import UsageError
from gradsync.processes import elastic_env

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def test_unset_is_the_first_attempt_and_a_count_is_itself(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv(elastic_env.RESTART_COUNT_ENV, raising=False)
    assert elastic_env.restart_count() == 0
    monkeypatch.setenv(elastic_env.RESTART_COUNT_ENV, "3")
    assert elastic_env.restart_count() == 3
    assert attached_run.restart_count() == 3 and runtime.restart_count() == 3


@pytest.mark.parametrize("bad", ["two", "-1", "1.5"])
def test_a_value_that_is_no_count_is_refused_naming_it(
    monkeypatch: pytest.MonkeyPatch, bad: str
) -> None:
    monkeypatch.setenv(elastic_env.RESTART_COUNT_ENV, bad)
    for read in (elastic_env.restart_count, attached_run.restart_count, runtime.restart_count):
        with pytest.raises(UsageError, match=f"TORCHELASTIC_RESTART_COUNT='{bad}'.*integer >= 0"):
            read()


def test_restarts_left_is_false_for_a_bad_value_and_counts_otherwise(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # asked on the way out of a failure: it must not raise over the failure being reported
    monkeypatch.setenv(elastic_env.MAX_RESTARTS_ENV, "2")
    monkeypatch.setenv(elastic_env.RESTART_COUNT_ENV, "1")
    assert runtime.restarts_left()
    monkeypatch.setenv(elastic_env.RESTART_COUNT_ENV, "2")
    assert not runtime.restarts_left()
    monkeypatch.setenv(elastic_env.RESTART_COUNT_ENV, "x")
    assert not runtime.restarts_left()
