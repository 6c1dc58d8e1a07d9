"""Fault and slowness injection, shipped in the library so tests and demos read like scenarios."""

from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import dataclass
from pathlib import Path

from gradsync.errors import UsageError

MAX_FACTOR = 1000.0  # beyond this a "slowdown" is a hang; inf would sleep nan seconds
SLOW_FORM = (
    "RANK:FACTOR[@START[-END]] (e.g. 3:2, 1:1.5@100 or 1:3@10-40), comma-separated for several"
)


@dataclass(frozen=True, slots=True, kw_only=True)
class Slowdown:
    """Make ``rank``'s compute ``factor`` times as long from step ``start`` on (until ``end``,
    exclusive, when given)."""

    rank: int
    factor: float
    start: int = 0
    end: int | None = None

    def __post_init__(self) -> None:
        if self.rank < 0:
            raise UsageError(f"slowdown rank must be >= 0, got {self.rank}")
        if not 1.0 <= self.factor <= MAX_FACTOR:
            raise UsageError(f"slowdown factor must be in [1, {MAX_FACTOR:g}], got {self.factor}")
        if self.start < 0:
            raise UsageError(f"slowdown start step must be >= 0, got {self.start}")
        if self.end is not None and self.end <= self.start:
            raise UsageError(f"slowdown end step {self.end} must be after its start {self.start}")

    def delay(self, rank: int, step: int, natural_compute: float) -> float:
        """Seconds to sleep: proportional to the rank's own measured compute, so the slowdown
        scales with the workload instead of adding a constant."""
        if rank != self.rank or step < self.start or (self.end is not None and step >= self.end):
            return 0.0
        return (self.factor - 1.0) * natural_compute


def parse_slow(spec: str | None) -> list[Slowdown]:
    if spec is None or not spec.strip():
        return []
    out = []
    for part in spec.split(","):
        head, _, when = part.strip().partition("@")
        rank, sep, factor = head.partition(":")
        start, dash, end = when.partition("-")
        try:
            if not sep or (dash and not (start and end)):
                raise ValueError
            out.append(
                Slowdown(
                    rank=int(rank),
                    factor=float(factor),
                    start=int(start) if start else 0,
                    end=int(end) if end else None,
                )
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


KILL_FORM = "RANK:STEP (e.g. 1:37), comma-separated for several"


@dataclass(frozen=True, slots=True, kw_only=True)
class Kill:
    """Kill ``rank`` with SIGKILL when it reaches ``step``, once per run directory."""

    rank: int
    step: int

    def __post_init__(self) -> None:
        if self.rank < 0 or self.step < 0:
            raise UsageError(f"--kill needs a rank and a step >= 0, got {self.rank}:{self.step}")


def parse_kill(spec: str | None) -> list[Kill]:
    if spec is None or not spec.strip():
        return []
    out = []
    for part in spec.split(","):
        rank, sep, step = part.strip().partition(":")
        try:
            if not sep:
                raise ValueError
            out.append(Kill(rank=int(rank), step=int(step)))
        except ValueError:
            raise UsageError(f"bad --kill value {part.strip()!r}; valid: {KILL_FORM}") from None
    if len({(k.rank, k.step) for k in out}) != len(out):
        raise UsageError(f"--kill lists the same rank and step twice: {spec!r}")
    return out


def maybe_kill(kills: list[Kill], rank: int, step: int, marker_dir: Path) -> None:
    """SIGKILL this process if a kill is due here and has not fired before.

    A marker file, written and synced before the signal, makes each kill fire once: after a
    restart resumes from an earlier checkpoint, the same step comes round again.
    """
    for k in kills:
        if k.rank != rank or k.step != step:
            continue
        marker = marker_dir / f"kill-rank{rank}-step{step}.json"
        if marker.exists():
            continue
        marker_dir.mkdir(parents=True, exist_ok=True)
        with open(marker, "w", encoding="utf-8") as fh:
            json.dump({"rank": rank, "step": step, "time": time.time()}, fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.kill(os.getpid(), signal.SIGKILL)
