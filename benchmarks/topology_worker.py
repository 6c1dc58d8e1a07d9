"""One launch of the hierarchical all-reduce benchmark, for ``benchmarks/topology.py``: run by
torchrun on the emulated hosts with several ranks per host.

In one launch, so that torchrun's start (10-30 s with 8 ranks on 2 cores) is paid once:

1. probes for the simulator: the leaders' all-reduce (one rank per host, across the slow
   links) and a host's reduce-then-broadcast (inside every host at once), at a few sizes;
2. all-reduce of ``--nbytes`` float32: a flat ``dist.all_reduce`` over the world against
   ``gradsync.topology.Hierarchy.sum``, alternating (which goes first alternates too);
3. training steps of the mlp workload under torch DDP, gradsync bsp (ring), gradsync bsp
   hierarchical and compute-only, in interleaved blocks (``benchmarks.harness``).

Every time is the slowest rank's. Rank 0 writes ``--out`` (JSON).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from benchmarks.harness import time_interleaved
from benchmarks.steps import Trainer
from gradsync.topology import Hierarchy, host_key
from gradsync.workloads import make_workload

STEP_CONFIGS = ("ddp", "ring", "hierarchical", "compute-only")


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.topology_worker", description=__doc__)
    p.add_argument("--nbytes", type=int, default=12_000_000, help="all-reduce size, bytes")
    p.add_argument("--iters", type=int, default=12, help="timed all-reduces of each kind")
    p.add_argument("--probe-sizes", default="1048576,4194304,16777216", help="bytes, for fits")
    p.add_argument("--probe-iters", type=int, default=3)
    p.add_argument("--params", type=int, default=3_000_000, help="mlp parameter count")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument("--step-repeats", type=int, default=3, help="blocks of steps per config")
    p.add_argument("--block", type=int, default=4, help="steps per timed block")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


def slowest(times: list[float]) -> list[float]:
    """Per entry, the largest of every rank's (collective)."""
    t = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return [float(x) for x in t.tolist()]


def timed(fn: Callable[[], Any]) -> float:
    """Seconds of ``fn`` on this rank, started behind a barrier so that no rank's time is
    another's late arrival."""
    dist.barrier()
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def probe(h: Hierarchy, sizes: list[int], iters: int) -> dict[str, list[dict[str, Any]]]:
    """Times of the two levels alone, median over ``iters`` (after one untimed call): the
    leaders' all-reduce, other ranks idle; every host's reduce to its leader then broadcast
    back, all hosts at once as in the hierarchical all-reduce (they share the CPU)."""
    # Our own groups with the Hierarchy's layout: its groups are private to it.
    leaders = dist.new_group(h.leaders)
    hosts = [dist.new_group(m) for m in h.layout.hosts]
    mine = hosts[[h.leader in m for m in h.layout.hosts].index(True)]
    out: dict[str, list[dict[str, Any]]] = {"leaders_allreduce": [], "host_reduce_bcast": []}
    for size in sizes:
        buf = torch.ones(size // 4)

        def across(buf: torch.Tensor = buf) -> None:
            if h.is_leader:
                dist.all_reduce(buf, group=leaders)

        def within(buf: torch.Tensor = buf) -> None:
            dist.reduce(buf, dst=h.leader, group=mine)
            dist.broadcast(buf, src=h.leader, group=mine)

        for key, fn in (("leaders_allreduce", across), ("host_reduce_bcast", within)):
            fn()
            ts = slowest([timed(fn) for _ in range(iters)])
            out[key].append({"bytes": buf.numel() * 4, "times_s": ts})
    return out


def tx_bytes() -> int:
    """Bytes this host has sent on its link so far (both its ranks share it); -1 if unknown.
    ``ip netns exec`` mounts the namespace's own sysfs, so this is the emulated host's port."""
    try:
        path = f"/sys/class/net/{os.environ['GLOO_SOCKET_IFNAME']}/statistics/tx_bytes"
        with open(path) as f:
            return int(f.read())
    except (KeyError, OSError, ValueError):
        return -1


def allreduce_pair(h: Hierarchy, nbytes: int, iters: int) -> dict[str, list[float]]:
    """Flat against hierarchical, alternating, each call behind a barrier; the first of a
    pair alternates too, so neither always runs on a just-warmed cache. Also the bytes each
    host sent across its link per call (the leader reads them), largest over hosts."""
    buf = torch.ones(nbytes // 4)
    kinds: dict[str, Callable[[], Any]] = {
        "flat": lambda: dist.all_reduce(buf),
        "hierarchical": lambda: h.sum(buf),
    }
    for fn in kinds.values():  # untimed: connections, allocator
        fn()
    got: dict[str, list[float]] = {k: [] for k in kinds}
    sent: dict[str, list[float]] = {k: [] for k in kinds}
    for i in range(iters):
        names = list(kinds) if i % 2 == 0 else list(kinds)[::-1]
        for k in names:
            buf.fill_(1.0)
            before = tx_bytes()
            got[k].append(timed(kinds[k]))
            dist.barrier()  # every rank of the host done sending before the leader reads
            sent[k].append(float(tx_bytes() - before) if h.is_leader and before >= 0 else 0.0)
            # A sum of ones over every rank: the time is of a real all-reduce, not a no-op.
            if not bool((buf == dist.get_world_size()).all()):
                raise RuntimeError(f"{k} all-reduce gave {buf[:4].tolist()}, not the world size")
    return {
        **{k: slowest(v) for k, v in got.items()},
        **{f"{k}_sent_bytes": slowest(v) for k, v in sent.items()},
    }


def step_times(args: argparse.Namespace) -> dict[str, Any]:
    """Mean step time per block and configuration (slowest rank), interleaved."""
    trainers = {}
    for name in STEP_CONFIGS:
        workload = make_workload("mlp", seed=0, params=args.params)
        mode = {"ddp": "ddp", "compute-only": "compute-only"}.get(name, "gradsync")
        opts: dict[str, Any] = {} if mode != "gradsync" else {"allreduce": name}
        trainers[name] = Trainer(
            mode,
            workload,
            args.global_batch,
            bucket_mb=args.bucket_mb,
            report_loss=False,
            timeout_s=args.timeout,
            **opts,
        )
    steps = {name: t.step for name, t in trainers.items()}
    blocks = time_interleaved(steps, args.step_repeats, args.block, warmup=2)
    params = sum(p.numel() for p in trainers["ddp"].model.parameters())
    for t in trainers.values():
        if t.sync is not None:
            t.sync.close()
    return {"blocks_s": {k: slowest(v) for k, v in blocks.items()}, "grad_bytes": 4 * params}


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    gs.init(backend="gloo", timeout_s=args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    where: list[Any] = [None] * world
    dist.all_gather_object(where, [os.environ.get("GRADSYNC_CLUSTER_HOST"), host_key()])
    h = Hierarchy(timeout_s=args.timeout)
    sizes = [int(s) for s in args.probe_sizes.split(",") if s]
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "world_size": world,
        "hosts": h.hosts,
        "layout": h.layout.hosts,
        "where_by_rank": where,
        "link": os.environ.get("GRADSYNC_CLUSTER_LINK"),
        "probe": probe(h, sizes, args.probe_iters),
        "allreduce": allreduce_pair(h, args.nbytes, args.iters),
        "nbytes": args.nbytes // 4 * 4,
    }
    result["steps"] = step_times(args)
    result["global_batch"] = args.global_batch
    result["block"] = args.block
    result["worker_s"] = time.monotonic() - t0
    h.close()
    if rank == 0:
        tmp = f"{args.out}.tmp"
        with open(tmp, "w") as f:
            json.dump(result, f)
        os.replace(tmp, args.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
