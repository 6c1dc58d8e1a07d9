"""A user's own training script of the README's shape, for ``gradsync run -- SCRIPT``: it
knows nothing of run directories, faults or restarts; its gs.Synchronizer does.

``python user_script.py STEPS CHECKPOINTS FINAL``: trains a small MLP for STEPS steps on a
fixed synthetic data set (each rank its slice of every global batch), checkpoints every step
into CHECKPOINTS (resuming from it first, as a restartable script does), and has rank 0
write the final parameters to FINAL.
"""

from __future__ import annotations

import sys

import torch

import gradsync as gs

GLOBAL_BATCH = 16


def main() -> None:
    steps, checkpoints, final = int(sys.argv[1]), sys.argv[2], sys.argv[3]
    gs.init()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sync = gs.Synchronizer(model, optimizer)
    resumed = sync.load(checkpoints)
    start = resumed["step"] if resumed else 0
    data = torch.Generator().manual_seed(1)
    batches = [
        (torch.randn(GLOBAL_BATCH, 8, generator=data), torch.randn(GLOBAL_BATCH, 1, generator=data))
        for _ in range(steps)
    ]
    rank, world = gs.rank(), gs.world_size()
    for step in range(start, steps):
        x, y = (t[rank::world] for t in batches[step])
        with sync.step(samples=len(x)) as s:
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            s.loss = loss.detach()
        sync.save(checkpoints, wait=False)
    sync.report()
    if gs.is_main():
        torch.save({k: v.clone() for k, v in model.state_dict().items()}, final)
    sync.close()


if __name__ == "__main__":
    main()
