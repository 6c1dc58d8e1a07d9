"""The parameter server's transport: a push/pull round trip against an all-reduce of the same bytes.

Two layouts: 1 worker + 1 server (the all-reduce between the same two processes) and 2 workers
+ 1 server (both workers push and pull at once through the one server; the all-reduce between
the two workers alone, what BSP would do with them). Where ``torch.distributed.rpc`` starts, a
third method sends the tensor with ``rpc_sync`` to a server function that returns it.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from benchmarks.harness import Harness, machine, span, table, time_interleaved
from gradsync.processes.launch import launch

SIZES = (4 << 10, 64 << 10, 1 << 20, 4 << 20, 16 << 20)  # bytes
BLOCK_BYTES = 16 << 20  # a block moves about this much per method, so small sizes repeat more
MAX_ROUNDS = 100  # small messages are latency-bound: 100 round trips already time them well
METHODS = ("push/pull", "all-reduce", "rpc")
RPC_TIMEOUT_S = 60.0
TIMES = "{:.2f}x"  # how a ratio to all-reduce prints
Round = Callable[[int], None]  # one round trip (the index time_interleaved passes is unused)


def _size_label(nbytes: int) -> str:
    return f"{nbytes >> 20} MiB" if nbytes >= 1 << 20 else f"{nbytes >> 10} KiB"


def _echo(t: torch.Tensor) -> torch.Tensor:
    """Runs on the server under rpc: returning the pushed tensor is the pull."""
    return t


def _push_pull(numel: int, workers: int) -> Round:
    """One round: every worker sends S bytes to the server (the last rank) and receives S back.

    The server posts a receive from every worker and answers each as its push arrives, in
    worker order; gradsync's server answers from one thread per worker, which this sequential
    loop approximates for workers that push at the same moment.
    """
    rank, server = dist.get_rank(), dist.get_world_size() - 1
    if rank == server:
        bufs = [torch.empty(numel) for _ in range(workers)]

        def serve(_i: int) -> None:
            recvs = [dist.irecv(bufs[w], src=w) for w in range(workers)]
            sends = []
            for w, work in enumerate(recvs):
                work.wait()
                sends.append(dist.isend(bufs[w], dst=w))
            for work in sends:
                work.wait()

        return serve
    push, pull = torch.ones(numel), torch.empty(numel)

    def round_trip(_i: int) -> None:
        sent = dist.isend(push, dst=server)
        got = dist.irecv(pull, src=server)
        sent.wait()
        got.wait()

    return round_trip


def _all_reduce(numel: int, group: dist.ProcessGroup | None, member: bool) -> Round:
    buf = torch.ones(numel)

    def step(_i: int) -> None:
        if member:  # the server of the 3-process layout is not in the workers' group
            dist.all_reduce(buf, group=group)

    return step


def _rpc(numel: int, server_name: str, is_server: bool) -> Round:
    import torch.distributed.rpc as rpc

    push = torch.ones(numel)

    def step(_i: int) -> None:
        if not is_server:  # the server's rpc agent answers from its own threads
            rpc.rpc_sync(server_name, _echo, args=(push,))

    return step


def _start_rpc(store_file: str, rank: int, world: int) -> bool:
    """Start an rpc agent on every rank (a FileStore rendezvous: the launcher's store is taken);
    False everywhere if any rank failed, so no rank waits on an agent that is not there."""
    import torch.distributed.rpc as rpc

    ok = True
    try:
        rpc.init_rpc(
            f"rank{rank}",
            rank=rank,
            world_size=world,
            rpc_backend_options=rpc.TensorPipeRpcBackendOptions(
                init_method=f"file://{store_file}", rpc_timeout=RPC_TIMEOUT_S
            ),
        )
    except Exception as exc:  # noqa: BLE001 - any failure means "rpc not measured here"
        print(f"rank {rank}: rpc unavailable: {str(exc).splitlines()[0]}", file=sys.stderr)
        ok = False
    flag = torch.tensor([1 if ok else 0])
    dist.all_reduce(flag, op=dist.ReduceOp.MIN)
    if ok and not flag.item():
        rpc.shutdown(graceful=False)
    return bool(flag.item())


def worker(args: dict[str, Any]) -> dict[str, Any] | None:
    gs.init(backend="gloo")
    torch.set_num_threads(1)
    rank, world = dist.get_rank(), dist.get_world_size()
    workers = world - 1
    server = world - 1
    # The all-reduce runs among the workers only: with one worker (2 processes) that would be
    # no exchange at all, so the 2-process layout all-reduces between both processes.
    if workers > 1:
        group = dist.new_group(list(range(workers)))
        member = rank < workers
    else:
        group, member = None, True
    use_rpc = args["rpc"] and _start_rpc(args["store"], rank, world)
    results: dict[int, dict[str, list[float]]] = {}
    for nbytes in args["sizes"]:
        numel = nbytes // 4
        fns = {
            "push/pull": _push_pull(numel, workers),
            "all-reduce": _all_reduce(numel, group, member),
        }
        if use_rpc:
            fns["rpc"] = _rpc(numel, f"rank{server}", rank == server)
        rounds = max(3, min(MAX_ROUNDS, BLOCK_BYTES // nbytes))
        # Seconds per round trip of every block, by method, in repeat order.
        results[nbytes] = time_interleaved(fns, args["repeats"], rounds)
    if use_rpc:
        import torch.distributed.rpc as rpc

        rpc.shutdown()
    if rank != 0:
        return None
    return {
        nbytes: {k: statistics.median(v) for k, v in times.items()}
        for nbytes, times in results.items()
    }


def _layout_table(res: dict[int, dict[str, float]]) -> str:
    methods = [m for m in METHODS if all(m in res[n] for n in res)]
    header = ["message"]
    for m in methods:
        header += [f"{m} ms", f"{m} MB/s"]
    header += [f"{m} / all-reduce" for m in methods if m != "all-reduce"]
    rows = []
    for nbytes, t in res.items():
        row = [_size_label(nbytes)]
        for m in methods:
            row += [f"{t[m] * 1e3:.3f}", f"{nbytes / t[m] / 1e6:,.0f}"]
        row += [f"{t[m] / t['all-reduce']:.2f}" for m in methods if m != "all-reduce"]
        rows.append(row)
    return table(header, rows)


def _ratios(res: dict[int, dict[str, float]], method: str, min_bytes: int = 0) -> list[float]:
    return [t[method] / t["all-reduce"] for n, t in res.items() if method in t and n >= min_bytes]


def findings(layouts: dict[str, dict[int, dict[str, float]]]) -> str:
    """Sentences generated from the measured medians."""
    out = []
    big = 1 << 20
    for name, res in layouts.items():
        pp = _ratios(res, "push/pull", big)
        small = _ratios(res, "push/pull")[0]
        text = (
            f"{name}: a push/pull round trip takes {span(pp, TIMES)} the time of an all-reduce of "
            f"the same bytes from 1 MiB up ({small:.2f}x at {_size_label(min(res))})"
        )
        rpc = _ratios(res, "rpc", big)
        if rpc:
            text += (
                f"; rpc takes {span(rpc, TIMES)} ({_ratios(res, 'rpc')[0]:.2f}x at the smallest)"
            )
        out.append(text + ".")
    return " ".join(out)


def render(
    layouts: dict[str, dict[int, dict[str, float]]], args: argparse.Namespace, command: str
) -> str:
    rpc_note = (
        ""
        if any("rpc" in t for res in layouts.values() for t in res.values())
        else " torch.distributed.rpc did not start on this machine, so it has no column."
    )
    tables = "\n\n".join(f"{name}:\n\n{_layout_table(res)}" for name, res in layouts.items())
    return (
        "## Parameter-server transport: push/pull against all-reduce (issue 3)\n\n"
        f"Command: `{command}` (repeats {args.repeats}). Machine: {machine()}. gloo on "
        "loopback, 1 thread per process, float32 messages. `push/pull`: a worker `isend`s S "
        "bytes to the server and `irecv`s S bytes back (the parameter server's step); "
        "`all-reduce`: `dist.all_reduce` of S bytes among the workers (between both processes "
        "when there is one worker); `rpc`: `torch.distributed.rpc.rpc_sync` of the S-byte "
        "tensor to a server function that returns it. Time of one round trip on worker rank 0 "
        "(mean of a block between barriers), median over interleaved repeats with the order "
        "rotated; MB/s is S over that time; the ratio columns divide by the all-reduce time in "
        f"the same run.{rpc_note}\n\n"
        f"{tables}\n\n{findings(layouts)}\n"
    )


def main() -> None:
    h = Harness("benchmarks.ps_transport", __doc__, repeats=7)
    h.parser.add_argument("--no-rpc", dest="rpc", action="store_false", help="skip rpc")
    h.parser.set_defaults(sizes=SIZES)
    args = h.parse(repeats=2, sizes=SIZES[::2])
    sizes = args.sizes
    layouts = {}
    with tempfile.TemporaryDirectory(prefix="gradsync-ps-transport-") as tmp:
        for name, nproc in (("1 worker + 1 server", 2), ("2 workers + 1 server", 3)):
            print(f"{name} ({time.strftime('%H:%M:%S')})", file=sys.stderr, flush=True)
            opts = {
                "sizes": sizes,
                "repeats": args.repeats,
                "rpc": args.rpc,
                "store": os.path.join(tmp, f"rpc-{nproc}"),
            }
            layouts[name] = launch(worker, (opts,), nproc=nproc)[0]
    h.finish(render(layouts, args, h.command()))


if __name__ == "__main__":
    main()
