"""A failed wait says where each rank is waiting when the ranks are in different collectives
(the gate before a collective says so too: tests/ranks/test_gate.py, a save on rank 0 alone)."""

from __future__ import annotations

import pytest
import torch.distributed as dist

from gradsync.checks.diagnose import ArrivalWatch

pytestmark = pytest.mark.unit


def _describe(records: dict[int, str], position: tuple[int, int], what: str) -> str:
    """``records``: each rank's ``step:n:what`` (``what`` may be left out)."""
    store = dist.HashStore()
    for rank, record in records.items():
        step, _, rest = record.partition(":")
        n, _, name = rest.partition(":")
        store.set(f"gradsync/arrive/{rank}", f"{step}:{n}" if n else step)
        if name:
            store.set(f"gradsync/arrive/{rank}/what", name)
    watch = ArrivalWatch(0, 3, 4.0, store=store)
    return watch.describe(position, what, 4.0, RuntimeError("timed out"))


def test_ranks_in_different_collectives_are_each_placed() -> None:
    message = _describe(
        {1: "6:0:gradient exchange (1 bucket(s), none)", 2: "5:1:checkpoint barrier"},
        (5, 1),
        "checkpoint barrier",
    )
    assert "arrived: ranks [0, 1, 2]" in message
    assert "The ranks are not all in the same collective" in message
    assert "rank 0 at step 5 in checkpoint barrier" in message
    assert "rank 1 at step 6 in gradient exchange (1 bucket(s), none)" in message


def test_a_plain_hang_is_not_called_a_different_collective() -> None:
    # Rank 2 last waited at step 4 (it never arrived); rank 1 waits where rank 0 does.
    message = _describe(
        {1: "5:1:checkpoint barrier", 2: "4:0:gradient exchange"}, (5, 1), "checkpoint barrier"
    )
    assert "never arrived: ranks [2]" in message
    assert "not all in the same collective" not in message
    # Records without the wait's name (a store written by an older gradsync) still read.
    assert "never arrived: ranks [2]" in _describe({1: "5", 2: "4"}, (5, 0), "barrier")
