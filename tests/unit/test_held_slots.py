"""The two slots where a rank leaves held snapshots for its writer
(``gradsync.checkpoint.held_slots``)."""

from __future__ import annotations

import mmap

import pytest

from gradsync.checkpoint.held_slots import HeldSlots

pytestmark = pytest.mark.unit


def _box(slot: int = 64) -> HeldSlots:
    return HeldSlots(mmap.mmap(-1, 2 * slot), slot)


def test_the_two_newest_messages_are_kept_oldest_first() -> None:
    box = _box()
    assert box.entries() == []
    for seq in (1, 2, 3):
        assert box.put(seq, f"step {seq}".encode())
    assert box.entries() == [(2, b"step 2"), (3, b"step 3")]


class _KilledAfter(bytearray):
    """A slot area whose writer dies after ``writes`` assignments (a rank killed in ``put``)."""

    writes = 0

    def __setitem__(self, key: object, value: object) -> None:
        if self.writes == 0:
            raise KeyboardInterrupt("killed")
        self.writes -= 1
        super().__setitem__(key, value)  # type: ignore[index]


def test_a_put_cut_short_leaves_the_message_before_it_whole() -> None:
    area = _KilledAfter(2 * 64)
    box = HeldSlots(area, 64)  # type: ignore[arg-type]
    area.writes = 100
    box.put(1, b"one")
    box.put(2, b"two")
    for cut in range(1, 4):  # killed after the stamp, the bytes, the length of put(3)
        area.writes = cut
        with pytest.raises(KeyboardInterrupt):
            box.put(3, b"three, longer than one")
        assert box.entries() == [(2, b"two")], cut


def test_a_message_too_large_for_a_slot_is_refused() -> None:
    box = _box(slot=32)
    assert not box.put(1, b"x" * (box.capacity + 1))
    assert box.put(1, b"x" * box.capacity)
    with pytest.raises(ValueError, match="seq must be >= 1"):
        box.put(0, b"")
