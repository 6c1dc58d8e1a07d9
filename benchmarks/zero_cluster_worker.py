"""The ranks' side of ``benchmarks/zero_cluster.py``, run by torchrun on every emulated host.

Every configuration (``--config NAME=MODE[,strategy=S]``, as ``benchmarks.cluster_worker``
takes them) runs ``--repeats`` times in the same processes, the order rotated by repeat
(``benchmarks.harness.order``), because a torchrun launch across emulated hosts costs 10-20 s.
Each run is a fresh replica from the same seed: ``--warmup`` untimed steps, then ``--steps``
timed between two barriers. Every rank times its own steps and counts the bytes its host's
interface sent during the timed block; rank 0 writes all of it, per rank, to ``--out`` (JSON),
with an all-reduce probe for the alpha-beta fit and each stage's exchanges timed alone. A
configuration that raises is recorded with its error and left out of later repeats, so one
failing stage does not hide the others.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from benchmarks.cluster_worker import (
    MODES,
    RunSpec,
    bucket_bytes,
    make_trainer,
    parse_run,
    probe_allreduce,
    warm_up,
)
from benchmarks.cluster_worker import _write_json as write_json
from benchmarks.harness import ROTATE, order

# torch's flat collectives under the names this torch prefers (FSDP2's calls on gloo)
from gradsync.strategies.zero_shards import (
    all_gather_flat,
    reduce_scatter_flat,
    ring_reduce_scatter,
)


def parse_args(argv: Sequence[str] | None = None) -> tuple[argparse.Namespace, list[RunSpec]]:
    p = argparse.ArgumentParser(prog="benchmarks.zero_cluster_worker", description=__doc__)
    p.add_argument("--config", action="append", default=[], help="NAME=MODE[,key=value...]")
    p.add_argument("--params", type=int, default=3_000_000, help="mlp parameter count")
    p.add_argument("--global-batch", type=int, default=64, help="split evenly over the ranks")
    p.add_argument("--steps", type=int, default=20, help="timed steps per run")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps per run, first")
    p.add_argument("--repeats", type=int, default=3, help="runs of every configuration")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    p.add_argument("--probe-sizes", default="", help="comma-separated all-reduce sizes (bytes)")
    p.add_argument(
        "--exchange-elems",
        default="",
        help="GRAD,CHUNK: time each stage's exchanges alone on a gradient of GRAD float32 "
        "elements and zero:1/zero:2's flat buffer of CHUNK per rank",
    )
    p.add_argument("--out", required=True, help="rank 0's JSON result")
    args = p.parse_args(argv)
    if min(args.steps, args.repeats) < 1 or args.warmup < 0 or not args.config:
        p.error("need --steps >= 1, --repeats >= 1, --warmup >= 0 and at least one --config")
    # What cluster_worker's make_trainer and warm_up read: the mlp, seed 0, one thread.
    args.workload, args.seed, args.threads = "mlp", 0, 1
    args.warmup_steps = args.warmup
    defaults = RunSpec(name="default", mode=MODES[0], steps=args.steps)
    try:
        runs = [parse_run(c, defaults) for c in args.config]
    except ValueError as exc:
        p.error(str(exc))
    return args, runs


def tx_bytes() -> int | None:
    """Bytes this host's link interface has sent (``/proc/net/dev`` is per network namespace,
    so it is this emulated host's); None outside a cluster."""
    ifname = os.environ.get("GLOO_SOCKET_IFNAME")
    if not ifname:
        return None
    with open("/proc/net/dev") as f:
        for line in f:
            name, _, rest = line.partition(":")
            if name.strip() == ifname:
                return int(rest.split()[8])
    return None


def _timed(fn: Callable[[], Any], iters: int = 7) -> dict[str, Any]:
    """Seconds of each call of ``fn`` and their median (after one untimed call), each call
    between barriers so that it is the slowest rank's, and the bytes this host sent per call.
    Several calls: whether gloo runs two broadcasts in flight at once varies call by call."""
    fn()
    dist.barrier()  # the untimed call's bytes have arrived: none fall in the count below
    times = []
    sent0 = tx_bytes()
    for _ in range(iters):
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dist.barrier()
        times.append(time.perf_counter() - t0)
    sent1 = tx_bytes()
    sent = None if sent0 is None or sent1 is None else (sent1 - sent0) / iters
    return {"time_s": statistics.median(times), "times_s": times, "sent_bytes": sent}


def probe_exchanges(grad: int, chunk: int) -> dict[str, Any]:
    """Each exchange the stages make on gloo, alone, with this launch's sizes: bsp's and
    zero:1's all-reduce of the gradient, zero:1 and zero:2's parameter exchange (one broadcast
    per owner of its padded chunk, all in flight together) and zero:2's ring reduce-scatter
    of the flat buffer, FSDP2's all-gather and reduce-scatter (zero:3) of tensors of the
    gradient's size, and one chunk sent one way for reference."""
    rank, world = dist.get_rank(), dist.get_world_size()
    g, out = torch.ones(grad), torch.empty(-(-grad // world))
    full, recv = torch.ones(world * chunk), torch.empty(chunk)
    gathered = torch.empty(world * out.numel())

    def broadcasts() -> None:
        parts = [full[r * chunk : (r + 1) * chunk] for r in range(world)]
        works = [dist.broadcast(t, src=r, async_op=True) for r, t in enumerate(parts)]
        for w in works:
            w.wait()

    def one_way() -> None:
        if rank == 0:
            dist.send(full[:chunk], dst=1)
        elif rank == 1:
            dist.recv(recv, src=0)

    return {
        "allreduce": _timed(lambda: dist.all_reduce(g)),
        "broadcasts": _timed(broadcasts),
        "ring_reduce_scatter": _timed(lambda: ring_reduce_scatter(recv, full, rank, world)),
        "all_gather_into_tensor": _timed(lambda: all_gather_flat(gathered, out)),
        "reduce_scatter_tensor": _timed(
            lambda: reduce_scatter_flat(out, torch.ones(world * out.numel()))
        ),
        "one_way": _timed(one_way),
    }


def run_once(args: argparse.Namespace, spec: RunSpec) -> dict[str, Any]:
    """One fresh replica of ``spec``: warm-up, then the timed block; this rank's view."""
    trainer = make_trainer(args, spec)
    for i in range(args.warmup):
        trainer.step(i)
    losses, step_s = [], []
    dist.barrier()  # every rank starts the block together: its time is the slowest's
    sent0, t0 = tx_bytes(), time.perf_counter()
    for i in range(args.warmup, args.warmup + args.steps):
        s0 = time.perf_counter()
        losses.append(trainer.step(i).item())
        step_s.append(time.perf_counter() - s0)
    dist.barrier()
    block_s = time.perf_counter() - t0
    sent1 = tx_bytes()
    if trainer.sync is not None:
        # The report is a collective that also checks the replicas agree; outside the timed
        # block, as DDP has no counterpart.
        trainer.sync.report()
        trainer.sync.close()
    warm = args.warmup
    return {
        "block_s": block_s,
        "step_s": step_s,
        "loss": losses,
        "sent_bytes": None if sent0 is None or sent1 is None else sent1 - sent0,
        # compute-only times forward and backward apart: the backward share is what a
        # bucketed exchange can hide behind
        "fwd_s": trainer.fwd_s[warm:],
        "bwd_s": trainer.bwd_s[warm:],
        "bucket_bytes": bucket_bytes(trainer.model, spec.bucket_mb) if spec.mode != "ddp" else [],
    }


def run_all(args: argparse.Namespace, runs: list[RunSpec]) -> dict[str, Any]:
    """Every configuration in every repeat; per configuration, per repeat, every rank's view
    (gathered once per run, outside the timed block), or the error that stopped it."""
    results: dict[str, Any] = {r.name: {"repeats": [], "error": None} for r in runs}
    for rep in range(args.repeats):
        for spec in order(runs, rep, ROTATE):
            entry = results[spec.name]
            if entry["error"] is not None:
                continue
            try:
                mine: Any = run_once(args, spec)
            except Exception as exc:  # noqa: BLE001 - recorded and reported, not hidden
                mine = {"error": f"{type(exc).__name__}: {exc}", "trace": traceback.format_exc()}
                print(f"rank {dist.get_rank()}: {spec.name} failed\n{mine['trace']}", flush=True)
            views: list[Any] = [None] * dist.get_world_size()
            dist.all_gather_object(views, mine)
            errors = [v["error"] for v in views if "error" in v]
            if errors:
                entry["error"] = f"repeat {rep + 1}: {errors[0]}"
            else:
                entry["repeats"].append({"repeat": rep, "ranks": views})
            gc.collect()  # the finished replica and its buffers, before the next run is timed
    return results


def main(argv: Sequence[str] | None = None) -> int:
    args, runs = parse_args(argv)
    torch.set_num_threads(args.threads)
    gs.init(backend="gloo", timeout_s=args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if args.global_batch % world:
        raise SystemExit(f"--global-batch {args.global_batch} does not split over {world}")
    hosts: list[Any] = [None] * world
    dist.all_gather_object(hosts, int(os.environ.get("GRADSYNC_CLUSTER_HOST", "-1")))
    warm_up(args)
    probe = probe_allreduce([int(s) for s in args.probe_sizes.split(",") if s])
    exchanges = {}
    if args.exchange_elems:
        grad, chunk = (int(v) for v in args.exchange_elems.split(","))
        exchanges = probe_exchanges(grad, chunk)
    results = run_all(args, runs)
    if rank == 0:
        write_json(
            args.out,
            {
                "world_size": world,
                "hosts_by_rank": hosts,
                "link": os.environ.get("GRADSYNC_CLUSTER_LINK"),
                "global_batch": args.global_batch,
                "params": args.params,
                "steps": args.steps,
                "warmup": args.warmup,
                "repeats": args.repeats,
                "configs": [{"name": r.name, "mode": r.mode, "strategy": r.strategy} for r in runs],
                "probe": probe,
                "exchanges": exchanges,
                "results": results,
            },
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
