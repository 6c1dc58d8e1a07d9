"""One launch of the hierarchical all-reduce benchmark, for ``benchmarks/topology.py``: run by
torchrun on the emulated hosts with several ranks per host.

In one launch, so that torchrun's start (10-30 s with 8 ranks on 2 cores) is paid once:

0. the rank placement (``--placement``): ``contiguous`` keeps torchrun's numbering (node n's
   ranks are n L .. n L + L - 1, the ranks of a host adjacent in the flat ring); ``cyclic``
   numbers the ranks round robin over the hosts, as a scheduler's cyclic distribution does
   (SLURM's ``--distribution=cyclic``): global rank r sits on host r % H, so every hop of
   gloo's flat ring (which follows rank order) crosses hosts. The worker sets ``RANK`` to its
   cyclic rank before ``gs.init()`` joins the group through env:// (rank 0 is the same
   process either way) and ``GRADSYNC_HOST`` to its node, so that ``Hierarchy`` groups it
   with the ranks of its own host; then it checks the placement against the network
   namespace every rank runs in, and that the hierarchical sum of distinct random tensors
   equals the flat one (and a float64 reference) to float tolerance;
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
import zlib
from collections import Counter
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
PLACEMENTS = ("contiguous", "cyclic")
SUM_RTOL = SUM_ATOL = 1e-5  # float32 sums of 8 N(0, 1) values in another order differ by ~1e-6


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="benchmarks.topology_worker", description=__doc__)
    p.add_argument("--nbytes", type=int, default=12_000_000, help="all-reduce size, bytes")
    p.add_argument("--placement", choices=PLACEMENTS, default="contiguous", help="rank order")
    p.add_argument("--iters", type=int, default=12, help="timed all-reduces of each kind")
    p.add_argument("--probe-sizes", default="1048576,4194304,16777216", help="bytes, for fits")
    p.add_argument("--probe-iters", type=int, default=3)
    p.add_argument("--params", type=int, default=3_000_000, help="mlp parameter count")
    p.add_argument("--global-batch", type=int, default=64)
    p.add_argument(
        "--step-repeats", type=int, default=3, help="blocks of steps per config (0: no steps)"
    )
    p.add_argument("--block", type=int, default=4, help="steps per timed block")
    p.add_argument("--bucket-mb", type=float, default=25.0)
    p.add_argument("--timeout", type=float, default=300.0, help="collective timeout, seconds")
    p.add_argument("--out", required=True)
    return p.parse_args(argv)


# Placement -------------------------------------------------------------------------------------


def placement_rank(placement: str, node: int, local: int, hosts: int, per_host: int) -> int:
    """The global rank of local rank ``local`` on node ``node`` (of ``hosts`` nodes of
    ``per_host`` ranks): torchrun's node-major numbering, or round robin over the nodes."""
    if not (0 <= node < hosts and 0 <= local < per_host):
        raise ValueError(f"node {node} local {local} outside {hosts} x {per_host}")
    if placement == "contiguous":
        return node * per_host + local
    if placement == "cyclic":
        return local * hosts + node
    raise ValueError(f"unknown placement {placement!r}; valid: {', '.join(PLACEMENTS)}")


def host_of_rank(placement: str, rank: int, hosts: int, per_host: int) -> int:
    """The node that global rank ``rank`` sits on under ``placement`` (``placement_rank``'s
    inverse in its node)."""
    if not 0 <= rank < hosts * per_host:
        raise ValueError(f"rank {rank} outside {hosts} x {per_host}")
    if placement == "contiguous":
        return rank // per_host
    if placement == "cyclic":
        return rank % hosts
    raise ValueError(f"unknown placement {placement!r}; valid: {', '.join(PLACEMENTS)}")


def ring_crossings(hosts_by_rank: Sequence[object]) -> int:
    """How many edges of a ring in rank order (rank r sends to r + 1 mod N, as gloo's ring
    all-reduce does) leave or enter the busiest host: the number of ring streams that share
    one host's link at every step (1 with the ranks of a host adjacent, L with cyclic ranks,
    0 on one host). ``hosts_by_rank[r]`` names rank r's host."""
    n = len(hosts_by_rank)
    out: Counter[object] = Counter()
    into: Counter[object] = Counter()
    for r in range(n):
        a, b = hosts_by_rank[r], hosts_by_rank[(r + 1) % n]
        if a != b:
            out[a] += 1
            into[b] += 1
    return max([*out.values(), *into.values()], default=0)


def take_placement(placement: str) -> dict[str, Any]:
    """Before ``gs.init()``: this process's rank under ``placement``, from torchrun's node and
    local rank, put where env:// reads it (``RANK``); under cyclic, ``GRADSYNC_HOST`` names
    the node, so that ``Hierarchy`` groups the ranks by host whatever their numbers."""
    env = os.environ
    node, local = int(env["GROUP_RANK"]), int(env["LOCAL_RANK"])
    hosts, per_host = int(env["GROUP_WORLD_SIZE"]), int(env["LOCAL_WORLD_SIZE"])
    torchrun_rank = int(env["RANK"])
    if torchrun_rank != placement_rank("contiguous", node, local, hosts, per_host):
        raise RuntimeError(
            f"torchrun gave rank {torchrun_rank} to node {node} local {local}: not node-major"
        )
    rank = placement_rank(placement, node, local, hosts, per_host)
    env["RANK"] = str(rank)
    if placement != "contiguous":
        env["GRADSYNC_HOST"] = f"node{node}"
    return {
        "rank": rank,
        "node": node,
        "local": local,
        "hosts": hosts,
        "per_host": per_host,
        "torchrun_rank": torchrun_rank,
    }


def netns_id() -> str:
    """The network namespace this process runs in (``net:[inode]``): its emulated host."""
    try:
        return os.readlink("/proc/self/ns/net")
    except OSError:
        return "unknown"


def check_placement(
    placement: str, where: Sequence[dict[str, Any]], layout: Sequence[Sequence[int]]
) -> list[str]:
    """What is wrong with the ranks' placement (empty: nothing). ``where[r]`` is rank r's
    ``take_placement`` record with its ``netns`` and ``cluster_host`` (the launcher's host
    index); ``layout`` is ``Hierarchy``'s hosts. Rank r must sit on node
    ``host_of_rank(placement, r)``, ranks must share a network namespace (and cluster host)
    exactly when they share a node, and ``Hierarchy`` must group them the same way."""
    problems = []
    world = len(where)
    hosts, per_host = where[0]["hosts"], where[0]["per_host"]
    if world != hosts * per_host:
        problems.append(f"world {world} is not {hosts} hosts x {per_host}")
        return problems
    for r, w in enumerate(where):
        want = host_of_rank(placement, r, hosts, per_host)
        if w["rank"] != r or w["node"] != want:
            problems.append(f"rank {r} reports rank {w['rank']} on node {w['node']}, not {want}")
    by_node: dict[int, set[int]] = {}
    by_ns: dict[str, set[int]] = {}
    by_cluster: dict[str, set[int]] = {}
    for r, w in enumerate(where):
        by_node.setdefault(w["node"], set()).add(r)
        by_ns.setdefault(str(w["netns"]), set()).add(r)
        by_cluster.setdefault(str(w["cluster_host"]), set()).add(r)
    nodes = sorted(sorted(m) for m in by_node.values())
    for name, got in (("network namespace", by_ns), ("cluster host", by_cluster)):
        if sorted(sorted(m) for m in got.values()) != nodes:
            problems.append(f"ranks by {name} {sorted(map(sorted, got.values()))} != nodes {nodes}")
    if sorted(sorted(m) for m in layout) != nodes:
        problems.append(f"Hierarchy's hosts {list(layout)} != nodes {nodes}")
    return problems


def check_sum(h: Hierarchy, nbytes: int) -> dict[str, Any]:
    """Distinct random tensors on every rank: flat and hierarchical sums agree to float
    tolerance on every rank, rank 0's both agree with a float64 sum of every rank's tensor
    (made again from their seeds), and every rank ends with the same hierarchical bytes."""
    rank, world = dist.get_rank(), dist.get_world_size()

    def tensor(r: int) -> torch.Tensor:
        return torch.randn(nbytes // 4, generator=torch.Generator().manual_seed(1000 + r))

    mine = tensor(rank)
    flat, hier = mine.clone(), mine.clone()
    dist.all_reduce(flat)
    h.sum(hier)
    pairs = [(flat, hier)]
    diffs = [float((flat - hier).abs().max()), 0.0, 0.0, 0.0]
    if rank == 0:
        ref = torch.zeros(mine.numel(), dtype=torch.float64)
        for r in range(world):
            ref += tensor(r).double()
        pairs += [(flat.double(), ref), (hier.double(), ref)]
        diffs[1:] = [float((a - ref).abs().max()) for a, _ in pairs[1:]] + [float(ref.abs().max())]
    close = all(bool(torch.allclose(a, b, rtol=SUM_RTOL, atol=SUM_ATOL)) for a, b in pairs)
    got = torch.tensor(diffs, dtype=torch.float64)
    dist.all_reduce(got, op=dist.ReduceOp.MAX)
    bad = torch.tensor([0 if close else 1])
    dist.all_reduce(bad)
    crcs: list[Any] = [None] * world
    dist.all_gather_object(crcs, zlib.crc32(hier.numpy().tobytes()))
    return {
        "elements": mine.numel(),
        "ranks_not_close": int(bad.item()),
        "max_abs_flat_vs_hier": float(got[0]),
        "max_abs_flat_vs_float64": float(got[1]),
        "max_abs_hier_vs_float64": float(got[2]),
        "max_abs_sum": float(got[3]),
        "hier_identical_on_every_rank": len(set(crcs)) == 1,
        "rtol": SUM_RTOL,
        "atol": SUM_ATOL,
    }


# Timing ----------------------------------------------------------------------------------------


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


def step_times(args: argparse.Namespace) -> dict[str, Any] | None:
    """Mean step time per block and configuration (slowest rank), interleaved; None with
    ``--step-repeats 0``."""
    if args.step_repeats < 1:
        return None
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
    me = take_placement(args.placement)
    gs.init(backend="gloo", timeout_s=args.timeout)
    rank, world = dist.get_rank(), dist.get_world_size()
    if rank != me["rank"]:
        raise RuntimeError(f"asked for rank {me['rank']} under {args.placement}, got {rank}")
    me.update(
        netns=netns_id(), cluster_host=os.environ.get("GRADSYNC_CLUSTER_HOST"), key=host_key()
    )
    where: list[Any] = [None] * world
    dist.all_gather_object(where, me)
    h = Hierarchy(timeout_s=args.timeout)
    problems = check_placement(args.placement, where, h.layout.hosts)
    if problems:
        raise RuntimeError(f"{args.placement} placement is not as asked: {'; '.join(problems)}")
    sums = check_sum(h, args.nbytes)
    if sums["ranks_not_close"] or not sums["hier_identical_on_every_rank"]:
        raise RuntimeError(f"hierarchical sum differs from the flat one: {sums}")
    sizes = [int(s) for s in args.probe_sizes.split(",") if s]
    t0 = time.monotonic()
    result: dict[str, Any] = {
        "world_size": world,
        "hosts": h.hosts,
        "placement": args.placement,
        "layout": h.layout.hosts,
        "where_by_rank": where,
        "ring_crossings": ring_crossings([w["netns"] for w in where]),
        "sum_check": sums,
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
