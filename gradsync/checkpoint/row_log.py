"""A rank's step records (telemetry rows) in a log beside its checkpoints, for strategies that
gather none before the end of the run (parameter servers, hogwild).

Why: a checkpoint carries the step records not gathered yet, and under a barrier-free strategy
that was every row of the run, so a save every step cost time, bytes and memory in proportion
to the steps done (9.7 ms a save at step 3000 on ``async`` charlm). Here each save appends only
the rows new since the last one (88 bytes a step), and the checkpoint names the range of row
numbers it needs, ``[first, end)``, counted from the start of the run. While the run goes on a
log is only appended to, so every checkpoint in the directory keeps the rows it names; a gather
first lets every open log take the rows it takes (``RowLogs.before_gather``), and ``load()``
cuts the loaded directory's log at the checkpoint's ``end``. The log is never pruned and not
synced (a resume after a machine crash warns of rows lost). docs/checkpoints.md tells the rest.

File: ``DIR/telemetry/rank-R.rows``, a 24-byte header (magic, the first row's number, the
columns per row; little-endian) and the rows as little-endian float64.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

__all__ = ["RowLog", "RowLogError", "RowLogs", "log_path", "read_rows"]

MAGIC = b"gsrows1\n"
_HEADER = len(MAGIC) + 16
_ITEM = 8  # float64
LOG_DIR = "telemetry"


class RowLogError(Exception):
    """A log that does not hold the rows asked for (missing, cut short, another layout)."""


def log_path(directory: str | Path, rank: int) -> Path:
    return Path(directory) / LOG_DIR / f"rank-{rank}.rows"


class RowLog:
    """This rank's log in ``directory``, open for appending; rows numbered from ``start``.

    ``keep_to`` (a resume): keep the file's rows up to that row number and append after them;
    otherwise the log starts anew at ``start`` (a run that did not resume from this directory
    owns no earlier rows there)."""

    def __init__(
        self, directory: Path, rank: int, columns: int, start: int, keep_to: int | None = None
    ) -> None:
        self.directory = directory
        self.columns = columns
        self.path = log_path(directory, rank)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        # Closed with the object too: a Synchronizer dropped without close() leaks no descriptor.
        self._close = weakref.finalize(self, os.close, self._fd)
        try:
            if keep_to is not None and self._kept(keep_to):
                return
            self.restart(start)
        except BaseException:
            self._close()
            raise

    def _kept(self, keep_to: int) -> bool:
        """Whether the file's rows reach ``keep_to`` in this layout (then cut there)."""
        try:
            start, columns, rows = _read_header(self._fd)
        except RowLogError:
            return False
        if columns != self.columns or not start <= keep_to <= start + rows:
            return False
        self.start, self.end = start, keep_to
        os.ftruncate(self._fd, self._offset(keep_to))
        return True

    def restart(self, start: int) -> None:
        """An empty log whose first row is number ``start``."""
        os.ftruncate(self._fd, 0)
        header = MAGIC + start.to_bytes(8, "little") + self.columns.to_bytes(8, "little")
        os.pwrite(self._fd, header, 0)
        self.start = self.end = start

    def cover(self, first: int, end: int, rows_from: Callable[[int], torch.Tensor]) -> None:
        """Make the log hold rows ``[first, end)``: append the ones past its end, read from
        ``rows_from(n)`` (the rows numbered ``n`` on); start it anew at ``first`` when it does
        not reach ``first`` (rows gathered before they were logged) or starts after it."""
        if self.start > first or self.end < first:
            self.restart(first)
        if self.end > end:  # rows of a rolled-back attempt that load() did not cut: not ours
            os.ftruncate(self._fd, self._offset(end))
            self.end = end
        if self.end == end:
            return
        rows = rows_from(self.end)
        if rows.shape != (end - self.end, self.columns):
            raise RowLogError(
                f"expected rows {self.end} to {end} ({self.columns} columns), "
                f"got a tensor of shape {tuple(rows.shape)}"
            )
        data = np.ascontiguousarray(rows.numpy(), dtype="<f8").tobytes()
        written = os.pwrite(self._fd, data, self._offset(self.end))
        if written != len(data):
            raise OSError(f"{self.path}: wrote {written} of {len(data)} bytes")
        self.end = end

    def _offset(self, row: int) -> int:
        return _HEADER + (row - self.start) * self.columns * _ITEM

    def close(self) -> None:
        self._close()


class RowLogs:
    """A rank's open row logs, one per checkpoint directory (by its resolved path), all holding
    the same collector's rows; closed together."""

    def __init__(self, rank: int, columns: int) -> None:
        self.rank, self.columns = rank, columns
        self._logs: dict[str, RowLog] = {}
        self._resolved: dict[Path, str] = {}  # the paths as given, resolved once each

    def _key(self, directory: Path) -> str:
        key = self._resolved.get(directory)
        if key is None:
            key = self._resolved[directory] = os.path.realpath(directory)
        return key

    def cover(
        self, directory: Path, first: int, end: int, rows_from: Callable[[int], torch.Tensor]
    ) -> None:
        """``directory``'s log holds rows ``[first, end)`` (``RowLog.cover``); a directory this
        run has no log in yet gets a new one, starting at ``first``."""
        key = self._key(directory)
        log = self._logs.get(key)
        if log is None:
            log = self._logs[key] = RowLog(directory, self.rank, self.columns, start=first)
        log.cover(first, end, rows_from)

    def before_gather(self, first: int, end: int, rows_from: Callable[[int], torch.Tensor]) -> None:
        """Every open log takes the pending rows ``[first, end)`` before a gather takes them
        from the pending ones: no later save finds a gap, which would start its log anew and
        drop rows older checkpoints name."""
        for log in self._logs.values():
            log.cover(first, end, rows_from)

    def adopt(self, directory: Path, end: int) -> None:
        """After ``load()`` from ``directory``'s checkpoint, which named rows up to ``end``: its
        log cut there and kept open. The other logs close (a rollback may have left rows of
        the abandoned steps in them; a later save there starts that log anew)."""
        self.close()
        key = self._key(directory)
        self._logs[key] = RowLog(directory, self.rank, self.columns, start=end, keep_to=end)

    def close(self) -> None:
        logs, self._logs = list(self._logs.values()), {}
        for log in logs:
            log.close()


def read_rows(directory: str | Path, rank: int, first: int, end: int, columns: int) -> torch.Tensor:
    """Rows ``[first, end)`` of ``rank``'s log in ``directory``, as float64 ``(n, columns)``;
    ``RowLogError`` naming what is wrong when the log does not hold them all. A log of fewer
    columns (written before the last ones were added: the attempt) gives its rows with NaN in
    the columns it lacks."""
    path = log_path(directory, rank)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        raise RowLogError(f"{path} does not exist") from None
    try:
        start, have_columns, rows = _read_header(fd)
        if have_columns > columns:
            raise RowLogError(f"{path} holds rows of {have_columns} columns, not {columns}")
        if not start <= first <= end <= start + rows:
            raise RowLogError(f"{path} holds rows {start} to {start + rows}, not {first} to {end}")
        size = (end - first) * have_columns * _ITEM
        data = os.pread(fd, size, _HEADER + (first - start) * have_columns * _ITEM)
    finally:
        os.close(fd)
    if len(data) != size:
        raise RowLogError(f"{path}: read {len(data)} of {size} bytes")
    array = np.frombuffer(data, dtype="<f8").astype(np.float64).reshape(end - first, have_columns)
    if have_columns < columns:
        missing = np.full((end - first, columns - have_columns), np.nan)
        array = np.concatenate([array, missing], axis=1)
    return torch.from_numpy(array)


def _read_header(fd: int) -> tuple[int, int, int]:
    """(first row number, columns, whole rows) of an open log."""
    head = os.pread(fd, _HEADER, 0)
    if len(head) < _HEADER or not head.startswith(MAGIC):
        raise RowLogError("not a gradsync row log")
    start = int.from_bytes(head[len(MAGIC) : len(MAGIC) + 8], "little")
    columns = int.from_bytes(head[len(MAGIC) + 8 :], "little")
    if columns < 1:
        raise RowLogError(f"a row log of {columns} columns")
    body = os.fstat(fd).st_size - _HEADER
    return start, columns, body // (columns * _ITEM)  # a row cut short by a crash is not one
