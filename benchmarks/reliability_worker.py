"""The ranks' side of ``benchmarks.reliability``'s in-run cost: a checkpoint every step, on and
off in alternating blocks of steps of the same processes.

Why in one run as well as in separate runs: the step period of two runs of the same job
differed by up to 8% here with nothing changed (2 ranks on 2 cores: where the ranks, the agent
and the writers land), more than the cost to measure. Alternating blocks in the same processes
compare like with like; the separate runs stay in the table as what ``gradsync run
--checkpoint-every 1`` shows.

Each block is ``block`` steps of the workload's training step, with ``sync.save(DIR,
wait=False)`` after every step in the ``every`` blocks: the snapshot, and the files its writer
writes (one every ``writer_process.FILES_EVERY`` snapshots under ``bsp``, every one otherwise)
fall in those blocks. Blocks alternate which goes first, repeat by repeat. Under ``bsp`` every
block starts and ends at a barrier; parameter-server workers have none to share with their
server, and time their blocks alone (they save after the same steps, as a checkpoint needs).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

import gradsync as gs
from gradsync.workloads import make_workload

BATCH = 16  # per worker, as ``gradsync run``'s default
WARMUP = 8  # steps of each kind before timing: the writer starts at the first save


def worker(job: dict[str, Any]) -> dict[str, Any] | None:
    gs.init()
    torch.set_num_threads(1)
    workload = make_workload(job["workload"], seed=job["seed"])
    model = workload.build_model()
    optimizer = workload.make_optimizer(model, workload.default_lr)
    servers = 1 if job["strategy"] == "async" or job["strategy"].startswith("ssp") else 0
    kwargs = {"servers": servers} if servers else {}
    sync = gs.Synchronizer(model, optimizer, strategy=job["strategy"], **kwargs)
    if sync.is_server:
        sync.serve()
        sync.close()
        return None
    rank, workers = sync.rank, sync.layout.workers

    def train(i: int) -> None:
        with sync.step(samples=BATCH) as s:
            x, y = workload.batch(i, BATCH * workers, rank * BATCH, (rank + 1) * BATCH)
            loss = workload.loss(model, x, y)
            loss.backward()
            s.loss = loss.detach()

    def saved(i: int) -> None:
        train(i)
        sync.save(job["directory"], wait=False, data_position=i + 1)

    barrier = dist.barrier if servers == 0 else None
    times = _alternate({"none": train, "every": saved}, job["repeats"], job["block"], barrier)
    sync.wait_for_checkpoints()
    sync.report()  # ends training: parameter servers stop serving
    sync.close()
    return times if rank == 0 else None


def _alternate(
    steps: dict[str, Callable[[int], None]],
    repeats: int,
    block: int,
    barrier: Callable[[], Any] | None,
) -> dict[str, list[float]]:
    """Mean seconds per step of every block, by kind, in repeat order."""
    at = 0
    for step in steps.values():
        for _ in range(WARMUP):
            step(at)
            at += 1
    times: dict[str, list[float]] = {name: [] for name in steps}
    names = list(steps)
    for r in range(repeats):
        for name in names if r % 2 == 0 else names[::-1]:
            if barrier is not None:
                barrier()
            t0 = time.perf_counter()
            for _ in range(block):
                steps[name](at)
                at += 1
            if barrier is not None:
                barrier()
            times[name].append((time.perf_counter() - t0) / block)
    return times
