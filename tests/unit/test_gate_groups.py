"""How the step gate groups its ranks (gradsync.checks.gate_groups, issue 44): flat on a few
ranks, about the square root of the world from 64, a size of the user's own checked."""

from __future__ import annotations

import pytest

from gradsync.errors import UsageError
from gradsync.gate_layout import AUTO_FROM_RANKS, group_of, group_size, groups_of
from gradsync.options import Limits

pytestmark = pytest.mark.unit


def test_a_world_below_the_grouping_size_is_one_group() -> None:
    for world in (1, 2, 8, AUTO_FROM_RANKS - 1):
        assert group_size(world) == world


@pytest.mark.parametrize(
    ("world", "size", "groups"), [(64, 8, 8), (65, 9, 8), (1024, 32, 32), (16384, 128, 128)]
)
def test_a_large_world_groups_by_its_square_root(world: int, size: int, groups: int) -> None:
    assert group_size(world) == size
    assert groups_of(world, size) == groups
    assert size * (groups - 1) < world <= size * groups  # every rank in one group


def test_a_requested_size_is_kept_and_capped_at_the_world() -> None:
    assert group_size(4, 3) == 3
    assert group_size(4, 10) == 4  # one group: flat
    assert group_size(16384, 2) == 2


def test_the_last_group_holds_the_rest() -> None:
    assert [list(group_of(r, 3, 4)) for r in range(4)] == [[0, 1, 2]] * 3 + [[3]]
    assert groups_of(4, 3) == 2
    assert list(group_of(130, 128, 200)) == list(range(128, 200))


@pytest.mark.parametrize("bad", [0, 1, -4, 2.5, "8"])
def test_an_invalid_group_size_is_refused_by_name(bad: object) -> None:
    with pytest.raises(UsageError, match=r"gate_group_size must be an integer >= 2.*got"):
        Limits(gate_group_size=bad)  # type: ignore[arg-type]
    if isinstance(bad, int):
        with pytest.raises(ValueError, match="gate_group_size"):
            group_size(16, bad)
