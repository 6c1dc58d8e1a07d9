"""The step gate's cost at scale (issue 44): what the gate's store round trips cost a step, flat
(every rank's requests at the one store on rank 0) or in groups (``gradsync.checks.gate_groups``).

Why it is written this way: a store serves requests one at a time, so what a gate costs is the
requests its busiest store serves before the last arrival's key is set, at that store's rate.
The ranks leave their previous step together (a lockstep strategy's ranks do) and arrive at
about the same time, so each store's requests queue up at once.

Flat (``g == N``): every rank makes two requests to the world's store, a ``set`` of its own key
when it arrives (sent without waiting for an answer) and a ``wait`` for every rank's; then half
a round trip for the last ``set`` to reach the store and half for the waits' answers::

    flat gate opens    = 2 N / R_world + 1 RTT

In ``G = ceil(N / g)`` groups of ``g`` ranks: each rank makes its two requests to its group's
store, the groups' stores serving theirs side by side; each group's first rank then makes two
at the world's store, where the groups arrive; then it sets its group's ``go``, which its
group's store hands to the ``g - 1`` waiters (counted as ``g`` requests more). Three round
trips, each half of one: the members' ``set``, the group's answer, the world's ``set``, the
world's answer, the group's ``go``, its answer::

    grouped gate opens = 2 g / R + 2 G / R_world + g / R + 3 RTT

``R`` is what one store serves in requests per second with many clients (``store_rate``;
TCPStore on loopback here: ``benchmarks.gate`` measures it). ``R_world = R - N / beat_s``: the
world's store also takes every rank's heartbeat, one write each ``beat_s``
(``gradsync.checks.diagnose``), which leaves it that much less for the gate; where the
heartbeats alone take all of it (``N / beat_s >= R``) the gate never opens: ``open_ms`` is
``math.inf``. The group size is the runtime's (``gradsync.gate_layout.group_size``):
flat below 64 ranks unless one is given, else ``ceil(sqrt(N))``, which brings the busiest store
from ``2 N`` to about ``2 sqrt(N)`` requests a step.

Under ``bsp`` and ``zero:1``/``zero:2`` the wait runs on its own thread from the block's entry
and is joined before the step's first collective (``gradsync.checks.gate_ahead``): it costs the
step only what is left of it when the first bucket is ready. ``zero:3`` gathers parameters in
the forward, so its gate comes before it and all of it is on the critical path.

Limits: one rate for every store, whatever its load and host (a group's store is served by one
of the training ranks, beside its training); the waits' own cost at the store (a registration
each) counted only as their request; the peers' heartbeats the waiting gate reads, and the
voucher's writes, left out; the arrivals taken as simultaneous, so a group whose ranks arrive
spread out queues less than priced. What it says: with tens of thousands of requests a second,
the flat gate is free on a few ranks and dominates the step at thousands; in groups it stays
within milliseconds at 16,384 ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradsync.errors import UsageError
from gradsync.gate_layout import group_size, groups_of

__all__ = ["StoreGate"]

#: requests each rank makes to its gate's store per step (a set of its key, then a wait)
REQUESTS_PER_RANK = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreGate:
    """The step gate's stores: each serving ``store_rate`` requests per second, each round trip
    ``rtt_ms``; ranks counted in groups of ``group_size`` (None: the runtime's automatic size,
    as ``Limits.gate_group_size=None``); every rank's heartbeat written to the world's store
    each ``beat_s`` seconds (the runtime's: ``min(1, timeout_s / 4)``, 1 s from a 4 s timeout
    up)."""

    store_rate: float
    rtt_ms: float = 0.1
    group_size: int | None = None
    beat_s: float = 1.0

    def __post_init__(self) -> None:
        if not (self.store_rate > 0 and math.isfinite(self.store_rate)):
            raise UsageError(
                f"--gate-store-rate must be a finite number of requests per second > 0, "
                f"got {self.store_rate}"
            )
        if not (self.rtt_ms >= 0 and math.isfinite(self.rtt_ms)):
            raise UsageError(f"--gate-rtt-ms must be a finite number >= 0, got {self.rtt_ms}")
        check_group_size(self.group_size)
        if not (self.beat_s > 0 and math.isfinite(self.beat_s)):
            raise UsageError(
                f"the heartbeat's beat_s must be a finite number > 0, got {self.beat_s}"
            )

    def size(self, workers: int) -> int:
        """Ranks counted at each group's store on ``workers`` ranks (``workers``: flat)."""
        return group_size(workers, self.group_size)

    def groups(self, workers: int) -> int:
        """How many groups ``workers`` ranks make (1: flat)."""
        return groups_of(workers, self.size(workers))

    def world_rate(self, workers: int) -> float:
        """Requests a second the world's store has for the gate once ``workers`` heartbeats are
        served (<= 0: none)."""
        return self.store_rate - workers / self.beat_s

    def form(self, workers: int) -> str:
        """``flat``, or ``G groups of g``, as the gate is on ``workers`` ranks."""
        g = self.size(workers)
        return "flat" if g >= workers else f"{self.groups(workers)} groups of {g}"

    def open_ms(self, workers: int) -> float:
        """Milliseconds from the ranks' arrival to the gate's opening on ``workers`` ranks
        (``math.inf`` where the heartbeats leave the world's store nothing for it)."""
        world = self.world_rate(workers)
        if world <= 0:
            return math.inf
        g = self.size(workers)
        if g >= workers:
            return 1000.0 * REQUESTS_PER_RANK * workers / world + self.rtt_ms
        group = REQUESTS_PER_RANK * g / self.store_rate  # the groups' stores, side by side
        top = REQUESTS_PER_RANK * self.groups(workers) / world  # each group's first rank
        go = g / self.store_rate  # the group's go, handed to its waiters
        return 1000.0 * (group + top + go) + 3 * self.rtt_ms

    def cost_ms(self, workers: int, hidden_ms: float) -> float:
        """What the gate adds to a step whose first collective is ready ``hidden_ms`` after the
        ranks arrive (0 where the gate comes before any compute)."""
        return max(0.0, self.open_ms(workers) - hidden_ms)


def check_group_size(size: int | None) -> None:
    """``UsageError`` naming ``--gate-group-size`` unless ``size`` is None (automatic) or a
    whole number of ranks >= 2 (as ``Limits.gate_group_size``)."""
    if size is None or (isinstance(size, int) and not isinstance(size, bool) and size >= 2):
        return
    raise UsageError(
        f"--gate-group-size must be a whole number of ranks >= 2 (or not given: automatic, flat "
        f"below 64 ranks, else about the square root of the ranks), got {size!r}"
    )
