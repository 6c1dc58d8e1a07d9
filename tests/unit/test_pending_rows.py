"""The step records a checkpoint carries (``TelemetryCollector.pending_flat_rows``): the same
numbers as ``pending_rows``, in a flat list of floats, and put back alike from either form
(checkpoints written before carried a tensor)."""

from __future__ import annotations

import math

import pytest
import torch

from gradsync.telemetry.timing import ROW_COLUMNS, TelemetryCollector

pytestmark = [pytest.mark.unit, pytest.mark.timeout(30)]


def _collector() -> TelemetryCollector:
    collector = TelemetryCollector(None, flush_every=10)
    collector.add(0, 100.0, 0.5, 0.25, 8, 4096, torch.tensor(2.5), barrier=True)
    collector.add(1, 100.1, -0.0, 0.125, 8, 0, None, skipped=True, idle=0.01)
    return collector


def test_flat_rows_are_the_rows_row_after_row() -> None:
    collector = _collector()
    flat = collector.pending_flat_rows()
    want = collector.pending_rows().reshape(-1).tolist()
    assert len(flat) == 2 * ROW_COLUMNS and all(type(x) is float for x in flat)
    assert [repr(x) for x in flat] == [repr(x) for x in want]  # nan and -0.0 kept
    assert math.isnan(flat[ROW_COLUMNS + 6])  # no loss


@pytest.mark.parametrize("form", ["flat list", "tensor"])
def test_rows_put_back_from_either_form_give_the_same_records(form: str) -> None:
    saved = _collector()
    rows = saved.pending_flat_rows() if form == "flat list" else saved.pending_rows()
    restored = TelemetryCollector(None, flush_every=10)
    restored.add(2, 100.2, 0.5, 0.25, 8, 0, 1.0)
    restored.restore_pending(rows, first=0)
    got = restored.pending_rows()
    assert got.shape == (3, ROW_COLUMNS)
    assert torch.equal(got[:2].nan_to_num(-1.0), saved.pending_rows().nan_to_num(-1.0))
    assert got[2, 0].item() == 2.0  # recorded since, after the restored ones
