"""Who averages with whom in a round of gossip (``gossip:H``), computed alike on every rank and
in the simulator, without torch.

On a power-of-two number of ranks, the hypercube: round r pairs ``rank`` with
``rank XOR 2**(r mod log2 W)``, so that after log2 W rounds without local steps between every
rank would hold the exact mean. Otherwise a perfect matching drawn afresh each round from a
permutation seeded by the round number alone; with an odd number of ranks one sits the round
out.
"""

from __future__ import annotations

import random

__all__ = ["partner"]


def partner(rank: int, world: int, round_: int) -> int | None:
    """``rank``'s partner in round ``round_`` (None: it sits the round out)."""
    if world < 2:
        return None
    if world & (world - 1) == 0:
        dimensions = world.bit_length() - 1
        return rank ^ (1 << (round_ % dimensions))
    order = list(range(world))
    random.Random(round_).shuffle(order)  # seeded by the round alone: alike on every rank
    place = order.index(rank)
    if place == world - 1 and world % 2:
        return None  # the odd one out
    return order[place ^ 1]
