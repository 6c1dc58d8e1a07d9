"""The row log of barrier-free strategies' step records (``gradsync.checkpoint.row_log``): a save
appends only the new rows, a load reads a range back and cuts the log there, and a log that
lacks rows says which."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradsync.checkpoint.row_log import RowLog, RowLogError, log_path, read_rows

pytestmark = pytest.mark.unit

COLUMNS = 3


def _rows(first: int, end: int) -> torch.Tensor:
    """Rows whose first value is their number: easy to tell apart."""
    numbers = torch.arange(first, end, dtype=torch.float64)
    return torch.stack([numbers, numbers * 0.5, -numbers], dim=1)


class _Source:
    """What a collector hands to ``cover``: the rows numbered ``n`` on, of those up to ``end``,
    counting how many it was asked for."""

    def __init__(self, end: int) -> None:
        self.end, self.asked = end, 0

    def __call__(self, number: int) -> torch.Tensor:
        rows = _rows(number, self.end)
        self.asked += rows.shape[0]
        return rows


def test_each_save_appends_only_the_new_rows_and_a_range_reads_back(tmp_path: Path) -> None:
    log = RowLog(tmp_path, 1, COLUMNS, start=0)
    asked = 0
    for end in (1, 2, 5, 5, 9):
        source = _Source(end)
        log.cover(0, end, source)
        asked += source.asked
    log.close()
    assert asked == 9  # each row converted once, not all of them at every save
    size = log_path(tmp_path, 1).stat().st_size
    assert size == 24 + 9 * COLUMNS * 8
    assert torch.equal(read_rows(tmp_path, 1, 0, 9, COLUMNS), _rows(0, 9))
    assert torch.equal(read_rows(tmp_path, 1, 4, 7, COLUMNS), _rows(4, 7))


def test_a_resume_cuts_the_rolled_back_rows_and_appends_after_them(tmp_path: Path) -> None:
    first = RowLog(tmp_path, 0, COLUMNS, start=0)
    first.cover(0, 12, _Source(12))  # the attempt that ran to step 12, then died
    first.close()
    resumed = RowLog(tmp_path, 0, COLUMNS, start=7, keep_to=7)  # its checkpoint named 0..7
    # Steps 7.. run again: their new rows (told apart by a sign) replace the old ones.
    resumed.cover(0, 10, lambda n: -_rows(n, 10))
    resumed.close()
    back = read_rows(tmp_path, 0, 0, 10, COLUMNS)
    assert torch.equal(back[:7], _rows(0, 7)) and torch.equal(back[7:], -_rows(7, 10))
    with pytest.raises(RowLogError, match="holds rows 0 to 10, not 0 to 12"):
        read_rows(tmp_path, 0, 0, 12, COLUMNS)


def test_a_fresh_run_into_the_directory_starts_the_log_anew(tmp_path: Path) -> None:
    old = RowLog(tmp_path, 0, COLUMNS, start=0)
    old.cover(0, 20, _Source(20))
    old.close()
    fresh = RowLog(tmp_path, 0, COLUMNS, start=0)  # no resume: the rows there are not its own
    fresh.cover(0, 3, lambda n: -_rows(n, 3))
    fresh.close()
    assert torch.equal(read_rows(tmp_path, 0, 0, 3, COLUMNS), -_rows(0, 3))
    with pytest.raises(RowLogError, match="holds rows 0 to 3"):
        read_rows(tmp_path, 0, 0, 4, COLUMNS)


def test_rows_gathered_before_they_were_logged_start_the_log_at_the_first_pending(
    tmp_path: Path,
) -> None:
    log = RowLog(tmp_path, 0, COLUMNS, start=0)
    log.cover(0, 4, _Source(4))
    # Rows 0..9 were taken by a gather that the log did not see (the Synchronizer has its
    # logs take the rows before a gather; this is the fallback): pending now starts at 10.
    log.cover(10, 13, _Source(13))
    log.close()
    assert torch.equal(read_rows(tmp_path, 0, 10, 13, COLUMNS), _rows(10, 13))
    with pytest.raises(RowLogError, match="holds rows 10 to 13, not 0 to 4"):
        read_rows(tmp_path, 0, 0, 4, COLUMNS)


def test_a_row_cut_short_by_a_crash_is_not_read_and_a_resume_before_it_keeps_the_rest(
    tmp_path: Path,
) -> None:
    log = RowLog(tmp_path, 0, COLUMNS, start=0)
    log.cover(0, 5, _Source(5))
    log.close()
    path = log_path(tmp_path, 0)
    with open(path, "ab") as f:
        f.write(b"\0" * 10)  # part of a sixth row
    with pytest.raises(RowLogError, match="holds rows 0 to 5, not 0 to 6"):
        read_rows(tmp_path, 0, 0, 6, COLUMNS)
    RowLog(tmp_path, 0, COLUMNS, start=5, keep_to=5).close()
    assert path.stat().st_size == 24 + 5 * COLUMNS * 8
    assert torch.equal(read_rows(tmp_path, 0, 0, 5, COLUMNS), _rows(0, 5))


@pytest.mark.parametrize(
    ("damage", "why"),
    [
        ("missing", "does not exist"),
        ("not_a_log", "not a gradsync row log"),
        ("columns", "holds rows of 4 columns, not 3"),
    ],
)
def test_a_log_that_cannot_give_the_rows_says_why(tmp_path: Path, damage: str, why: str) -> None:
    if damage == "not_a_log":
        log_path(tmp_path, 0).parent.mkdir(parents=True)
        log_path(tmp_path, 0).write_bytes(b"something else entirely, 32 bytes")
    elif damage == "columns":
        log = RowLog(tmp_path, 0, COLUMNS + 1, start=0)
        log.cover(0, 2, lambda n: torch.zeros(2 - n, COLUMNS + 1, dtype=torch.float64))
        log.close()
    with pytest.raises(RowLogError, match=why):
        read_rows(tmp_path, 0, 0, 2, COLUMNS)


def test_rows_of_another_shape_than_the_range_are_refused(tmp_path: Path) -> None:
    log = RowLog(tmp_path, 0, COLUMNS, start=0)
    try:
        with pytest.raises(RowLogError, match=r"expected rows 0 to 3 \(3 columns\)"):
            log.cover(0, 3, lambda n: _rows(n, 2))
    finally:
        log.close()


@pytest.mark.usefixtures("one_rank")
def test_the_collector_numbers_its_records_across_gathers_and_a_restore() -> None:
    from gradsync.telemetry.timing import ROW_COLUMNS, TelemetryCollector

    collector = TelemetryCollector(None, flush_every=100)

    def add(step: int) -> None:
        collector.add(step, 0.0, 0.01, 0.0, 4, 8, None)

    for step in range(3):
        add(step)
    assert collector.pending_range() == (0, 3)
    assert collector.rows_from(1)[:, 0].tolist() == [1.0, 2.0]
    collector.flush()  # a gather takes them: the numbering goes on
    add(3)
    add(4)
    assert collector.pending_range() == (3, 5)
    assert collector.rows_from(4)[:, 0].tolist() == [4.0]
    with pytest.raises(ValueError, match="record 1 is not pending"):
        collector.rows_from(1)
    restored = TelemetryCollector(None, flush_every=100)
    restored.restore_pending(collector.rows_from(3), first=3)
    assert restored.pending_range() == (3, 5)
    assert restored.rows_from(3).shape == (2, ROW_COLUMNS)
