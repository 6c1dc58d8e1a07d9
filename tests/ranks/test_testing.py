"""``run_ranks`` hands each rank the caller's environment as it is at the call, though its ranks
are forked from a server started at an earlier call."""

from __future__ import annotations

import os

import pytest

from gradsync.testing import run_ranks

pytestmark = pytest.mark.ranks

NAME = "GRADSYNC_TEST_RUN_RANKS_MARK"


def _seen(rank: int, world: int) -> tuple[str | None, str]:
    return os.environ.get(NAME), os.environ["RANK"]


@pytest.mark.timeout(120)
def test_each_call_gives_the_ranks_the_callers_environment(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(NAME, "first")
    assert run_ranks(_seen, 2) == [("first", "0"), ("first", "1")]
    monkeypatch.setenv(NAME, "second")
    assert run_ranks(_seen, 2) == [("second", "0"), ("second", "1")]
    monkeypatch.delenv(NAME)
    assert run_ranks(_seen, 2) == [(None, "0"), (None, "1")]
