"""Collecting step records from every rank without a collective on every step.

Each rank times its own steps locally. Every ``flush_every`` steps (and when the report is
asked for) the pending records are all-gathered in one small float64 tensor; ``idle`` and
``comm`` are then derived for each step from every rank's compute. One tiny collective every
few steps stays off the critical path of the others; strategies that must never make ranks wait
for each other gather only at the end.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from gradsync import runtime
from gradsync.telemetry.records import StepRecord, fill_idle

# Columns of the gathered tensor, in order.
_COLUMNS = (
    "step",
    "time",
    "compute",
    "sync",
    "samples",
    "bytes",
    "loss",
    "skipped",
    "barrier",
    "idle",
)
_NO_LOSS = float("nan")


@dataclass(slots=True)
class _Pending:
    step: int
    time: float
    compute: float
    sync: float
    samples: int
    bytes: int
    loss: torch.Tensor | float | None
    skipped: bool
    barrier: bool
    idle: float


class TelemetryCollector:
    def __init__(
        self,
        group: dist.ProcessGroup | None,
        flush_every: int = 10,
        sink: Callable[[list[StepRecord]], None] | None = None,
        watch: Any = None,
    ) -> None:
        """``watch`` (an ``ArrivalWatch``) diagnoses a gather that times out."""
        self.group = group
        self.watch = watch
        self.flush_every = flush_every
        self.sink = sink
        self.records: list[StepRecord] = []
        self._pending: list[_Pending] = []
        self._since_barrier: dict[int, float] = {}

    def add(
        self,
        step: int,
        time: float,
        compute: float,
        sync: float,
        samples: int,
        nbytes: int,
        loss: torch.Tensor | float | None,
        skipped: bool = False,
        barrier: bool = True,
        idle: float = 0.0,
    ) -> None:
        """``idle`` is used only for steps without a barrier (the strategy measured it)."""
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()  # converted at flush, so a GPU loss costs no sync per step
        self._pending.append(
            _Pending(step, time, compute, sync, samples, nbytes, loss, skipped, barrier, idle)
        )

    def due(self) -> bool:
        return len(self._pending) >= self.flush_every

    def pending_rows(self) -> torch.Tensor:
        """The records not gathered yet, one float64 row each (a checkpoint carries them, so
        the steps before it keep their records when a restart rolls back to it)."""
        rows = [
            [
                float(p.step),
                p.time,
                p.compute,
                p.sync,
                float(p.samples),
                float(p.bytes),
                _NO_LOSS if p.loss is None else float(p.loss),
                float(p.skipped),
                float(p.barrier),
                p.idle,
            ]
            for p in self._pending
        ]
        return torch.tensor(rows, dtype=torch.float64).reshape(-1, len(_COLUMNS))

    def restore_pending(self, rows: torch.Tensor) -> None:
        """Put back the rows ``pending_rows`` returned, ahead of anything recorded since."""
        restored = [
            _Pending(
                int(r[0]), r[1], r[2], r[3], int(r[4]), int(r[5]),
                None if r[6] != r[6] else r[6], bool(r[7]), bool(r[8]), r[9],
            )
            for r in rows.reshape(-1, len(_COLUMNS)).tolist()
        ]  # fmt: skip
        self._pending[:0] = restored

    def flush(self, step: int | None = None) -> list[StepRecord]:
        """Collective: every rank of the group must call it. Returns the new complete records.
        ``step`` places the gather for the timeout diagnosis (None: at the latest wait's)."""
        local = self.pending_rows()
        self._pending = []
        if self.watch is not None:
            what = f"telemetry gather ({local.shape[0]} pending step record(s) on this rank)"
            gathered = self.watch.run(step, what, lambda: self._gather(local))
        else:
            gathered = self._gather(local)
        new = [
            StepRecord(
                rank=rank,
                step=int(row[0]),
                time=row[1],
                compute=row[2],
                sync=row[3],
                idle=row[9],
                comm=0.0,
                samples=int(row[4]),
                bytes=int(row[5]),
                loss=None if row[6] != row[6] else row[6],
                skipped=bool(row[7]),
                barrier=bool(row[8]),
            )
            for rank, block in enumerate(gathered)
            for row in block.tolist()
        ]
        new = fill_idle(new, self._since_barrier)
        self.records.extend(new)
        if self.sink is not None and new:
            self.sink(new)
        return new

    def _gather(self, local: torch.Tensor) -> list[torch.Tensor]:
        world = runtime.world_size(self.group)
        if world == 1:
            return [local]
        dev = runtime.device()
        # Ranks may hold different numbers of pending rows (asynchronous strategies): agree
        # on the longest, pad, and cut each rank's block back to its own length.
        n = torch.tensor([local.shape[0]], dtype=torch.int64, device=dev)
        counts = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(counts, n, group=self.group)
        longest = int(max(int(c.item()) for c in counts))
        padded = torch.zeros(longest, len(_COLUMNS), dtype=torch.float64, device=dev)
        padded[: local.shape[0]] = local.to(dev)
        blocks = [torch.empty_like(padded) for _ in range(world)]
        dist.all_gather(blocks, padded, group=self.group)
        return [b[: int(c.item())].cpu() for b, c in zip(blocks, counts, strict=True)]
