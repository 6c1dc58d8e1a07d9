"""GRADSYNC_RANK_DEVICE (tests/support/rank_device.py): the multi-rank workloads on a device."""

from __future__ import annotations

import pytest

from gradsync.testing import run_ranks
from gradsync.workloads import make_workload
from tests.support import rank_device, rank_device_ranks


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_a_named_device_takes_the_workloads_inside_the_ranks_only(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # "meta" stands in for a GPU here: a device every machine has, which no test uses
    monkeypatch.setenv(rank_device.ENV, "meta")
    for got in run_ranks(rank_device_ranks.devices, 2, timeout_s=50):
        assert got == {"mlp": "meta meta meta", "charlm": "meta meta meta"}, got
    # this process is in no multi-rank group: its workloads stay where they were built
    model = make_workload("mlp", seed=1, params=2000).build_model()
    assert next(model.parameters()).device.type == "cpu"


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_unset_or_cpu_leaves_the_workloads_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    for value in ("", "cpu"):
        monkeypatch.setenv(rank_device.ENV, value)
        assert rank_device.requested() is None
        for got in run_ranks(rank_device_ranks.devices, 2, timeout_s=50):
            assert got == {"mlp": "cpu cpu cpu", "charlm": "cpu cpu cpu"}, got
