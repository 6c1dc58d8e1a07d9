"""The step gate's cost at scale (issue 44): what the gate's store round trips cost a step
once every rank's requests go through the one store on rank 0.

The gate (``gradsync.checks.gate``) has every rank make two requests to the store per step: an
``add`` when it arrives, then a ``wait`` for the last arrival's ``go`` (the last arrival makes a
``set`` instead). The store serves requests one at a time, so the last ``go`` is set about
``2 N / rate`` after the ranks leave their previous step together (a lockstep strategy's ranks
do), plus a round trip for the last ``add`` and one for the ``go`` to reach the waiters::

    gate opens = 2 N / store_rate + 2 RTT

Under ``bsp`` and ``zero:1``/``zero:2`` that wait runs on its own thread from the block's entry
and is joined before the step's first collective (``gradsync.checks.gate_ahead``): it costs the
step only what is left of it when the first bucket is ready. ``zero:3`` gathers parameters in
the forward, so its gate comes before it and all of it is on the critical path.

``store_rate`` is what one store serves in requests per second with many clients (TCPStore on
loopback here: ``benchmarks.gate`` measures it); the model ignores the waits' own cost at the
store (a registration each) beyond their request. What it says: with tens of thousands of
requests a second, the gate is free on a few ranks and dominates the step at thousands.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gradsync.errors import UsageError

__all__ = ["StoreGate"]

#: requests each rank makes to the store per gate
REQUESTS_PER_RANK = 2


@dataclass(frozen=True, kw_only=True, slots=True)
class StoreGate:
    """One store serving every rank's gate requests: ``store_rate`` requests per second, each
    round trip ``rtt_ms``."""

    store_rate: float
    rtt_ms: float = 0.1

    def __post_init__(self) -> None:
        if not (self.store_rate > 0 and math.isfinite(self.store_rate)):
            raise UsageError(
                f"--gate-store-rate must be a finite number of requests per second > 0, "
                f"got {self.store_rate}"
            )
        if not (self.rtt_ms >= 0 and math.isfinite(self.rtt_ms)):
            raise UsageError(f"--gate-rtt-ms must be a finite number >= 0, got {self.rtt_ms}")

    def open_ms(self, workers: int) -> float:
        """Milliseconds from the ranks' arrival to the gate's opening on ``workers`` ranks."""
        return 1000.0 * REQUESTS_PER_RANK * workers / self.store_rate + 2 * self.rtt_ms

    def cost_ms(self, workers: int, hidden_ms: float) -> float:
        """What the gate adds to a step whose first collective is ready ``hidden_ms`` after the
        ranks arrive (0 where the gate comes before any compute)."""
        return max(0.0, self.open_ms(workers) - hidden_ms)
