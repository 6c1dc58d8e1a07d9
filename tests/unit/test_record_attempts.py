"""Each step record names the attempt that took its step (``StepRecord.attempt``), also one a
restarted attempt restored from a checkpoint and gathered: those were labelled with the
restart's number (steps 0-11 of a run killed at step 12 read ``"attempt": 1``)."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from gradsync.checkpoint.row_log import RowLog, read_rows
from gradsync.processes.elastic_env import RESTART_COUNT_ENV
from gradsync.telemetry.timing import (
    LEGACY_ROW_COLUMNS,
    ROW_COLUMNS,
    TelemetryCollector,
)

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _attempt_0_rows(monkeypatch: pytest.MonkeyPatch) -> torch.Tensor:
    monkeypatch.setenv(RESTART_COUNT_ENV, "0")
    killed = TelemetryCollector(None, flush_every=10)
    for step in range(3):  # taken by attempt 0, not gathered before the kill
        killed.add(step, 100.0 + step, 0.5, 0.25, 8, 0, 1.0)
    return killed.pending_rows()


@pytest.mark.parametrize("form", ["flat list", "tensor"])
def test_restored_records_keep_the_attempt_that_took_them(
    monkeypatch: pytest.MonkeyPatch, form: str
) -> None:
    rows = _attempt_0_rows(monkeypatch)
    monkeypatch.setenv(RESTART_COUNT_ENV, "1")  # the restart loads the checkpoint
    restarted = TelemetryCollector(None, flush_every=10)
    restarted.restore_pending(rows.reshape(-1).tolist() if form == "flat list" else rows)
    restarted.add(3, 200.0, 0.5, 0.25, 8, 0, 1.0)
    records = restarted.flush()
    assert [(r.step, r.attempt) for r in records] == [(0, 0), (1, 0), (2, 0), (3, 1)]
    # and so does a record a rank writes alone (no gather: take_own_pending)
    restarted.restore_pending(rows)
    assert [r.attempt for r in restarted.take_own_pending(0)] == [0, 0, 0]


def test_a_checkpoint_of_rows_without_the_attempt_gives_the_loading_attempt_s(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A checkpoint written before the attempt column: its records are the loading attempt's,
    as they all were before (nothing says otherwise)."""
    rows = _attempt_0_rows(monkeypatch)[:, :LEGACY_ROW_COLUMNS]
    monkeypatch.setenv(RESTART_COUNT_ENV, "2")
    restarted = TelemetryCollector(None, flush_every=10)
    restarted.restore_pending(rows.reshape(-1).tolist(), columns=LEGACY_ROW_COLUMNS)
    records = restarted.flush()
    assert [(r.step, r.attempt) for r in records] == [(0, 2), (1, 2), (2, 2)]


def test_a_row_log_of_fewer_columns_reads_with_the_attempt_unknown(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rows = _attempt_0_rows(monkeypatch)
    legacy = RowLog(tmp_path, 0, LEGACY_ROW_COLUMNS, start=0)
    legacy.cover(0, 3, lambda n: rows[n:, :LEGACY_ROW_COLUMNS])
    legacy.close()
    got = read_rows(tmp_path, 0, 1, 3, ROW_COLUMNS)
    assert got.shape == (2, ROW_COLUMNS)
    assert torch.equal(got[:, :LEGACY_ROW_COLUMNS], rows[1:3, :LEGACY_ROW_COLUMNS])
    assert all(math.isnan(x) for x in got[:, -1].tolist())
