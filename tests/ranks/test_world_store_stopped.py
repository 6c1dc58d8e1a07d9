"""A stopped rank 0 that serves the world's store (gradsync.checks.answered, issue 44): torch's
store client never gives up on a stopped server, so before 2026-12-01 its peers blocked in a
store call for ever, in the step gate or after their exchange timed out. Now each fails within
about the timeout, naming rank 0 and the silent store."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from gradsync.checks.answered import ANSWER_S
from tests.support import world_store_ranks
from tests.support.overlap import Overlapped, overlapped, ranks

pytestmark = pytest.mark.ranks

WORLD = 3
#: what a survivor may take to fail, from its step's start: the silence it judges counts from
#: the first call left unanswered (its heartbeat's, within a beat of the stop), and must reach
#: the gate's timeout (2 s) and never less than answered.ANSWER_S (3 s); the exchange's own
#: timeout comes first where rank 0 stopped inside its step; the rest is slack for 9 ranks on 2
#: cores. Far from what the wait was before: for ever (past the harness's 40 s, seen)
BOUND_S = world_store_ranks.TIMEOUT_S + ANSWER_S + 8.0

CASES = {
    # the survivors wait at the step's gate, on the gate's thread (bsp waits for it ahead)
    "bsp, between steps": ("bsp", "between steps"),
    # the survivors' exchange times out; naming who never arrived reads the store
    "bsp, in its step": ("bsp", "in its step"),
    # the gate waited in place, on the training thread (zero:3's precedes its forward)
    "zero:3, between steps": ("zero:3", "between steps"),
    # the same, its key's set made behind the heartbeat's call already left unanswered
    "zero:3, at once": ("zero:3", "at once"),
}


@pytest.fixture(scope="module")
def launched() -> Iterator[Overlapped]:
    """The launches at once, so that their waits overlap (tests/support/overlap.py)."""
    with overlapped(
        {
            name: ranks(
                world_store_ranks.rank_0_stopped,
                WORLD,
                strategy,
                where,
                collective_timeout_s=world_store_ranks.GROUP_TIMEOUT_S,
                timeout_s=120,
            )
            for name, (strategy, where) in CASES.items()
        }
    ) as out:
        yield out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("case", list(CASES))
def test_a_stopped_rank_0_serving_the_store_is_named_within_the_timeout(
    launched: Overlapped, case: str
) -> None:
    results = launched.result(case)
    assert results[0] == {"stayed_away": True}
    for rank in range(1, WORLD):
        error, waited = results[rank]["error"], results[rank].get("waited")
        assert error is not None, (rank, results[rank])
        assert "has not answered a request" in error, (rank, error)
        assert "Rank 0's process is not running" in error, (rank, error)
        assert waited < BOUND_S, (rank, waited, error)
