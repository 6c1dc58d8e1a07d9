"""A parameter-server control message (a checkpoint request, a skipped push, the end) is its
header alone, received into a buffer of a push's size: gloo must deliver it there whole and
leave the rest of the buffer as it was (``ShardPlan.control``)."""

from __future__ import annotations

import pytest
import torch

from gradsync.strategies.ps_wire import CHECKPOINT
from gradsync.testing import run_ranks
from tests.support import ps_wire_ranks


@pytest.mark.ranks
@pytest.mark.timeout(60)
def test_a_header_only_message_lands_in_a_push_sized_receive() -> None:
    got = run_ranks(ps_wire_ranks.control_into_a_push_sized_receive, 2, timeout_s=45)
    assert got[0] == [CHECKPOINT, 0.25, -7.0, -7.0]


@pytest.mark.ranks
@pytest.mark.timeout(90)
def test_a_shard_smaller_than_a_control_message_trains_as_one_process() -> None:
    results = run_ranks(ps_wire_ranks.small_shards, 3, timeout_s=75)
    worker = next(r for r in results if r is not None)
    for got, want in zip(worker["params"], worker["reference"], strict=True):
        assert torch.allclose(got, want, atol=1e-6), (got, want)
