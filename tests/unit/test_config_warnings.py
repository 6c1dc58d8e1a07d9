"""A RunConfig check's warning (``--compress randomk:0.05``) is one ``gradsync: warning:`` line
of the command, once, and no rank prints it again (gradsync.runner.config.checked_compression)."""

from __future__ import annotations

import warnings

import pytest

from gradsync.compression import parse_compression
from gradsync.runner import config
from gradsync.runner.config import RunConfig

pytestmark = pytest.mark.unit


@pytest.fixture(autouse=True)
def _fresh(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(config, "_SAID", set())
    monkeypatch.setattr(config, "_PRINTED", [True])


@pytest.mark.timeout(60)
def test_the_command_says_it_once_as_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        RunConfig(compression="randomk:0.05")
        RunConfig(compression="randomk:0.05", strategy="local:2")  # compare's second run
        parse_compression("randomk:0.05")  # --resume's check of the same spec
    err = capsys.readouterr().err
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith("gradsync: warning: randomk:0.05: every kept value")
    assert "spec.py" not in err and "lambda" not in err  # no source line of gradsync's
    assert not [w for w in caught if "randomk" in str(w.message)]


@pytest.mark.timeout(60)
def test_a_rank_says_it_not_again(capsys: pytest.CaptureFixture[str]) -> None:
    config.said_by_the_command()  # as worker.run_script does before its RunConfig
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("default")
        RunConfig.from_dict({"compression": "randomk:0.05"})
        parse_compression("randomk:0.05")  # the rank's Synchronizer
    assert capsys.readouterr().err == ""
    assert not [w for w in caught if "randomk" in str(w.message)]


@pytest.mark.timeout(60)
def test_a_library_caller_still_gets_the_warning() -> None:
    with pytest.warns(UserWarning, match="randomk:0.02"):
        parse_compression("randomk:0.02")
