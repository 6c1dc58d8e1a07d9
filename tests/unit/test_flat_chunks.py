"""gradsync.flat.chunks: runs of tensors in order, each at most max_bytes (a larger tensor
alone), so a broadcast of the whole model never copies more than one run at once."""

from __future__ import annotations

import pytest
import torch

from gradsync.flat import chunks

pytestmark = pytest.mark.unit


def test_runs_keep_the_order_and_stay_under_the_limit() -> None:
    tensors = [torch.zeros(n) for n in (10, 10, 10, 100, 5, 5)]  # 40, 40, 40, 400, 20, 20 bytes
    runs = chunks(tensors, max_bytes=120)
    assert [[t.numel() for t in run] for run in runs] == [[10, 10, 10], [100], [5, 5]]
    assert [id(t) for run in runs for t in run] == [id(t) for t in tensors]


def test_nothing_gives_no_run_and_everything_fits_in_one() -> None:
    assert chunks([], max_bytes=10) == []
    tensors = [torch.zeros(3, dtype=torch.float64), torch.zeros(2, dtype=torch.int8)]
    runs = chunks(tensors, max_bytes=1 << 20)
    assert len(runs) == 1 and [id(t) for t in runs[0]] == [id(t) for t in tensors]
