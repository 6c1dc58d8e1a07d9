"""Pruning an old checkpoint is as safe as deleting it: later saves write new files and rename
them into place, so a hard link a user kept of an old checkpoint file still holds that step's
bytes, and a file a link inside a pruned step directory points to is never written to."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.checkpoint.packing import read_packed, unpack

pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(60),
    pytest.mark.usefixtures("one_rank", "inline_writer"),
]


def _train_and_save(sync: gs.Synchronizer, model: nn.Module, directory: Path, steps: int) -> None:
    for _ in range(steps):
        with sync.step():
            model(torch.randn(4, 6)).sum().backward()
        sync.save(directory, keep=1)


def test_a_kept_hard_link_and_a_linked_file_survive_pruning(tmp_path: Path) -> None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    sync = gs.Synchronizer(model, opt, strategy="bsp", timeout_s=30)
    directory = tmp_path / "ckpt"
    try:
        _train_and_save(sync, model, directory, steps=1)
        first = directory / "step-000001" / "rank-0.pt"
        kept = tmp_path / "kept-step-1.pt"
        os.link(first, kept)
        kept_bytes = kept.read_bytes()
        outside = tmp_path / "notes.txt"
        outside.write_bytes(b"mine")
        os.symlink(outside, directory / "step-000001" / "notes.txt")
        # keep=1: step 1 is pruned, and later saves may be written where its files were
        _train_and_save(sync, model, directory, steps=6)
        sync.wait_for_checkpoints()
    finally:
        sync.close()
    assert not (directory / "step-000001").exists()
    assert kept.read_bytes() == kept_bytes, "a kept link of a pruned checkpoint was rewritten"
    assert outside.read_bytes() == b"mine"
    assert unpack(read_packed(kept_bytes))["sync"]["step"] == 1  # and it still reads back
