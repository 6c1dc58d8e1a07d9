"""How the step gate groups its ranks (``gradsync.checks.gate_groups``): the rule alone, free
of torch, so that the simulator (``gradsync.sim.gate``) prices the gate the runtime passes."""

from __future__ import annotations

import math

#: below this many ranks the gate is flat unless a group size is given: the world's store
#: serves ``2 N`` requests a step, well under a millisecond's worth at TCPStore's rate, and a
#: group's store would cost a server and a round trip more for nothing
AUTO_FROM_RANKS = 64


def group_size(world_size: int, requested: int | None = None) -> int:
    """How many ranks count at each group's store; ``world_size`` itself for a flat gate.

    ``requested``: ``Limits.gate_group_size`` (None: flat below :data:`AUTO_FROM_RANKS` ranks,
    else the square root of the world, rounded up, which balances the groups' stores against
    the world's)."""
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if requested is None:
        if world_size < AUTO_FROM_RANKS:
            return world_size
        return math.isqrt(world_size - 1) + 1
    if requested < 2:
        raise ValueError(f"gate_group_size must be >= 2 or None (automatic), got {requested}")
    return min(requested, world_size)


def groups_of(world_size: int, size: int) -> int:
    """How many groups ``world_size`` ranks make in groups of ``size`` (the last may be
    smaller)."""
    return -(-world_size // size)


def group_of(rank: int, size: int, world_size: int) -> range:
    """The ranks of ``rank``'s group: ``size`` consecutive ranks (fewer in the last group), the
    first of them serving its store."""
    first = rank - rank % size
    return range(first, min(first + size, world_size))


__all__ = ["AUTO_FROM_RANKS", "group_of", "group_size", "groups_of"]
