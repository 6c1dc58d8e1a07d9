"""Hierarchical all-reduce (``allreduce="hierarchical"``): what it refuses names the choices.
On ranks standing for hosts: tests/ranks/test_topology.py."""

from __future__ import annotations

import pytest

from gradsync.errors import UsageError
from gradsync.runner.config import RunConfig
from gradsync.strategies import parse_strategy
from gradsync.topology import check_allreduce, check_hierarchical, host_key

pytestmark = pytest.mark.unit


def test_what_it_refuses_names_the_choices(monkeypatch: pytest.MonkeyPatch) -> None:
    assert check_allreduce("ring") == "ring"
    with pytest.raises(UsageError, match="allreduce must be one of ring, hierarchical, got 'tree'"):
        check_allreduce("tree")
    check_hierarchical("hierarchical", parse_strategy("zero:1"), "none")
    check_hierarchical("ring", parse_strategy("local:4"), "int8")  # flat: anything goes
    check_hierarchical("hierarchical", parse_strategy("bsp"), "int8")
    check_hierarchical("hierarchical", parse_strategy("diloco:4:2"), "int8")
    with pytest.raises(UsageError, match="strategy async does not exchange through it"):
        check_hierarchical("hierarchical", parse_strategy("async"), "none")
    with pytest.raises(UsageError, match="strategy zero:2 does not exchange through it"):
        RunConfig(strategy="zero:2", allreduce="hierarchical", out="unused")
    monkeypatch.delenv("GRADSYNC_HOST", raising=False)
    monkeypatch.setenv("GROUP_RANK", "3")
    assert host_key() == "GROUP_RANK=3"
    monkeypatch.setenv("GRADSYNC_HOST", "rack1-a")
    assert host_key() == "GRADSYNC_HOST=rack1-a"
