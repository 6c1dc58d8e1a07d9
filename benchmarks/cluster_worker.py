"""One launch of training configurations on every rank, for ``benchmarks/cluster.py`` (issue 8),
run by torchrun on the emulated hosts; docs/cluster.md describes its use and its options.

Several configurations (``--config NAME=MODE[,key=value...]``) share one launch, one after
another in the same processes, because starting torchrun on every emulated host costs 10-20 s,
more than most configurations train. Rank 0 writes ``--out`` (JSON): per configuration and
step, the loss of the global batch and the time since step 0. On a failure every rank writes
``--out``.try<RESTART>.rank<R>.error.json, so a partition test can read who said what.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from benchmarks.harness import machine_busy_s
from benchmarks.steps import MODES, Trainer
from gradsync import runtime
from gradsync.buckets import plan_buckets
from gradsync.cluster.allreduce_probe import measure
from gradsync.workloads import make_workload

KEYS = ("strategy", "compress", "bucket_mb", "steps")  # what --config may set per run


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
    fields: dict[str, Any] = {k: getattr(defaults, k) for k in KEYS}
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
    p.add_argument(
        "--workload",
        choices=("mlp", "charlm", "heldout"),
        default="mlp",
        help="heldout: the frontier's held-out transformer (benchmarks/frontier_model.py)",
    )
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
        defaults = RunSpec(name=args.mode, mode=args.mode, **{k: getattr(args, k) for k in KEYS})
        runs = [parse_run(r, defaults) for r in args.config] or [defaults]
    except ValueError as exc:
        p.error(str(exc))
    return args, runs


def probe_allreduce(sizes: list[int]) -> list[dict[str, Any]]:
    """Per size, the median time of an all-reduce behind a barrier (the slowest rank's), for
    the alpha-beta fit that the overlap prediction uses: ``gradsync cluster probe``'s timing."""
    return [measure(size, iters=3, warmup=1) for size in sizes]


def bucket_bytes(model: torch.nn.Module, bucket_mb: float) -> list[int]:
    """Sizes of the buckets gradsync forms at this bucket size (for the overlap model)."""
    params = [p for p in model.parameters() if p.requires_grad]
    return [sum(p.numel() * p.element_size() for p in b) for b in plan_buckets(params, bucket_mb)]


def workload(args: argparse.Namespace) -> Any:
    """``--workload``: gradsync's built-in ones, or the frontier's held-out transformer."""
    if args.workload == "heldout":
        from benchmarks.frontier_model import HeldOutLM

        return HeldOutLM(seed=args.seed)
    return make_workload(args.workload, seed=args.seed, params=args.params)


def make_trainer(args: argparse.Namespace, spec: RunSpec) -> Trainer:
    """One run: a fresh model and the workload's own optimizer and rate; a compute-only run
    times forward and backward apart (``fwd_s``, ``bwd_s``)."""
    return Trainer(
        spec.mode,
        workload(args),
        args.global_batch,
        bucket_mb=spec.bucket_mb,
        time_phases=True,
        strategy=spec.strategy,
        compression=spec.compress,
        timeout_s=args.timeout,
    )


def warm_up(args: argparse.Namespace) -> None:
    """Untimed: the first configuration of a launch must not pay for lazy initialisation
    (autograd and allocator start-up, gloo's first connections) that later ones skip."""
    if args.warmup_steps > 0:
        spec = RunSpec(name="warm-up", mode="compute-only", steps=args.warmup_steps)
        trainer = make_trainer(args, spec)
        for i in range(spec.steps):
            trainer.step(i)
    dist.all_reduce(torch.ones(1 << 18))
    dist.barrier()


#: how long a run waits, untimed, for its Synchronizer's voucher to start (``await_voucher``)
VOUCHER_WAIT_S = 20.0


def await_voucher(sync: gs.Synchronizer, hosts: int) -> float:
    """Untimed, before step 0 where the ranks are on several hosts: until this rank's
    liveness voucher has written (``gradsync.checks.voucher``: a process the Synchronizer
    starts at construction when a peer is on another machine); the seconds waited. Its start
    imports torch, about 1.7 s of CPU, once per Synchronizer: a run of hours pays it once, at
    its start, like the construction. Here every configuration is a fresh Synchronizer of a
    couple of seconds' steps, and on the 2 cores of the emulated cluster that start fell
    inside them: streaming DiLoCo's share of the compute-only limit (the frontier's mlp, 2
    hosts) was 54% with it and 82% with no voucher started (2026-12-01, 3 repeats each;
    BENCHMARKS.md, "The voucher's start-up, outside the timed steps")."""
    if hosts < 2:
        return 0.0
    started = time.monotonic()
    deadline = started + VOUCHER_WAIT_S
    while not sync.watch.vouching and time.monotonic() < deadline:
        time.sleep(0.05)
    return time.monotonic() - started


class BusySince:
    """The machine's busy CPU seconds (``machine_busy_s``) since ``start()``, one reading per
    ``mark()``. A reading that fails repeats the one before, so the series never goes back;
    with no reading at the start there is no series (None)."""

    def __init__(self, read: Any = machine_busy_s) -> None:
        self._read = read
        self._start: float | None = None
        self._marks: list[float] = []

    def start(self) -> None:
        self._start, self._marks = self._read(), []

    def mark(self) -> None:
        if self._start is None:
            return
        now = self._read()
        last = self._marks[-1] if self._marks else 0.0
        self._marks.append(last if now is None else max(last, now - self._start))

    def series(self) -> list[float] | None:
        return self._marks if self._start is not None and self._marks else None


def _restarts() -> int:
    """How often the elastic agent restarted this worker group (--max-restarts)."""
    return runtime.restart_count()


def _write_json(path: str, obj: Any) -> None:
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "w") as f:
        json.dump(obj, f)
    os.replace(tmp, path)  # a reader polling for the file never sees half of it


def train_one(args: argparse.Namespace, spec: RunSpec, seen: dict[str, Any]) -> dict[str, Any]:
    """One configuration; ``seen`` holds the wall-clock time of the last finished step."""
    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = make_trainer(args, spec)
    params = sum(p.numel() for p in trainer.model.parameters())
    losses: list[float] = []
    times: list[float] = []
    start = 0
    ckpt = args.checkpoint_dir if trainer.sync is not None else None
    hosts = getattr(args, "hosts", 1)
    voucher_s = await_voucher(trainer.sync, hosts) if trainer.sync is not None else 0.0
    if ckpt and _restarts() > 0:
        # Restarted by the elastic agent (--max-restarts) after a failure: the same run goes
        # on from the newest complete checkpoint; each step's batch is a function of the step.
        assert trainer.sync is not None
        extra = trainer.sync.load(ckpt)
        start = int(extra["step"]) if extra else 0
    # The counter covers the whole machine (every emulated host shares its cores), so one
    # reader is enough: rank 0, whose JSON is the one written.
    busy = BusySince() if rank == 0 else None
    dist.barrier()  # everyone starts step 0 together: times are from a common origin
    if busy is not None:
        busy.start()
    t0 = time.perf_counter()
    for i in range(start, spec.steps):
        losses.append(trainer.step(i).item())
        times.append(time.perf_counter() - t0)
        if busy is not None:
            busy.mark()
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
        **asdict(spec),
        "start_step": start,
        "restart_count": _restarts(),
        "params": params,
        "grad_bytes": params * 4,
        "bucket_bytes": bucket_bytes(trainer.model, spec.bucket_mb),
        "loss": global_loss,
        "loss_rank0": gathered[0],
        "time_s": times,
        # the machine's busy CPU seconds since the first step's start, one a step; its cores
        "busy_cpu_s": busy.series() if busy is not None else None,
        "cores": os.cpu_count(),
        "total_s": total,
        "fwd_s": trainer.fwd_s,
        "bwd_s": trainer.bwd_s,
        "voucher_wait_s": voucher_s,
    }


def main(argv: Sequence[str] | None = None) -> int:
    args, runs = parse_args(argv)
    torch.set_num_threads(args.threads)
    gs.init(backend="gloo", timeout_s=args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over {world}")
    host = int(os.environ.get("GRADSYNC_CLUSTER_HOST", "-1"))
    seen: dict[str, Any] = {"run": None, "last_step": -1, "last_step_at": time.time()}
    try:
        hosts: list[Any] = [None] * world
        dist.all_gather_object(hosts, host)
        args.hosts = len(set(hosts))
        if rank == 0:  # early, so a partition test knows who lives where before anything fails
            _write_json(f"{args.out}.hosts.json", hosts)
        warm_up(args)
        probe = probe_allreduce([int(s) for s in args.probe_sizes.split(",") if s])
        results = []
        for spec in runs:
            results.append(train_one(args, spec, seen))
            gc.collect()  # the previous run's model and buffers, before the next one is timed
    except Exception as exc:
        # Every rank says what it saw, with wall-clock times the caller can set against the
        # moment it took a link down.
        _write_json(
            f"{args.out}.try{_restarts()}.rank{rank}.error.json",
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
