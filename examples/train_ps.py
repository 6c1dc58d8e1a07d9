# torchrun --standalone --nproc_per_node=3 examples/train_ps.py --strategy async --steps 100
"""Parameter-server training (``ssp:S`` or ``async``) with gradsync under plain torchrun.

With ``--servers K`` the last K ranks are parameter servers: they hold the parameters (sharded
by size) and the optimizer state, and run no training; the other ranks are workers that push
gradients and pull parameters. Every rank builds the same ``Synchronizer``; server ranks call
``sync.serve()`` instead of the training loop. ``--nproc_per_node`` counts workers plus servers
(3 above: 2 workers, 1 server).
"""

from __future__ import annotations

import argparse

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.workloads import make_workload


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--strategy", default="async", help="ssp:S or async")
    parser.add_argument("--servers", type=int, default=1, help="parameter-server ranks (last K)")
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--batch-size", type=int, default=16, help="samples per worker")
    parser.add_argument("--params", type=int, default=20_000, help="size of the mlp")
    args = parser.parse_args()

    gs.init()  # join the group torchrun set up
    torch.set_num_threads(1)
    rank = dist.get_rank()

    workload = make_workload("mlp", seed=0, params=args.params)
    model = workload.build_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    # Every rank builds it; the last --servers ranks become parameter servers.
    sync = gs.Synchronizer(model, optimizer, strategy=args.strategy, servers=args.servers)
    if sync.is_server:
        sync.serve()  # until every worker is done; takes part in the final report there
    else:
        workers = sync.num_workers  # ranks 0 .. workers-1
        global_batch = args.batch_size * workers
        lo = rank * args.batch_size
        for step in range(args.steps):
            with sync.step() as s:
                x, y = workload.batch(step, global_batch, lo, lo + args.batch_size)
                loss = workload.loss(model, x, y)
                loss.backward()
                s.loss = loss
            if rank == 0 and step % 20 == 0:
                print(f"step {step} loss {loss.item():.4f}", flush=True)
        report = sync.report()  # ends training: every worker fetches the final parameters
        if rank == 0:
            print(report.format())
    sync.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
