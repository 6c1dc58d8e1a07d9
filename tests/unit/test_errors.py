"""Each user error gets one clear message naming the bad value and what is valid: a strategy
spec, a Synchronizer before init or after the group is gone. On ranks:
tests/ranks/test_errors_ranks.py; the CLI's: tests/e2e/test_errors_e2e.py."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch import nn

import gradsync as gs
from gradsync.errors import UsageError

pytestmark = pytest.mark.unit


def test_strategy_spec_error_names_valid_forms() -> None:
    with pytest.raises(
        ValueError,
        match=r"valid: bsp, zero:N, local:H, diloco:H\[:F\[:TAU\[:ALPHA\]\|:eager\]\[:SPLIT\]\]"
        r"\[:outer_lr=X\]\[:outer_momentum=M\], ssp:S, "
        "async",
    ):
        gs.parse_strategy("bps")


def test_synchronizer_before_init_is_a_clear_error() -> None:
    # The Synchronizer is the first thing that needs the process group: it broadcasts the
    # initial parameters, so without gs.init() there is no sync.step() to call yet.
    model = nn.Linear(2, 1)
    with pytest.raises(UsageError, match=r"gs.Synchronizer needs torch.distributed: call gs.init"):
        gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_step_after_the_process_group_is_gone_is_a_clear_error(tmp_path) -> None:
    # A one-rank group in this process (FileStore: no port), destroyed between steps.
    model = nn.Linear(2, 1)
    store = dist.FileStore(str(tmp_path / "store"), 1)
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
        with sync.step():
            model(torch.ones(1, 2)).sum().backward()
        assert sync.step_count == 1
    finally:
        dist.destroy_process_group()
    no_group = r"sync.step\(\) needs torch.distributed: call gs.init"
    with pytest.raises(UsageError, match=no_group), sync.step():
        pytest.fail("the block must not run without a process group")
    assert sync.step_count == 1
