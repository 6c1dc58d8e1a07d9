"""The ranks' side of ``benchmarks.first_bucket``: torch DDP and gradsync ``bsp`` in blocks of
steps interleaved in the same processes, on one model, each rank on its own emulated host.

``python -m benchmarks.first_bucket_worker --params N --batch B --repeats R --block S --out F``
under torchrun: configurations ``ddp`` (DDP's defaults: a 1 MiB first bucket, then 25 MiB),
``gradsync`` (bsp with its defaults: the same plan since issue 48), ``gradsync-1mb``
(``bucket_mb=1``, the fastest fixed size in issue 48's sweep) and ``compute-only``. Rank 0
writes every block's mean step time to ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist

import gradsync as gs
from benchmarks.harness import time_interleaved
from benchmarks.steps import Trainer
from gradsync.workloads import make_workload

KINDS = ("ddp", "gradsync", "gradsync-1mb", "compute-only")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--params", type=int, default=1_500_000)
    p.add_argument("--batch", type=int, default=256, help="per rank")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    gs.init()
    torch.set_num_threads(1)
    workload = make_workload("mlp", params=args.params)
    global_batch = args.batch * dist.get_world_size()

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def trainer(kind: str) -> Trainer:
        mode = "gradsync" if kind.startswith("gradsync") else kind
        bucket_mb = 1.0 if kind == "gradsync-1mb" else 25.0
        return Trainer(mode, workload, global_batch, optimizer=sgd, bucket_mb=bucket_mb)

    steps = {kind: trainer(kind).step for kind in KINDS}
    blocks = time_interleaved(steps, args.repeats, args.block)
    if dist.get_rank() == 0:
        grad_mb = sum(p.numel() for p in workload.build_model().parameters()) * 4 / 2**20
        Path(args.out).write_text(json.dumps({"blocks": blocks, "grad_mb": grad_mb}))
    dist.barrier()


if __name__ == "__main__":
    main()
