"""One training configuration on every rank, for ``benchmarks/cluster.py`` (issue 8).

Run by torchrun inside the emulated hosts (``launch_on_cluster``), from the repository root::

    python -m torch.distributed.run ... --module benchmarks.cluster_worker \\
        --mode gradsync --strategy bsp --compress powersgd:4 --workload mlp --steps 64 \\
        --global-batch 64 --out /tmp/r.json

Modes: ``gradsync`` (``gs.Synchronizer`` with ``--strategy``/``--compress``/``--bucket-mb``),
``ddp`` (``DistributedDataParallel``, ``--bucket-mb``), ``ddp-powersgd`` (DDP with torch's own
``powerSGD_hook``, rank 4, vanilla all-reduce for the first 10 iterations, torch's defaults
otherwise) and ``compute-only`` (the same work with no communication: the limit).

Several configurations can share one launch (``--config NAME=MODE[,key=value...]``, repeatable;
keys ``strategy``, ``compress``, ``bucket_mb``, ``steps``): they run one after another in the
same processes, each with a fresh model, optimizer and DDP/Synchronizer. Starting torchrun on
every emulated host costs 10-20 s, more than most configurations train, so the benchmark
starts one launch per repeat rather than one per configuration.

Every mode trains the same model from the same seed with the workload's own optimizer and
learning rate, and rank r takes the same slice ``r`` of the same global batch at every step
(as ``gradsync/worker.py`` does), so loss curves compare across modes. Rank 0 writes ``--out``
(JSON): per step, the training loss of the global batch (mean over the ranks' slices; for
DiLoCo, of the ranks' local models) and rank 0's time since the start of step 0. On a failure
every rank writes ``--out``.try<RESTART>.rank<R>.error.json with the error, so a partition test
can read who said what. With ``--checkpoint-dir``, gradsync runs checkpoint every
``--checkpoint-every`` steps and a worker restarted by the elastic agent resumes from there.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

import gradsync as gs
from gradsync.buckets import plan_buckets
from gradsync.workloads import make_workload

MODES = ("gradsync", "ddp", "ddp-powersgd", "compute-only")
# torch's PowerSGD: the rank asked for in issue 8; 10 plain all-reduce iterations first, as
# torch's documentation suggests, so the compressed phase starts from a sensible gradient.
DDP_POWERSGD_RANK = 4
DDP_POWERSGD_START = 10


@dataclass(frozen=True, kw_only=True)
class RunSpec:
    name: str
    mode: str
    strategy: str = "bsp"
    compress: str = "none"
    bucket_mb: float = 25.0
    steps: int = 64

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"run {self.name!r}: unknown mode {self.mode!r}; valid: {MODES}")
        if self.steps < 1 or not self.bucket_mb > 0:
            raise ValueError(f"run {self.name!r}: need steps >= 1 and bucket_mb > 0")


def parse_run(text: str, defaults: RunSpec) -> RunSpec:
    """``NAME=MODE[,strategy=S][,compress=C][,bucket_mb=B][,steps=N]`` (values may hold ':')."""
    name, sep, rest = text.partition("=")
    if not sep or not name or not rest:
        raise ValueError(f"bad --config {text!r}: use NAME=MODE[,key=value...]")
    mode, *pairs = rest.split(",")
    fields: dict[str, Any] = {
        "strategy": defaults.strategy,
        "compress": defaults.compress,
        "bucket_mb": defaults.bucket_mb,
        "steps": defaults.steps,
    }
    for pair in pairs:
        key, _, value = pair.partition("=")
        if key not in fields:
            raise ValueError(f"bad --config {text!r}: unknown key {key!r}; valid: {list(fields)}")
        fields[key] = type(fields[key])(value)
    return RunSpec(name=name, mode=mode, **fields)


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[RunSpec]]:
    p = argparse.ArgumentParser(prog="benchmarks.cluster_worker", description=__doc__)
    p.add_argument("--mode", choices=MODES, default="gradsync", help="when no --config is given")
    p.add_argument("--strategy", default="bsp", help="gradsync mode: bsp, diloco:16, ...")
    p.add_argument("--compress", default="none", help="gradsync mode: powersgd:4, topk:0.01, ...")
    p.add_argument("--bucket-mb", type=float, default=25.0, help="gradsync and ddp buckets")
    p.add_argument("--steps", type=int, default=64)
    p.add_argument("--config", action="append", default=[], help="NAME=MODE[,key=value...]")
    p.add_argument("--workload", choices=("mlp", "charlm"), default="mlp")
    p.add_argument("--params", type=int, default=3_000_000, help="mlp parameter count")
    p.add_argument("--global-batch", type=int, default=64, help="split evenly over the ranks")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="intra-op threads per rank")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    p.add_argument("--warmup-steps", type=int, default=5, help="untimed compute steps first")
    p.add_argument("--probe-sizes", default="", help="comma-separated all-reduce sizes (bytes)")
    p.add_argument("--progress", default=None, help="rank 0 writes the last finished step here")
    p.add_argument(
        "--checkpoint-dir", default=None, help="gradsync mode: checkpoints, resumed on restart"
    )
    p.add_argument("--checkpoint-every", type=int, default=10, help="steps between checkpoints")
    p.add_argument("--out", required=True, help="rank 0's JSON result")
    args = p.parse_args(argv)
    if args.global_batch < 1 or args.timeout <= 0:
        p.error("need --global-batch >= 1 and --timeout > 0")
    try:
        defaults = RunSpec(
            name=args.mode,
            mode=args.mode,
            strategy=args.strategy,
            compress=args.compress,
            bucket_mb=args.bucket_mb,
            steps=args.steps,
        )
        runs = [parse_run(r, defaults) for r in args.config] or [defaults]
    except ValueError as exc:
        p.error(str(exc))
    return args, runs


def probe_allreduce(sizes: list[int], repeats: int = 3) -> list[dict[str, float]]:
    """Median time of an all-reduce per size, each behind a barrier (slowest rank's time), for
    the alpha-beta fit that the overlap prediction uses."""
    out = []
    for size in sizes:
        buf = torch.ones(max(1, size // 4))
        dist.all_reduce(buf)  # warm-up: connections and allocation
        times = []
        for _ in range(repeats):
            dist.barrier()
            t0 = time.perf_counter()
            dist.all_reduce(buf)
            times.append(time.perf_counter() - t0)
        worst = torch.tensor(times, dtype=torch.float64)
        dist.all_reduce(worst, op=dist.ReduceOp.MAX)
        out.append({"bytes": float(buf.numel() * 4), "time_s": statistics.median(worst.tolist())})
    return out


class Trainer:
    """Builds one run's step function; ``step(i)`` returns this rank's loss at step i."""

    def __init__(self, args: argparse.Namespace, spec: RunSpec, world: int, rank: int) -> None:
        self.args, self.spec = args, spec
        self.workload = make_workload(args.workload, seed=args.seed, params=args.params)
        self.model = self.workload.build_model()
        self.opt = self.workload.make_optimizer(self.model, self.workload.default_lr)
        if args.global_batch % world:
            raise SystemExit(f"--global-batch {args.global_batch} does not split over {world}")
        per_rank = args.global_batch // world
        self.lo, self.hi = rank * per_rank, (rank + 1) * per_rank
        self.fwd_s: list[float] = []
        self.bwd_s: list[float] = []
        self.sync: gs.Synchronizer | None = None
        self.step: Callable[[int], float]
        if spec.mode == "gradsync":
            self.sync = gs.Synchronizer(
                self.model,
                self.opt,
                strategy=spec.strategy,
                compression=None if spec.compress == "none" else spec.compress,
                bucket_mb=spec.bucket_mb,
                timeout_s=args.timeout,
            )
            self.step = self._gradsync_step
        elif spec.mode in ("ddp", "ddp-powersgd"):
            self.ddp = DistributedDataParallel(self.model, bucket_cap_mb=spec.bucket_mb)
            if spec.mode == "ddp-powersgd":
                from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd

                state = psgd.PowerSGDState(
                    process_group=None,
                    matrix_approximation_rank=DDP_POWERSGD_RANK,
                    start_powerSGD_iter=DDP_POWERSGD_START,
                )
                self.ddp.register_comm_hook(state, psgd.powerSGD_hook)
            self.step = self._ddp_step
        else:
            self.step = self._local_step

    def bucket_bytes(self) -> list[int]:
        """Sizes of the buckets gradsync forms at this bucket size (for the overlap model)."""
        params = [p for p in self.model.parameters() if p.requires_grad]
        return [
            sum(p.numel() * p.element_size() for p in b)
            for b in plan_buckets(params, self.spec.bucket_mb)
        ]

    def _batch(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.workload.batch(i, self.args.global_batch, self.lo, self.hi)

    def _gradsync_step(self, i: int) -> float:
        assert self.sync is not None
        with self.sync.step(samples=self.hi - self.lo) as s:
            x, y = self._batch(i)
            loss = self.workload.loss(self.model, x, y)
            loss.backward()
            s.loss = loss
        return loss.item()

    def _ddp_step(self, i: int) -> float:
        self.opt.zero_grad(set_to_none=True)
        x, y = self._batch(i)
        loss = self.workload.loss(self.ddp, x, y)
        loss.backward()
        self.opt.step()
        return loss.item()

    def _local_step(self, i: int) -> float:
        # Forward and backward timed apart: the backward share is what overlap can hide behind.
        self.opt.zero_grad(set_to_none=True)
        x, y = self._batch(i)
        t0 = time.perf_counter()
        loss = self.workload.loss(self.model, x, y)
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        self.opt.step()
        self.fwd_s.append(t1 - t0)
        self.bwd_s.append(t2 - t1)
        return loss.item()


def warm_up(args: argparse.Namespace, world: int, rank: int) -> None:
    """Untimed: the first configuration of a launch must not pay for lazy initialisation
    (autograd and allocator start-up, gloo's first connections) that later ones skip."""
    if args.warmup_steps > 0:
        spec = RunSpec(name="warm-up", mode="compute-only", steps=args.warmup_steps)
        trainer = Trainer(args, spec, world, rank)
        for i in range(spec.steps):
            trainer.step(i)
    dist.all_reduce(torch.ones(1 << 18))
    dist.barrier()


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)  # a reader polling for the file never sees half of it


def train_one(args: argparse.Namespace, spec: RunSpec, seen: dict[str, Any]) -> dict[str, Any]:
    """One configuration; ``seen`` holds the wall-clock time of the last finished step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = Trainer(args, spec, world, rank)
    params = sum(p.numel() for p in trainer.model.parameters())
    losses: list[float] = []
    times: list[float] = []
    start = 0
    ckpt = args.checkpoint_dir if trainer.sync is not None else None
    if ckpt and int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")) > 0:
        # Restarted by the elastic agent (--max-restarts) after a failure: the same run goes
        # on from the newest complete checkpoint; each step's batch is a function of the step.
        assert trainer.sync is not None
        extra = trainer.sync.load(ckpt)
        start = int(extra["step"]) if extra else 0
    dist.barrier()  # everyone starts step 0 together: times are from a common origin
    t0 = time.perf_counter()
    for i in range(start, spec.steps):
        losses.append(trainer.step(i))
        times.append(time.perf_counter() - t0)
        seen.update(run=spec.name, last_step=i, last_step_at=time.time())
        if rank == 0 and args.progress:
            Path(args.progress).write_text(f"{spec.name} {i} {time.time():.3f}\n")
        if ckpt and (i + 1) % args.checkpoint_every == 0:
            assert trainer.sync is not None
            trainer.sync.save(ckpt, keep=2, data_position=i + 1)
    if trainer.sync is not None:
        # The report is a collective and checks the replicas: part of using gradsync, but
        # outside the timed steps as DDP has no counterpart.
        trainer.sync.report()
        trainer.sync.close()
    dist.barrier()
    total = time.perf_counter() - t0
    # The loss of the whole global batch (mean over ranks' slices), gathered once after the
    # timed steps: a per-step gather would add a collective that DiLoCo does not have.
    gathered: list[Any] = [None] * world
    dist.all_gather_object(gathered, losses)
    global_loss = [sum(col) / world for col in zip(*gathered, strict=True)]
    return {
        "name": spec.name,
        "mode": spec.mode,
        "strategy": spec.strategy,
        "compress": spec.compress,
        "bucket_mb": spec.bucket_mb,
        "steps": spec.steps,
        "start_step": start,
        "restart_count": int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")),
        "params": params,
        "grad_bytes": params * 4,
        "bucket_bytes": trainer.bucket_bytes(),
        "loss": global_loss,
        "loss_rank0": gathered[0],
        "time_s": times,
        "total_s": total,
        "fwd_s": trainer.fwd_s,
        "bwd_s": trainer.bwd_s,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args, runs = parse_args(argv)
    torch.set_num_threads(args.threads)
    gs.init(backend="gloo", timeout_s=args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    host = int(os.environ.get("GRADSYNC_CLUSTER_HOST", "-1"))
    seen: dict[str, Any] = {"run": None, "last_step": -1, "last_step_at": time.time()}
    try:
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, host)
        if rank == 0:  # early, so a partition test knows who lives where before anything fails
            _write_json(f"{args.out}.hosts.json", hosts)
        warm_up(args, world, rank)
        probe = probe_allreduce([int(s) for s in args.probe_sizes.split(",") if s])
        results = []
        for spec in runs:
            results.append(train_one(args, spec, seen))
            gc.collect()  # the previous run's model and buffers, before the next one is timed
    except Exception as exc:
        # Every rank says what it saw, with wall-clock times the caller can set against the
        # moment it took a link down.
        _write_json(
            f"{args.out}.try{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}"
            f".rank{rank}.error.json",
            {
                "rank": rank,
                "host": host,
                "type": type(exc).__name__,
                "message": str(exc),
                "failed_at": time.time(),
                **seen,
                "traceback": traceback.format_exc(limit=4),
            },
        )
        # No destroy_process_group: with a peer gone it can block; exiting is enough.
        raise
    if rank == 0:
        _write_json(
            args.out,
            {
                "workload": args.workload,
                "world_size": world,
                "global_batch": args.global_batch,
                "hosts_by_rank": hosts,
                "link": os.environ.get("GRADSYNC_CLUSTER_LINK"),
                "threads": args.threads,
                "probe": probe,
                "runs": results,
            },
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
