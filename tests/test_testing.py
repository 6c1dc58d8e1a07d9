"""``run_ranks`` hands each rank the caller's environment and working directory as they are at
the call, though its ranks are forked from a server started at an earlier call."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gradsync.testing import run_ranks

pytestmark = pytest.mark.ranks

NAME = "GRADSYNC_TEST_RUN_RANKS_MARK"


def _seen(rank: int, world: int) -> tuple[str | None, str, str]:
    return os.environ.get(NAME), os.getcwd(), os.environ["RANK"]


@pytest.mark.timeout(120)
def test_each_call_gives_the_ranks_the_callers_environment_and_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    first, second = tmp_path / "first", tmp_path / "second"
    first.mkdir()
    second.mkdir()
    monkeypatch.setenv(NAME, "first")
    monkeypatch.chdir(first)
    assert run_ranks(_seen, 2) == [("first", str(first), "0"), ("first", str(first), "1")]
    monkeypatch.setenv(NAME, "second")
    monkeypatch.chdir(second)
    assert run_ranks(_seen, 2) == [("second", str(second), "0"), ("second", str(second), "1")]
    monkeypatch.delenv(NAME)
    assert [seen[0] for seen in run_ranks(_seen, 2)] == [None, None]
