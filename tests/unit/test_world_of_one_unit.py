"""A world of one: part of the torchrun environment set is an error, not a world of one. Run
for real: tests/e2e/test_world_of_one.py."""

from __future__ import annotations

import pytest

import gradsync as gs
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit
TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "LOCAL_RANK")


def test_part_of_the_torchrun_environment_is_an_error(monkeypatch: pytest.MonkeyPatch) -> None:
    for key in TORCHRUN_ENV:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(UsageError, match="MASTER_ADDR, MASTER_PORT is not set"):
        gs.init()
