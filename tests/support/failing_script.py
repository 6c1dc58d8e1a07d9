"""A user script whose rank 1 raises before step FAIL_AT: the run fails for good, and torch's
agent stops rank 0 with SIGTERM (tests/e2e/test_script_run.py)."""

from __future__ import annotations

import sys

import torch

import gradsync as gs

FAIL_AT = int(sys.argv[1])

gs.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.05))
generator = torch.Generator().manual_seed(1 + gs.rank())
for step in range(2 * FAIL_AT):
    if step == FAIL_AT and gs.rank() == 1:
        raise RuntimeError(f"the user's error at step {step}")
    x = torch.randn(16, 8, generator=generator)
    with sync.step(samples=16) as s:
        loss = torch.nn.functional.mse_loss(model(x), x.sum(1, keepdim=True))
        loss.backward()
        s.loss = loss
