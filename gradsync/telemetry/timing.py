"""Collecting step records from every rank without a collective on every step.

Each rank times its own steps locally. Every ``flush_every`` steps the pending records are
all-gathered in one small float64 tensor, behind the steps: the gather is posted
(``async_op``) and its result taken at the next one, so a rank waits for telemetry only when
it is more than ``flush_every`` steps ahead of another (the gather after step t needs every
rank's gather after step t - ``flush_every``). ``idle`` and ``comm`` are then derived for
each step from every rank's compute.
When the report is asked for (``flush``), the gather in flight and everything pending are
gathered at once. Strategies that must never make ranks wait for each other gather only at
the end.

Why behind: a blocking gather is a barrier. Under local SGD or DiLoCo, whose ranks meet only
every H steps, a gather every 10 steps made the faster rank wait for the slower one's drift
each time; on the emulated cluster (two hosts, charlm, no synchronization at all) a step
took 13.81 ms with it against 13.12 ms with telemetry off (medians of 3 rounds). The price:
records reach ``records`` and the sink (the balancer, ``on_records``) one gather later, at
the same step on every rank.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from itertools import chain
from typing import Any

import numpy as np
import torch
import torch.distributed as dist

from gradsync import exit_safety, runtime
from gradsync.telemetry.device_clock import StepMarks
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
    # which attempt of the run took the step: a record restored from a checkpoint and gathered
    # by a restarted attempt is the earlier attempt's (it was stamped with the gatherer's)
    "attempt",
)
_NO_LOSS = float("nan")
#: float64 values per pending record row (``pending_rows``, ``rows_from``)
ROW_COLUMNS = len(_COLUMNS)
#: the rows of checkpoints written before the ``attempt`` column (``restore_pending`` reads them:
#: their records are then the loading attempt's, as they were before)
LEGACY_ROW_COLUMNS = ROW_COLUMNS - 1


@dataclass(slots=True)
class _Pending:
    step: int
    time: float
    compute: float
    sync: float
    samples: int
    bytes: int
    loss: torch.Tensor | float | None
    #: a tensor where the verdict stayed on the device: read with the loss, at the gather
    skipped: bool | torch.Tensor
    barrier: bool
    idle: float
    #: device events to read ``compute`` and ``sync`` from (CUDA), or None (host-timed)
    marks: StepMarks | None = None
    #: the attempt of the run that took the step (``_attempt``; a restored row keeps its own)
    attempt: int = 0
    #: its row (``_rows``), made once: a checkpoint every step takes every pending record's
    #: row at each save, and converting the loss (a tensor) was most of that
    row: list[float] | None = None

    def read_marks(self) -> None:
        """``compute`` and ``sync`` from the device events, which are then let go."""
        if self.marks is not None:
            (self.compute, self.sync), self.marks = self.marks.times(), None


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
        #: the gather posted by ``flush_behind`` and not taken yet
        self._in_flight: _InFlight | None = None
        #: pending records before this one have no device events left to read
        self._unread = 0
        #: the number of the first pending record among this rank's records (counted from
        #: the start, or from the checkpoint restored): a checkpoint's row log names rows by it
        self._first = 0
        #: called with ``(first, end, rows_from)`` before a gather takes the pending records
        #: ``[first, end)`` (a row log keeps them: ``gradsync.checkpoint.row_log``)
        self.before_gather: Callable[[int, int, Callable[[int], torch.Tensor]], None] | None = None

    def add(
        self,
        step: int,
        time: float,
        compute: float,
        sync: float,
        samples: int,
        nbytes: int,
        loss: torch.Tensor | float | None,
        skipped: bool | torch.Tensor = False,
        barrier: bool = True,
        idle: float = 0.0,
        marks: StepMarks | None = None,
    ) -> None:
        """``idle`` is used only for steps without a barrier (the strategy measured it).
        ``marks``: the step's device events, which replace ``compute`` and ``sync`` once read
        (gradsync.telemetry.device_clock). ``skipped`` may be a 0-d tensor (1.0: skipped),
        the verdict a fused optimizer took on the device: read, like a tensor loss, when the
        rows are made."""
        if isinstance(loss, torch.Tensor):
            loss = loss.detach()  # converted at flush, so a GPU loss costs no sync per step
        self._read_completed_marks()
        self._pending.append(
            _Pending(
                step,
                time,
                compute,
                sync,
                samples,
                nbytes,
                loss,
                skipped,
                barrier,
                idle,
                marks,
                runtime.restart_count(),
            )
        )

    def _read_completed_marks(self) -> None:
        """Turn the device events of earlier records into times once they have completed,
        oldest first, without waiting: strategies that gather only at the end would otherwise
        hold three events for every step of the run."""
        while self._unread < len(self._pending):
            p = self._pending[self._unread]
            if p.marks is not None and not p.marks.done():
                return
            p.read_marks()
            self._unread += 1

    def due(self) -> bool:
        return len(self._pending) >= self.flush_every

    def pending_rows(self) -> torch.Tensor:
        """The records not gathered yet, one float64 row each; those of a gather still in
        flight come first. A checkpoint carries the same numbers as ``pending_flat_rows``
        (and carried this tensor before: ``restore_pending`` takes either)."""
        local = self._local_rows()
        if self._in_flight is None:
            return local
        return torch.cat([self._in_flight.local, local])

    def pending_flat_rows(self) -> list[float]:
        """``pending_rows`` as one flat list of floats, row after row: what a checkpoint
        carries. Plain numbers go into its header as they are; a tensor of a new shape at
        every save cost the snapshot a fresh buffer, its views and a copy."""
        rows = chain.from_iterable(map(_row, self._pending))
        flight = self._in_flight
        if flight is None:
            return list(rows)
        if flight.local_rows is None:
            flight.local_rows = flight.local.reshape(-1).tolist()
        return [*flight.local_rows, *rows]

    def pending_range(self) -> tuple[int, int]:
        """The numbers of the first pending record and of the one after the last (records
        counted on this rank from the start, or from the checkpoint restored)."""
        return self._first, self._first + len(self._pending)

    def rows_from(self, number: int) -> torch.Tensor:
        """The rows of the pending records numbered ``number`` on (``pending_range``)."""
        if not self._first <= number <= self._first + len(self._pending):
            raise ValueError(f"record {number} is not pending (pending: {self.pending_range()})")
        return _rows(self._pending[number - self._first :])

    def _local_rows(self) -> torch.Tensor:
        return _rows(self._pending)

    def rolled_back_to(self, step: int) -> None:
        """After a ``load()`` that resumes at ``step`` (its restored records gathered): the
        records of ``step`` and later go, as those steps run again, and of a step recorded
        twice the newest stays (a load in the same process restores records an earlier gather
        took, or a second load those of the first)."""
        seen: set[tuple[int, int]] = set()
        kept = []
        for r in reversed(self.records):
            key = (r.rank, r.step)
            if r.step < step and key not in seen:
                seen.add(key)
                kept.append(r)
        kept.reverse()
        self.records = kept

    def _taken(self) -> None:
        """Every pending record was taken by a gather (``before_gather`` saw them first)."""
        if self.before_gather is not None and self._pending:
            self.before_gather(*self.pending_range(), self.rows_from)
        self._first += len(self._pending)
        self._pending, self._unread = [], 0

    def restore_pending(
        self,
        rows: torch.Tensor | list[float],
        first: int | None = None,
        columns: int = ROW_COLUMNS,
    ) -> None:
        """Put back the rows ``pending_rows`` (or ``pending_flat_rows``) returned, ahead of
        anything recorded since; ``first``: the number of the first of them
        (``pending_range``), where it is known. ``columns``: the values per row, fewer in a
        checkpoint written before a column was added (``LEGACY_ROW_COLUMNS``). Each record
        keeps the attempt that took its step; one of a row without it is this attempt's."""
        rows = torch.as_tensor(rows, dtype=torch.float64)
        restored = [
            _Pending(
                int(r[0]), r[1], r[2], r[3], int(r[4]), int(r[5]),
                None if r[6] != r[6] else r[6], bool(r[7]), bool(r[8]), r[9],
                attempt=_row_attempt(r),
            )
            for r in rows.reshape(-1, columns).tolist()
        ]  # fmt: skip
        self._pending[:0] = restored
        self._unread = 0
        if first is not None:
            self._first = first

    def flush(self, step: int | None = None) -> list[StepRecord]:
        """Collective: every rank of the group must call it. Returns the new complete records
        (those of a gather in flight included). ``step`` places the gather for the timeout
        diagnosis (None: at the latest wait's)."""
        new = self._take_in_flight(step)
        local = self._local_rows()
        self._taken()
        what = f"telemetry gather ({local.shape[0]} pending step record(s) on this rank)"
        gathered = self._watched(step, what, lambda: self._gather(local))
        return new + self._add([block.tolist() for block in gathered])

    def flush_behind(self, step: int) -> list[StepRecord]:
        """Collective, the periodic gather (every rank calls it after the same step): take the
        result of the gather posted last time, and post one of the records pending now without
        waiting for it. Returns the records taken. Falls back to ``flush`` where the pending
        rows may differ in number between ranks (more than ``flush_every``: restored from a
        checkpoint) or there is no peer."""
        if runtime.world_size(self.group) == 1 or len(self._pending) > self.flush_every:
            return self.flush(step)
        new = self._take_in_flight(step)
        # A fixed shape on every rank (one collective, no count to agree on first): the rows,
        # then padding whose step is -1, made in one array.
        rows = _rows_array(self._pending, self.flush_every)
        local = torch.from_numpy(rows[: len(self._pending)])
        self._taken()
        padded = torch.from_numpy(rows).to(runtime.device())
        blocks = [torch.empty_like(padded) for _ in range(runtime.world_size(self.group))]
        work = dist.all_gather(blocks, padded, group=self.group, async_op=True)
        self._in_flight = _InFlight(step, local, padded, blocks, work)
        return new

    def _take_in_flight(self, step: int | None) -> list[StepRecord]:
        flight, self._in_flight = self._in_flight, None
        if flight is None:
            return []
        what = f"telemetry gather posted after step {flight.step}"
        blocks = self._watched(step, what, lambda: _wait(flight))
        return self._add([[row for row in block if row[0] >= 0] for block in blocks])

    def hold_in_flight(self) -> None:
        """Closing without a final ``flush``: keep a gather still in flight (its tensors, its
        Work) referenced until the process exits, so that no backend thread frees them while
        the interpreter shuts down (see ``gradsync.exit_safety``)."""
        if self._in_flight is not None:
            exit_safety.keep("telemetry gather in flight", self._in_flight)
            self._in_flight = None

    def _watched(self, step: int | None, what: str, fn: Callable[[], Any]) -> Any:
        if self.watch is None:
            return fn()
        return self.watch.run(step, what, fn)

    def _add(self, gathered: list[list[list[float]]]) -> list[StepRecord]:
        """Records from each rank's gathered rows (in rank order), appended and passed on."""
        new = [_record(rank, row) for rank, block in enumerate(gathered) for row in block]
        new = fill_idle(new, self._since_barrier)
        self.records.extend(new)
        if self.sink is not None and new:
            self.sink(new)
        return new

    def take_own_pending(self, rank: int) -> list[StepRecord]:
        """This rank's records not gathered (a gather in flight's included), as records of
        ``rank``, taken off the collector: no collective, for a Synchronizer closed without
        ``report()``. Their ``idle`` is what the strategy measured (0 at a barrier step: the
        other ranks' compute, which the barrier's idle is made of, is not here), until
        ``records.read_records`` derives it from every rank's (``gathered`` False)."""
        rows = self.pending_rows().tolist()
        self._pending, self._unread = [], 0
        self.hold_in_flight()
        records = [_record(rank, row) for row in rows]
        for record in records:
            record.gathered = False
        return records

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


@dataclass(slots=True)
class _InFlight:
    """A gather posted by ``flush_behind``: what it sends (kept alive until it is taken) and
    where it receives."""

    step: int
    local: torch.Tensor
    padded: torch.Tensor
    blocks: list[torch.Tensor]
    work: Any
    #: ``local`` as a flat list (``pending_flat_rows``), made once
    local_rows: list[float] | None = None


def _wait(flight: _InFlight) -> list[list[list[float]]]:
    """Each rank's gathered rows, padding included."""
    flight.work.wait()
    return [b.tolist() for b in flight.blocks]


def _record(rank: int, row: list[float]) -> StepRecord:
    """``rank``'s record from its row (``_COLUMNS``); ``comm`` is ``fill_idle``'s to set. Its
    ``attempt`` is the row's: the attempt that took the step, also for a record a restarted
    attempt restored from a checkpoint and gathers (it was this process's before, so the steps
    a killed attempt ran were labelled with the restart's number)."""
    return StepRecord(
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
        attempt=_row_attempt(row),
    )


def _row_attempt(row: list[float]) -> int:
    """The attempt a row names (``_COLUMNS``); this process's for a row without one."""
    if len(row) > ROW_COLUMNS - 1 and row[ROW_COLUMNS - 1] == row[ROW_COLUMNS - 1]:
        return max(0, int(row[ROW_COLUMNS - 1]))
    return runtime.restart_count()


def _rows(pending: list[_Pending]) -> torch.Tensor:
    """One float64 row per record (``_COLUMNS``), its device events read first."""
    return torch.from_numpy(_rows_array(pending))


def _rows_array(pending: list[_Pending], length: int | None = None) -> np.ndarray:
    """``_rows`` as an array of ``length`` rows (default: one per record), those past the
    records filled with -1 (the padding of a periodic gather: its step is -1). Through numpy:
    torch.tensor of a list of lists took about twice as long."""
    _read_tensors([p for p in pending if p.row is None])
    out = np.full((len(pending) if length is None else length, len(_COLUMNS)), -1.0)
    if pending:
        out[: len(pending)] = list(map(_row, pending))
    return out


def _read_tensors(pending: list[_Pending]) -> None:
    """The losses and verdicts still held as tensors, read into floats in one copy to the
    host, where one float() each would wait for the device once per record."""
    held = [
        (p, name)
        for p in pending
        for name in ("loss", "skipped")
        if isinstance(getattr(p, name), torch.Tensor) and getattr(p, name).numel() == 1
    ]
    if len(held) < 2:
        return
    try:
        values = torch.stack(
            [getattr(p, name).reshape(()).to(torch.float64) for p, name in held]
        ).tolist()
    except RuntimeError:  # tensors on several devices: float() each, in _row
        return
    for (p, name), value in zip(held, values, strict=True):
        setattr(p, name, value if name == "loss" else value != 0)


def _row(p: _Pending) -> list[float]:
    """``p``'s row, made once (``_Pending.row``)."""
    if p.row is not None:
        return p.row
    p.read_marks()
    p.row = [
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
        float(p.attempt),
    ]
    return p.row
