"""Buffers (BatchNorm running statistics) kept in agreement as DDP's broadcast_buffers does."""

from __future__ import annotations

import pytest
import torch

from gradsync.testing import run_ranks
from tests.support import buffers_ranks

pytestmark = pytest.mark.ranks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("micro_batches", [1, 2])
def test_batchnorm_buffers_and_parameters_are_bitwise_equal_to_ddp(micro_batches: int) -> None:
    results = run_ranks(buffers_ranks.buffers_against_ddp, 2, micro_batches)
    for out in results:
        ours, ddp = out["gradsync"], out["ddp"]
        assert ours.keys() == ddp.keys()
        for name in ddp:
            assert torch.equal(ours[name], ddp[name]), name
    # Without the broadcast each rank keeps its own statistics: the running means differ.
    first, second = (out["unsynced"]["1.running_mean"] for out in results)
    assert not torch.equal(first, second)
