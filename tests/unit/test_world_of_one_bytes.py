"""A world of one sends nothing: its report counts 0 bytes, whatever the strategy hands its
no-op collectives."""

from __future__ import annotations

import pytest
import torch

import gradsync as gs
from gradsync.workloads import make_workload

pytestmark = pytest.mark.unit


@pytest.mark.timeout(60)
@pytest.mark.parametrize("compression", [None, "int8"])
def test_a_world_of_one_reports_no_bytes_sent(one_rank: None, compression: str | None) -> None:
    w = make_workload("mlp", seed=3, params=2000)
    model = w.build_model()
    sync = gs.Synchronizer(
        model, torch.optim.SGD(model.parameters(), lr=0.1), compression=compression
    )
    for step in range(3):
        with sync.step(samples=4):
            w.loss(sync.model, *w.batch(step, 4, 0, 4)).backward()
    report = sync.report()
    sync.close()
    assert report is not None
    assert [t.bytes for t in report.ranks] == [0]
    assert sum(t.samples for t in report.ranks) == 12  # the steps were recorded
