"""Where a rank leaves its newest snapshots for its writer process without waking it.

With a checkpoint every step, the writer process (``writer_child``) writes only every
``files_every``-th snapshot to a file; the others wait here, in two slots of shared memory, each
holding the message the writer would have been sent, stamped with a sequence number once
complete. The writer reads them when told to (``flush``) or when its rank dies (why not a
message each: docs/checkpoints.md, "Held snapshots").

Torn entries: a slot's stamp is cleared before its contents change and set after, so a rank
killed in the middle of ``put`` leaves that slot unstamped and the other slot (the snapshot
before) intact. Torch-free, like the writer process.
"""

from __future__ import annotations

import mmap

__all__ = ["SLOT_BYTES", "HeldSlots"]

#: a slot's size to begin with (the process writer shares a larger mailbox for a larger message)
SLOT_BYTES = 1 << 20
_HEAD = 16  # the stamp and the length, 8 bytes each


class HeldSlots:
    """Two slots over ``area`` (a shared map of ``2 * slot_bytes``)."""

    def __init__(self, area: mmap.mmap, slot_bytes: int = SLOT_BYTES) -> None:
        if len(area) < 2 * slot_bytes or slot_bytes <= _HEAD:
            raise ValueError(f"a mailbox of {len(area)} bytes cannot hold 2 slots of {slot_bytes}")
        self.area, self.slot_bytes = area, slot_bytes

    @property
    def capacity(self) -> int:
        """The largest message a slot takes."""
        return self.slot_bytes - _HEAD

    def put(self, seq: int, message: bytes) -> bool:
        """Leave ``message`` in slot ``seq % 2`` stamped ``seq`` (>= 1); False if too large."""
        if seq < 1:
            raise ValueError(f"seq must be >= 1, got {seq}")
        if len(message) > self.capacity:
            return False
        at = (seq % 2) * self.slot_bytes
        area = self.area
        area[at : at + 8] = b"\0" * 8  # unstamped while it changes
        area[at + _HEAD : at + _HEAD + len(message)] = message
        area[at + 8 : at + 16] = len(message).to_bytes(8, "little")
        area[at : at + 8] = seq.to_bytes(8, "little")
        return True

    def entries(self) -> list[tuple[int, bytes]]:
        """The stamped messages, oldest first, as ``(seq, message)``."""
        found = []
        for slot in (0, 1):
            at = slot * self.slot_bytes
            seq = int.from_bytes(self.area[at : at + 8], "little")
            length = int.from_bytes(self.area[at + 8 : at + 16], "little")
            if seq and length <= self.capacity:
                found.append((seq, bytes(self.area[at + _HEAD : at + _HEAD + length])))
        return sorted(found)
