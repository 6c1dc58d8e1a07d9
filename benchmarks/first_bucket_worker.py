"""The ranks' side of ``benchmarks.first_bucket``: torch DDP and gradsync ``bsp`` in blocks of
steps interleaved in the same processes, on one model, each rank on its own emulated host.

``python -m benchmarks.first_bucket_worker --model mlp|transformer --params N --batch B
--repeats R --block S --out F``
under torchrun: configurations ``ddp`` (DDP's defaults: a 1 MiB first bucket, then 25 MiB),
``gradsync`` (bsp with its defaults: a first bucket of at most 1 MiB, then an eighth of the
gradient, 1 to 25 MiB), ``gradsync-auto`` (``bucket_mb="auto"``), ``gradsync-1mb``
(``bucket_mb=1``, the fastest fixed size in issue 48's sweep), ``gradsync-25mb`` (the plan
before issue 48), ``gradsync-nogate`` and ``gradsync-bare`` (the defaults' plan without the
step gate, and without the gate, telemetry, the checks and the guard) and ``compute-only``
(``--kinds`` picks some, ddp always among them). Rank 0
writes every block's mean step time, and each gradsync configuration's buckets as it ended, to
``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from benchmarks.harness import time_interleaved
from benchmarks.steps import Trainer
from gradsync.workloads import make_workload

KINDS = (
    "ddp",
    "gradsync",
    "gradsync-auto",
    "gradsync-1mb",
    "gradsync-25mb",
    "gradsync-nogate",
    "gradsync-bare",
    "compute-only",
)
#: the defaults less some of the per-step work, to tell the plan's cost from the rest's:
#: "-nogate" without the step gate, "-bare" without the gate, telemetry, the divergence check
#: and the non-finite guard (what ``benchmarks.host_overhead`` calls 'bare, gate off')
_LESS = {
    "gradsync-nogate": {"between_steps_timeout_s": None},
    "gradsync-bare": {
        "between_steps_timeout_s": None,
        "telemetry": False,
        "check_every": 0,
        "skip_nonfinite": False,
    },
}
VOCAB, CONTEXT = 128, 64


class TinyTransformer:
    """A workload of many small tensors, as the issue's held-out model: a token embedding,
    ``layers`` encoder layers of width ``dim`` and an output head, on random tokens drawn from
    the step's seed (the mlp workload has a few large tensors: its gradient's order says
    little about overlap)."""

    name = "transformer"
    default_lr = 1e-3

    def __init__(self, dim: int = 128, layers: int = 6) -> None:
        self.dim, self.layers = dim, layers

    def build_model(self) -> torch.nn.Module:
        torch.manual_seed(0)
        layer = torch.nn.TransformerEncoderLayer(
            self.dim, 4, 4 * self.dim, dropout=0.0, batch_first=True
        )
        return torch.nn.Sequential(
            torch.nn.Embedding(VOCAB, self.dim),
            torch.nn.TransformerEncoder(layer, self.layers, enable_nested_tensor=False),
            torch.nn.Linear(self.dim, VOCAB),
        )

    def make_optimizer(self, model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)

    def batch(
        self, step: int, global_batch: int, start: int, stop: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(step)
        tokens = torch.randint(0, VOCAB, (global_batch, CONTEXT + 1), generator=g)
        return tokens[start:stop, :-1], tokens[start:stop, 1:]

    def loss(self, model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        return torch.nn.functional.cross_entropy(model(x).reshape(-1, VOCAB), y.reshape(-1))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--params", type=int, default=1_500_000, help="the mlp's parameters")
    p.add_argument("--batch", type=int, default=256, help="per rank")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block", type=int, default=10)
    p.add_argument("--kinds", default=",".join(KINDS), help="configurations, comma-separated")
    p.add_argument("--out", required=True)
    args = p.parse_args()
    kinds = args.kinds.split(",")
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or "ddp" not in kinds:
        p.error(f"--kinds: unknown {unknown}; valid: {KINDS}, ddp among them (the reference)")
    gs.init()
    torch.set_num_threads(1)
    workload: Any = (
        TinyTransformer()
        if args.model == "transformer"
        else make_workload("mlp", params=args.params)
    )
    global_batch = args.batch * dist.get_world_size()

    def sgd(model: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.SGD(model.parameters(), lr=1e-3, momentum=0.9)

    def trainer(kind: str) -> Trainer:
        mode = "gradsync" if kind.startswith("gradsync") else kind
        # "gradsync": the default plan; "-auto": bucket_mb="auto" (its timing steps fall in the
        # warm-up and its first block); "-1mb" and "-25mb": fixed sizes (25 MB: the plan before
        # issue 48, and DDP's cap)
        plans = {"gradsync": None, "gradsync-auto": "auto", "gradsync-1mb": 1.0}
        bucket_mb = None if kind in _LESS else plans.get(kind, 25.0)
        return Trainer(
            mode,
            workload,
            global_batch,
            optimizer=sgd,
            bucket_mb=bucket_mb,
            **_LESS.get(kind, {}),
        )

    trainers = {kind: trainer(kind) for kind in kinds}
    blocks = time_interleaved({k: t.step for k, t in trainers.items()}, args.repeats, args.block)
    if dist.get_rank() == 0:
        grad_mb = sum(p.numel() for p in workload.build_model().parameters()) * 4 / 2**20
        # each gradsync configuration's buckets as it ended (auto's: the plan it kept), so a
        # reader sees which columns ran the same plan
        plans = {
            k: [round(b.nbytes / 2**20, 2) for b in t.sync.strategy.reducer.buckets]
            for k, t in trainers.items()
            if t.sync is not None
        }
        result = {"blocks": blocks, "grad_mb": grad_mb, "model": args.model, "plans": plans}
        Path(args.out).write_text(json.dumps(result))
    dist.barrier()


if __name__ == "__main__":
    main()
