"""Time all-reduces under torchrun and report bandwidth the way nccl-tests does.

    python -m torch.distributed.run ... -m gradsync.cluster.allreduce_probe --size-mb 8 --out r.json

``algbw`` = bytes / time. ``busbw`` = algbw * 2(n-1)/n: a ring all-reduce sends (and receives)
2(n-1)/n of the buffer per rank, so busbw is the rate each rank's link actually carried and
is comparable with the link's rate whatever n is.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import sys
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="allreduce_probe", description=__doc__)
    p.add_argument("--size-mb", type=float, default=8.0, help="buffer size, 10^6 bytes")
    p.add_argument("--iters", type=int, default=3, help="timed all-reduces")
    p.add_argument("--warmup", type=int, default=1, help="untimed all-reduces first")
    p.add_argument("--timeout", type=float, default=120.0, help="collective timeout, seconds")
    p.add_argument(
        "--out", default=None, help="rank 0 writes the JSON result here (default: stdout)"
    )
    args = p.parse_args(argv)
    if args.size_mb <= 0 or args.iters < 1 or args.warmup < 0:
        p.error("need --size-mb > 0, --iters >= 1, --warmup >= 0")
    return args


def measure(size_bytes: int, iters: int, warmup: int) -> dict[str, Any]:
    """Collective: every rank must call it. Times are the slowest rank's per iteration."""
    n = dist.get_world_size()
    buf = torch.ones(max(1, size_bytes // 4), dtype=torch.float32)
    nbytes = buf.numel() * 4
    for _ in range(warmup):
        dist.all_reduce(buf)
    times = []
    for _ in range(iters):
        dist.barrier()  # start together, so the time is the collective's, not a late arrival's
        t0 = time.perf_counter()
        dist.all_reduce(buf)
        times.append(time.perf_counter() - t0)
    slowest = torch.tensor(times, dtype=torch.float64)
    dist.all_reduce(slowest, op=dist.ReduceOp.MAX)
    per_iter = slowest.tolist()
    t = statistics.median(per_iter)
    algbw = nbytes / t
    busbw = algbw * 2 * (n - 1) / n
    where = [None] * n
    dist.all_gather_object(where, _where())
    return {
        "world_size": n,
        "bytes": nbytes,
        "iters": iters,
        "times_s": per_iter,
        "time_s": t,
        "algbw_Bps": algbw,
        "busbw_Bps": busbw,
        "busbw_bps": busbw * 8,
        "ranks": where,
    }


def _where() -> dict[str, Any]:
    return {
        "host": os.environ.get("GRADSYNC_CLUSTER_HOST"),
        "ifname": os.environ.get("GLOO_SOCKET_IFNAME"),
        "pid": os.getpid(),
        "hostname": socket.gethostname(),
    }


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    dist.init_process_group("gloo", timeout=timedelta(seconds=args.timeout))
    try:
        result = measure(int(args.size_mb * 1e6), args.iters, args.warmup)
        result["link"] = os.environ.get("GRADSYNC_CLUSTER_LINK")
        if dist.get_rank() == 0:
            text = json.dumps(result)
            if args.out:
                with open(args.out, "w") as f:
                    f.write(text + "\n")
            else:
                print(text, flush=True)
    finally:
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
