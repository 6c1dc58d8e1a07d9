"""``RunReport``: per-rank totals and the barrier tax, aggregated from step records."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from gradsync.telemetry.membership import counted
from gradsync.telemetry.records import StepRecord


@dataclass(slots=True)
class RankTotals:
    rank: int
    steps: int
    compute: float
    sync: float
    idle: float
    comm: float
    samples: int
    bytes: int

    @property
    def wall(self) -> float:
        return self.compute + self.sync

    def share(self, name: str) -> float:
        wall = self.wall
        return float(getattr(self, name)) / wall if wall > 0 else 0.0


@dataclass(slots=True)
class RunReport:
    """What a run cost, per rank, in the telemetry vocabulary (docs/observability.md).

    ``barrier_tax`` = sum of idle / sum of wall (wall = compute + sync) over all ranks and steps.
    ``pace_setter_counts[r]`` = steps at which rank r had the largest compute (set the barrier).
    """

    ranks: list[RankTotals]
    steps: int
    barrier_tax: float
    pace_setter_counts: dict[int, int]
    final_loss: float | None = None
    skipped_steps: int = 0
    records: list[StepRecord] = field(default_factory=list, repr=False)

    @classmethod
    def from_records(cls, records: Iterable[StepRecord]) -> RunReport:
        recs = sorted(records, key=lambda r: (r.step, r.rank))
        by_rank: dict[int, RankTotals] = {}
        slowest: dict[int, tuple[float, int]] = {}
        for r in recs:
            t = by_rank.setdefault(r.rank, RankTotals(r.rank, 0, 0.0, 0.0, 0.0, 0.0, 0, 0))
            t.steps += 1
            t.compute += r.compute
            t.sync += r.sync
            t.idle += r.idle
            t.comm += r.comm
            t.samples += r.samples
            t.bytes += r.bytes
            best = slowest.get(r.step)
            if best is None or r.compute > best[0]:
                slowest[r.step] = (r.compute, r.rank)
        totals = [by_rank[k] for k in sorted(by_rank)]
        wall = sum(t.wall for t in totals)
        idle = sum(t.idle for t in totals)
        pace = Counter(rank for _, rank in slowest.values())
        last_step = max(slowest) if slowest else -1
        losses = [r.loss for r in recs if r.step == last_step and r.loss is not None]
        skipped = len({r.step for r in recs if r.skipped})
        return cls(
            ranks=totals,
            steps=len(slowest),
            barrier_tax=idle / wall if wall > 0 else 0.0,
            pace_setter_counts=dict(sorted(pace.items())),
            final_loss=sum(losses) / len(losses) if losses else None,
            skipped_steps=skipped,
            records=recs,
        )

    @property
    def pace_setter(self) -> int | None:
        """The rank that had the slowest compute most often (ties: lowest rank)."""
        if not self.pace_setter_counts:
            return None
        return max(sorted(self.pace_setter_counts), key=lambda r: self.pace_setter_counts[r])

    def to_dict(self) -> dict[str, Any]:
        return {
            "steps": self.steps,
            "barrier_tax": self.barrier_tax,
            "pace_setter": self.pace_setter,
            "pace_setter_counts": {str(k): v for k, v in self.pace_setter_counts.items()},
            "final_loss": self.final_loss,
            "skipped_steps": self.skipped_steps,
            "ranks": [
                {
                    **asdict(t),
                    "wall": t.wall,
                    "compute_share": t.share("compute"),
                    "comm_share": t.share("comm"),
                    "idle_share": t.share("idle"),
                }
                for t in self.ranks
            ],
        }

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_dict(), indent=2) + "\n", encoding="utf-8")

    def _idle_line(self) -> str:
        """The barrier tax, or, in a run where no step met at a barrier (a parameter server,
        hogwild, gossip), what its idle is: the replies the staleness bound held back (README,
        "Telemetry for the dial"; never under ``async``), or a gossip partner's wait for its
        pair (docs/gossip.md)."""
        if not self.records or any(r.barrier for r in self.records):
            return f"barrier tax: {self.barrier_tax:.1%} of wall time spent idle at barriers"
        if self.barrier_tax == 0:
            return "barrier tax: none (no step waits at a barrier in this run)"
        return (
            f"no barrier in this run; idle: {self.barrier_tax:.1%} of wall time spent waiting "
            "for other ranks (replies a parameter server held back for the staleness bound, "
            "or a gossip partner)"
        )

    def format(self) -> str:
        """The per-rank table users read at the end of a run."""
        head = f"{'rank':>4}  {'compute s':>10} {'comm s':>9} {'idle s':>9}  "
        head += f"{'compute':>8} {'comm':>6} {'idle':>6}  {'MB sent':>9}"
        lines = [head, "-" * len(head)]
        for t in self.ranks:
            lines.append(
                f"{t.rank:>4}  {t.compute:>10.3f} {t.comm:>9.3f} {t.idle:>9.3f}  "
                f"{t.share('compute'):>8.1%} {t.share('comm'):>6.1%} {t.share('idle'):>6.1%}  "
                f"{t.bytes / 1e6:>9.2f}"
            )
        lines.append(self._idle_line())
        pace = self.pace_setter
        if pace is not None and self.steps:
            slowest = (
                f"rank {pace} was the slowest in "
                f"{self.pace_setter_counts[pace]} of {counted(self.steps, 'step')}"
            )
            if any(r.barrier for r in self.records):
                lines.append(f"pace-setter: {slowest}")
            else:  # a parameter server, hogwild, gossip: no rank waits for every other
                lines.append(f"slowest rank: {slowest} (no step meets at a barrier in this run)")
        if self.skipped_steps:
            lines.append(f"skipped steps (non-finite gradients): {self.skipped_steps}")
        if self.final_loss is not None:
            lines.append(f"final loss: {self.final_loss:.4f}")
        return "\n".join(lines)
