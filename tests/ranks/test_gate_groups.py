"""The step gate counted in groups (gradsync.checks.gate_groups, issue 44): the same guarantee
as the flat gate, a peer in its own code waited for and a stopped one named, with the ranks
counted at their group's store and only the groups at the world's."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from tests.support import gate_group_ranks, proctree
from tests.support.overlap import Overlapped, overlapped, ranks

pytestmark = pytest.mark.ranks

GROUP_TIMEOUT_S = 30  # the process group's own, which the user's collectives keep
WORLD = 4


@pytest.fixture(scope="module")
def launched() -> Iterator[Overlapped]:
    """Both launches at once, so that their waits overlap (tests/support/overlap.py)."""
    with overlapped(
        {
            "late": ranks(
                gate_group_ranks.late_member,
                WORLD,
                collective_timeout_s=GROUP_TIMEOUT_S,
                timeout_s=120,
            ),
            "frozen": ranks(
                gate_group_ranks.frozen_member,
                WORLD,
                collective_timeout_s=GROUP_TIMEOUT_S,
                timeout_s=120,
            ),
            "frozen server": ranks(
                gate_group_ranks.frozen_member,
                WORLD,
                0,
                collective_timeout_s=GROUP_TIMEOUT_S,
                timeout_s=120,
            ),
        }
    ) as out:
        yield out


@pytest.mark.timeout(150)
def test_a_late_member_is_waited_for_and_the_world_counts_groups(launched: Overlapped) -> None:
    results = launched.result("late")
    assert [r["steps"] for r in results] == [6] * WORLD
    for r in results[1:]:
        assert torch.equal(r["params"], results[0]["params"])
    # Two groups, (0, 1, 2) and (3): the world's store counted two arrivals, not four ranks.
    assert [r["counted"] for r in results] == [2] * WORLD
    # Rank 0 serves the first group's store, on the address it reaches the world's store at
    # (loopback here), never on every interface (README, "Trust model"); the others serve none.
    listening = results[0]["group_store_listens_on"]
    assert listening and all(proctree.is_loopback(x) for x in listening), listening
    assert [r["group_store_listens_on"] for r in results[1:]] == [None] * (WORLD - 1)


@pytest.mark.timeout(150)
@pytest.mark.parametrize(
    ("launch", "stopped"),
    [
        # a member: its group's ranks wait at their group's store, rank 3 at the world's
        ("frozen", 2),
        # rank 0 serves group (0, 1, 2)'s store: stopped, that store answers nobody (a store
        # call then never returns, whatever its timeout), so ranks 1 and 2 wait for it on a
        # thread of their own and judge rank 0 meanwhile
        ("frozen server", 0),
    ],
    ids=["member", "serving rank"],
)
def test_a_stopped_rank_is_named_by_every_other(
    launched: Overlapped, launch: str, stopped: int
) -> None:
    results = launched.result(launch)
    assert results[stopped] == {"stayed_away": True}
    for rank in sorted(set(range(WORLD)) - {stopped}):
        error = results[rank]["error"]
        assert error is not None, rank
        assert f"Rank {stopped}" in error, (rank, error)
        # judged within the timeout's reach (2 s), not the group's collective timeout (30 s)
        assert results[rank]["waited"] < 20, (rank, results[rank]["waited"])
