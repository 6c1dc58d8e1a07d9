"""Fault and slowness injection, shipped in the library so tests and demos read like scenarios."""

from __future__ import annotations

import time
from dataclasses import dataclass

from gradsync.errors import UsageError

SLOW_FORM = "RANK:FACTOR[@STEP] (e.g. 3:2 or 1:1.5@100), comma-separated for several ranks"


@dataclass(frozen=True, slots=True, kw_only=True)
class Slowdown:
    """Make ``rank``'s compute ``factor`` times as long from step ``start`` on."""

    rank: int
    factor: float
    start: int = 0

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise UsageError(f"slowdown rank must be >= 0, got {self.rank}")
        if not self.factor >= 1.0:
            raise UsageError(f"slowdown factor must be >= 1, got {self.factor}")
        if self.start < 0:
            raise UsageError(f"slowdown start step must be >= 0, got {self.start}")

    def delay(self, rank: int, step: int, natural_compute: float) -> float:
        """Seconds to sleep: proportional to the rank's own measured compute, so the slowdown
        scales with the workload instead of adding a constant."""
        if rank != self.rank or step < self.start:
            return 0.0
        return (self.factor - 1.0) * natural_compute


def parse_slow(spec: str | None) -> list[Slowdown]:
    if spec is None or not spec.strip():
        return []
    out = []
    for part in spec.split(","):
        head, _, start = part.strip().partition("@")
        rank, sep, factor = head.partition(":")
        try:
            if not sep:
                raise ValueError
            out.append(
                Slowdown(rank=int(rank), factor=float(factor), start=int(start) if start else 0)
            )
        except ValueError:
            raise UsageError(f"bad --slow value {part.strip()!r}; valid: {SLOW_FORM}") from None
    return out


def apply_slowdowns(slowdowns: list[Slowdown], rank: int, step: int, natural: float) -> float:
    """Sleep at block entry for the extra time the slowdown adds to ``natural`` (this rank's own
    compute without injected delay, as last measured); return the seconds slept.

    The sleep comes first in the block so that the rank's whole step, bucket launches
    included, is late: a sleep after backward would only delay the next step's collectives.
    """
    delay = sum(s.delay(rank, step, natural) for s in slowdowns)
    if delay > 0:
        time.sleep(delay)
    return delay
