"""Time a rank spends in its own code between steps (an evaluation or logging on rank 0) is
not the compute of the ranks that wait for it.

Under ``bsp`` the step gate is waited on its own thread from the block's entry and joined
before the first exchange, inside the block: that join is a wait for a peer still in its own
code. Counted as compute (before), the waiting rank looked like the slowest, was named the
pace-setter and its peer's idle share went past 100% (a tester's find). Now the join is sync
time."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.testing import run_ranks

pytestmark = pytest.mark.ranks

STEPS, PAUSE_S = 12, 0.05


def _rank_0_pauses_between_steps(rank: int, world_size: int) -> list[dict[str, Any]] | None:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.05), timeout_s=30)
    for _ in range(STEPS):
        x, y = torch.randn(16, 32), torch.randn(16, 1)
        with sync.step():
            nn.functional.mse_loss(model(x), y).backward()
        if rank == 0:
            time.sleep(PAUSE_S)  # its own code between steps
    report = sync.report()
    sync.close()
    if rank != 0:
        return None
    return [
        {"rank": r.rank, "step": r.step, "compute": r.compute, "sync": r.sync, "idle": r.idle}
        for r in report.records
    ]


@pytest.mark.timeout(120)
def test_a_wait_for_a_peer_in_its_own_code_is_sync_not_compute() -> None:
    records, _ = run_ranks(_rank_0_pauses_between_steps, 2, timeout_s=90)
    # the steps rank 1 waited for rank 0's pause before (all but the first)
    waited = [r for r in records if r["rank"] == 1 and r["step"] >= 1]
    for r in waited:
        assert r["compute"] < PAUSE_S / 2, r  # a small model's step: the pause is not in it
        assert r["sync"] >= PAUSE_S / 2, r  # it is the wait
    # so the pausing rank is charged no idle made of the waiting rank's compute
    assert all(r["idle"] < PAUSE_S / 2 for r in records if r["rank"] == 0), records
