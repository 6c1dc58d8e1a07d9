"""Rank function for tests/ranks/test_restart_agreement.py (module level, for spawned ranks)."""

from __future__ import annotations

import os

import torch

import gradsync as gs
from gradsync.runner.train import agreed_restart


def agreed(rank: int, world: int) -> tuple[int, str]:
    """Rank 1's agent counted a restart, rank 0's did not (another host's, restarting its
    workers for the new round without counting it)."""
    os.environ["TORCHELASTIC_RESTART_COUNT"] = "1" if rank == 1 else "0"
    model = torch.nn.Linear(2, 1)
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    try:
        return agreed_restart(sync), os.environ["TORCHELASTIC_RESTART_COUNT"]
    finally:
        sync.close()
