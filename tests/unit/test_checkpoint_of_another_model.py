"""A checkpoint saved from another model (a resume with another size, a changed script) is a
CheckpointError naming the checkpoint and the likely cause, not torch's size-mismatch line
alone (a reliability tester's --resume after config.json was deleted)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.checkpoint.store import CheckpointError

pytestmark = pytest.mark.unit


def _sync(width: int) -> gs.Synchronizer:
    model = nn.Sequential(nn.Linear(4, width), nn.Linear(width, 1))
    return gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))


@pytest.mark.timeout(60)
def test_a_checkpoint_of_another_model_is_named(
    one_rank: None, inline_writer: None, tmp_path: Path
) -> None:
    saved = _sync(3)
    with saved.step():
        saved.model(torch.ones(2, 4)).sum().backward()
    saved.save(tmp_path)
    saved.close()
    other = _sync(5)
    try:
        with pytest.raises(CheckpointError, match=r"step-000001 does not fit this model .* size"):
            other.load(tmp_path)
    finally:
        other.close()
