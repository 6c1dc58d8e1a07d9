"""Streaming DiLoCo's exchanges posted once every rank has arrived (issue 46): the rank that
arrives first at an exchange's step goes on training and waits, if at all, where the exchange
is applied; the values are those of an exchange posted at its step; the script's own
collectives of the steps between cannot pair with it; a compressor that waits inside its hook
keeps the exchange at its step."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import posting_ranks
from tests.support.posting_ranks import LATE_AT, LATE_S

pytestmark = pytest.mark.ranks

WORLD = 2


@pytest.fixture(scope="module")
def runs() -> Iterator[list[dict[str, Any]]]:
    yield run_ranks(posting_ranks.scenarios, WORLD, timeout_s=100)


@pytest.mark.timeout(120)
def test_the_rank_that_arrived_first_posts_where_the_exchange_is_due(
    runs: list[dict[str, Any]],
) -> None:
    first = runs[0]["late"]
    assert first["own_group"]
    # rank 1 was in its own code when rank 0 ended step LATE_AT: rank 0 went on to the
    # exchange's due step and posted it there, waiting for rank 1 then, not at LATE_AT
    assert (LATE_AT + 1, "outer_post[0]") in first["posted"]
    assert (LATE_AT, "outer_post[0]") not in first["posted"]
    assert first["sync_s"][LATE_AT] < LATE_S / 2
    assert first["sync_s"][LATE_AT + 1] > LATE_S / 2
    # the late rank found the gate open by the next step's beginning at the latest
    assert {(LATE_AT, "outer_post[0]"), (LATE_AT + 1, "outer_post[0]")} & set(
        runs[1]["late"]["posted"]
    )
    assert runs[1]["late"]["sync_s"][LATE_AT] < LATE_S / 2


@pytest.mark.timeout(120)
def test_posting_later_changes_no_value(runs: list[dict[str, Any]]) -> None:
    # the gate off posts every exchange at its step; the same bits either way, every rank
    for r in range(WORLD):
        assert torch.equal(runs[r]["late"]["params"], runs[0]["no gate"]["params"])
        assert torch.equal(runs[r]["late, metric"]["params"], runs[0]["no gate"]["params"])
    assert not runs[0]["no gate"]["own_group"]


@pytest.mark.timeout(120)
def test_the_scripts_own_collectives_do_not_pair_with_an_exchange(
    runs: list[dict[str, Any]],
) -> None:
    # rank 0 posted the exchange of step LATE_AT one step later than rank 1; the script's
    # all-reduce of each step still met its own on the other rank
    for r in range(WORLD):
        assert runs[r]["late, metric"]["sums"] == [3.0] * 12
    assert (LATE_AT + 1, "outer_post[0]") in runs[0]["late, metric"]["posted"]


@pytest.mark.timeout(120)
def test_a_compressor_that_waits_in_its_hook_posts_at_the_exchanges_step(
    runs: list[dict[str, Any]],
) -> None:
    # PowerSGD waits for its first round inside the hook: posted at its step, after the gate
    for r in range(WORLD):
        run = runs[r]["late, powersgd"]
        assert not run["own_group"] and run["posted"] == []
    assert runs[0]["late, powersgd"]["sync_s"][LATE_AT] > LATE_S / 2
