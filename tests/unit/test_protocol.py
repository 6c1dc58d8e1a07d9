"""The strategy protocol: a strategy object passes through and declares its layout, a layout
without workers is refused. A strategy written against it alone, trained on ranks:
tests/ranks/test_protocol_ranks.py."""

from __future__ import annotations

import pytest

from gradsync.strategies import Layout, Strategy, parse_strategy, uses_servers
from tests.support import toy_strategy_ranks

pytestmark = pytest.mark.unit


def test_a_strategy_object_passes_through_and_declares_its_layout() -> None:
    toy = toy_strategy_ranks.AverageEveryStep()
    assert isinstance(toy, Strategy)
    assert parse_strategy(toy) is toy
    assert not uses_servers(toy)
    assert uses_servers(parse_strategy("ssp:1"))
    assert Layout.of(4, parse_strategy("async").servers) == Layout(workers=3, servers=1)
    assert Layout(workers=3, servers=1).role(3) == "server"
    assert Layout(workers=3, servers=1).role(0) == "worker"


def test_a_layout_without_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="leave no worker in a group of 2 ranks"):
        Layout.of(2, 2)
