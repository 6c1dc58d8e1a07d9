"""A user's script under ``gradsync run --replica-groups 2 --nproc 1 --kill 1:S
--max-restarts 1 -- THIS --steps N --every K`` (tests/e2e/test_replica_groups.py): bsp on a
Linear, a checkpoint every K steps into its group's run directory, ``sync.load`` at its start.
Group 1's replacement (restart 1) waits until group 0 has finished, so that it finds no live
peer: it must go on from its own checkpoint, not from step 0."""

from __future__ import annotations

import argparse
import os
import time
from pathlib import Path

import torch

import gradsync as gs

#: written into the run's directory by group 0 once it has finished
DONE = "group-0-done"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--every", type=int, required=True)
    args = parser.parse_args()
    group = int(os.environ["REPLICA_GROUP_ID"])
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    here = Path(os.environ["GRADSYNC_RUN_DIR"])  # RUN/group-K
    if group == 1 and attempt > 0:
        deadline = time.monotonic() + 60
        while not (here.parent / DONE).exists() and time.monotonic() < deadline:
            time.sleep(0.05)
    gs.init()
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    sync = gs.Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1))
    loaded = sync.load(here / "checkpoints")
    for step in range(loaded["step"] if loaded else 0, args.steps):
        data = torch.Generator().manual_seed(1000 * group + step)
        with sync.step():
            model(torch.randn(16, 8, generator=data)).square().mean().backward()
        if (step + 1) % args.every == 0:
            sync.save(here / "checkpoints", wait=False)
    sync.report()
    sync.close()
    if group == 0:
        (here.parent / DONE).touch()


if __name__ == "__main__":
    main()
