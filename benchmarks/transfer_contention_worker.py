"""The ranks' side of ``benchmarks.transfer_contention``: the frontier's mlp steps (3M
parameters, 32 samples a rank, plain SGD, one thread) timed with nothing else running, while a
gloo all-reduce runs in a thread of the same process, and while a plain TCP stream of the same
bytes runs in both directions between the two ranks (threads of the same process, which spend
their time in the kernel's socket calls). Each transfer is fixed (``--mb`` MB, ``--times``
times); the steps run until it ends. Rank r writes ``--out``.r.json.

``python -m benchmarks.transfer_contention_worker --mb 3 --times 6 --repeats 7 --out F``
under torchrun, 2 ranks.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from gradsync.workloads import make_workload

CONDITIONS = ("none", "gloo", "socket")
STEPS_ALONE = 30  # steps timed under "none"


def _connect(rank: int) -> socket.socket:
    """A TCP connection between the two ranks (rank 0 listens on its address: MASTER_ADDR)."""
    server = None
    port = 0
    if rank == 0:
        server = socket.create_server(("0.0.0.0", 0))
        port = server.getsockname()[1]
    ports: list[Any] = [None, None]
    dist.all_gather_object(ports, port)
    if server is not None:
        conn, _ = server.accept()
        server.close()
    else:
        conn = socket.create_connection((os.environ["MASTER_ADDR"], ports[0]))
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return conn


def _transfers(nbytes: int, times: int, conn: socket.socket) -> dict[str, Callable[[], None]]:
    group = dist.new_group(backend="gloo")  # not the default group, which the barriers use
    buf = torch.ones(nbytes // 4)
    payload = b"x" * nbytes

    def gloo() -> None:
        for _ in range(times):
            dist.all_reduce(buf, group=group)

    def stream() -> None:
        # An all-reduce of 2 ranks sends its bytes once each way: so does this.
        total = nbytes * times

        def receive() -> None:
            got = 0
            while got < total:
                got += len(conn.recv(min(1 << 20, total - got)))

        reader = threading.Thread(target=receive)
        reader.start()
        for _ in range(times):
            conn.sendall(payload)
        reader.join()

    return {"gloo": gloo, "socket": stream}


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--mb", type=float, default=3.0, help="MB per transfer")
    p.add_argument("--times", type=int, default=6, help="transfers, one after another")
    p.add_argument("--repeats", type=int, default=7)
    p.add_argument("--out", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo")
    torch.set_num_threads(1)
    rank = dist.get_rank()
    w = make_workload("mlp", params=3_000_000)
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    done = [0]

    def step() -> None:
        x, y = w.batch(done[0], 64, 32 * rank, 32 * rank + 32)
        done[0] += 1
        w.loss(model, x, y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    for _ in range(5):
        step()
    conn = _connect(rank)
    transfers = _transfers(int(args.mb * 2**20), args.times, conn)
    blocks: dict[str, list[dict[str, float]]] = {c: [] for c in CONDITIONS}
    for r in range(args.repeats):
        for cond in CONDITIONS[r % 3 :] + CONDITIONS[: r % 3]:
            dist.barrier()
            cpu0, own0, t0 = time.process_time(), time.thread_time(), time.perf_counter()
            steps = 0
            if cond == "none":
                while steps < STEPS_ALONE:
                    step()
                    steps += 1
            else:
                mover = threading.Thread(target=transfers[cond])
                mover.start()
                while mover.is_alive():
                    step()
                    steps += 1
                mover.join()
            wall = time.perf_counter() - t0
            own = time.thread_time() - own0
            blocks[cond].append(
                {
                    "ms_per_step": wall / steps * 1e3,
                    "own_cpu_ms_per_step": own / steps * 1e3,
                    "other_cpu_ms": (time.process_time() - cpu0 - own) * 1e3,
                    "transfer_s": 0.0 if cond == "none" else wall,
                }
            )
    alone = {}
    for cond in ("gloo", "socket"):
        dist.barrier()
        cpu0, t0 = time.process_time(), time.perf_counter()
        transfers[cond]()
        alone[cond] = {"s": time.perf_counter() - t0, "cpu_ms": (time.process_time() - cpu0) * 1e3}
    with open(f"{args.out}.{rank}.json", "w") as f:
        json.dump({"rank": rank, "blocks": blocks, "alone": alone}, f)
    conn.close()
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
