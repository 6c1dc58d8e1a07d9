# torchrun --standalone --nproc_per_node=4 examples/train_charlm.py --steps 100
"""Data-parallel training of the built-in character-level transformer with gradsync.

The three gradsync lines are marked; everything else is an ordinary PyTorch loop. On a GPU box
the same command uses NCCL (gs.init() picks it when CUDA is available).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.workloads import make_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per rank")
    parser.add_argument("--micro-batches", type=int, default=1)
    parser.add_argument("--bucket-mb", type=float, default=25.0)
    args = parser.parse_args()

    gs.init()  # gradsync line 1: join the group torchrun set up
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if torch.cuda.is_available() else torch.device("cpu")

    workload = make_workload("charlm", seed=0)
    model = workload.build_model().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # gradsync line 2: wrap the model and the optimizer you already have
    sync = gs.Synchronizer(model, optimizer, strategy="bsp", bucket_mb=args.bucket_mb)

    global_batch = args.batch_size * world
    k = args.micro_batches
    for step in range(args.steps):
        # gradsync line 3: one superstep; on exit gradients are averaged and optimizer.step() ran
        with sync.step(micro_batches=k) as s:
            lo = rank * args.batch_size
            for i in range(k):
                a = lo + args.batch_size * i // k
                b = lo + args.batch_size * (i + 1) // k
                x, y = workload.batch(step, global_batch, a, b)
                loss = workload.loss(model, x.to(device), y.to(device))
                loss.backward()
            s.loss = loss
        if rank == 0 and step % 20 == 0:
            print(f"step {step} loss {loss.item():.4f}", flush=True)

    report = sync.report()  # collective: every rank calls it
    if rank == 0:
        print(report.format())
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
