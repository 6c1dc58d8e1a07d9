"""A user's script under ``gradsync run --replica-groups G --nproc N -- THIS --out DIR``
(tests/e2e/test_replica_groups.py): each replica group builds its model from a seed of its
own, so the groups start apart, as scripts that do not seed alike do; the first quorum must
leave every rank of every group with one replica's weights. Each rank trains a few bsp steps
on data of its own and saves its final parameters as DIR/final-GROUP-RANK.pt."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import torch

import gradsync as gs


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", required=True)
    parser.add_argument("--steps", type=int, default=6)
    args = parser.parse_args()
    gs.init()
    group = int(os.environ.get("REPLICA_GROUP_ID", "0"))
    rank = gs.rank()
    torch.manual_seed(100 + group)  # another start in each group (one within it)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    sync = gs.Synchronizer(model, optimizer)  # bsp; torchft membership from the run directory
    data = torch.Generator().manual_seed(1000 * group + rank)
    for _ in range(args.steps):
        with sync.step():
            model(torch.randn(16, 8, generator=data)).square().mean().backward()
    sync.report()
    torch.save(model.state_dict(), Path(args.out) / f"final-{group}-{rank}.pt")
    sync.close()


if __name__ == "__main__":
    main()
