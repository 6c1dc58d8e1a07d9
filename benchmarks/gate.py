"""What the step gate costs (issue 44): step time with the gate on and off, and the store
requests it makes per step, on 2 and 8 gloo ranks over loopback.

The gate (``gradsync.checks.gate``) waits in the store until every rank is back from its own
code; under ``bsp`` the wait runs on a thread of its own from the block's entry and is joined
before the step's first collective (``gradsync.checks.gate_ahead``). Two workloads: an mlp of a
few thousand parameters, a step that is all overhead, where nothing hides the wait; and
``charlm``, whose forward pass does. Telemetry and the divergence check are off so that only
the gate differs. Both configurations are Synchronizers over the same process group, each its
own replica from the same seed, timed in interleaved blocks (order rotated by repeat); ratios
are block by block within a repeat. The store requests are counted on the training thread and
on the gate's thread (the heartbeat thread's one write a beat is on neither). Not measured
here: the emulated cluster, where each round trip is a network one, and many ranks (8
processes on 2 cores already share them 4 to 1).
"""

from __future__ import annotations

import datetime
import math
import multiprocessing
import os
import statistics
import threading
import time
from typing import Any

import numpy as np
import torch

import gradsync as gs
from benchmarks.harness import Harness, fmt_iqr, machine, pair_ratios, table, time_interleaved
from gradsync.processes.launch import launch
from gradsync.sim.config import CommModel
from gradsync.sim.gate import StoreGate
from gradsync.sim.simulate import Overlap, simulate
from gradsync.workloads import make_workload

CONFIGS = ("gate on", "gate off")


class _Counted:
    """The watch's store, counting the requests the training thread makes and those of the
    gate's own thread (``checks.gate_ahead``), which are off the step's critical path."""

    def __init__(self, store: Any, thread: int) -> None:
        self._store, self._thread, self.requests, self.ahead = store, thread, 0, 0

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._store, name)
        if not callable(found):
            return found

        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._thread:
                self.requests += 1
            elif threading.current_thread().name == "gradsync-gate":
                self.ahead += 1
            return found(*args, **kwargs)

        return counted


#: the workloads timed: a step that is all overhead, and one with a forward pass to hide
#: the gate's round trips behind (charlm: a small transformer, about 17 ms a step on 2 ranks)
WORKLOADS = {"mlp": {"params": 5000}, "charlm": {}}


def _trainer(gate: bool, rank: int, world: int, workload: str) -> tuple[Any, gs.Synchronizer]:
    w = make_workload(workload, seed=3, **WORKLOADS[workload])
    model = w.build_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    between = gs.Limits().between_steps_timeout_s if gate else None
    sync = gs.Synchronizer(
        model,
        opt,
        "bsp",
        telemetry=False,
        check_every=0,
        between_steps_timeout_s=between,
        timeout_s=60,
    )

    def step(i: int) -> None:
        with sync.step():
            x, y = w.batch(i, 8 * world, 8 * rank, 8 * (rank + 1))
            w.loss(model, x, y).backward()

    return step, sync


def worker(job: dict[str, Any]) -> dict[str, Any]:
    gs.init()
    rank, world = gs.rank(), gs.world_size()
    steps, syncs = {}, {}
    for name in CONFIGS:
        steps[name], syncs[name] = _trainer(name == "gate on", rank, world, job["workload"])
    for step in steps.values():
        step(0)  # the first gate agrees on the run's secret, which replaces the watch's store
    counted = {}
    for name, sync in syncs.items():
        # Beneath the keyed store the first gate made (the watch's own stays what it is: a
        # store that is not keyed would be keyed anew, with a collective, at the next gate).
        keyed = sync.watch.store
        counted[name] = _Counted(keyed.store, threading.get_ident())
        keyed.store = counted[name]
    blocks = time_interleaved(steps, job["repeats"], job["steps"], warmup=3)
    timed = job["repeats"] * job["steps"]
    for sync in syncs.values():
        sync.close()
    return {
        "blocks": blocks,
        "requests": {n: c.requests / (timed + 3) for n, c in counted.items()},
        "ahead": {n: c.ahead / (timed + 3) for n, c in counted.items()},
    }


#: the store's clients when its rate is measured, and the ranks the simulator prices it at
STORE_CLIENTS, PRICED_RANKS = 4, (8, 1024, 16384)


def _store_client(port: int, requests: int, out: Any) -> None:
    from torch.distributed import TCPStore

    store = TCPStore("127.0.0.1", port, is_master=False, timeout=datetime.timedelta(seconds=60))
    t0 = time.perf_counter()
    # the gate's own requests: a set of this rank's key, then a wait for keys that are there
    # (answered at once, as the last arrival's is)
    timeout = datetime.timedelta(seconds=60)
    for i in range(requests // 2):
        key = f"gate/{i % 64}/{os.getpid()}"
        store.set(key, "1")
        store.wait([key], timeout)
    out.put(time.perf_counter() - t0)


def store_rate(clients: int = STORE_CLIENTS, requests: int = 3000) -> float:
    """Requests a second one TCPStore on loopback serves to ``clients`` processes at once."""
    from torch.distributed import TCPStore

    server = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    out = ctx.Queue()
    procs = [
        ctx.Process(target=_store_client, args=(server.port, requests, out)) for _ in range(clients)
    ]
    for p in procs:
        p.start()
    slowest = max(out.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    return clients * requests / slowest


#: how many times the store's rate is measured: one measurement lasts tens of milliseconds,
#: and on 2 shared cores one ranged from 47,000 to 296,000 requests a second run to run
RATE_REPEATS = 7


def median_store_rate() -> tuple[float, float, float]:
    """The median, least and greatest of :data:`RATE_REPEATS` measurements of ``store_rate``."""
    rates = sorted(store_rate() for _ in range(RATE_REPEATS))
    return statistics.median(rates), rates[0], rates[-1]


def priced(rate: float) -> list[list[str]]:
    """The simulator's price of the gate with the measured store: a 100 ms step (a third
    forward, gradients in 4 buckets over the backward), 10 ms of exchange; the gate flat (every
    rank at the one store) and in the runtime's automatic groups (``checks.gate_groups``),
    the world's store taking every rank's heartbeat a second in both."""
    rows = []
    for ranks in PRICED_RANKS:
        grouped = StoreGate(store_rate=rate)
        flat = StoreGate(store_rate=rate, group_size=ranks)
        rows.append(
            [
                str(ranks),
                *_price(flat, ranks),
                grouped.form(ranks),
                *_price(grouped, ranks),
            ]
        )
    return rows


#: the columns of :func:`priced`'s rows
PRICED_HEADER = [
    "ranks",
    "flat: gate opens after",
    "its cost a step",
    "of the step",
    "automatic: groups",
    "gate opens after",
    "its cost a step",
    "of the step",
]


def _price(gate: StoreGate, ranks: int) -> list[str]:
    """When ``gate`` opens on ``ranks`` ranks, what it adds to the step, and its share."""
    compute = np.full((3, ranks), 100.0)
    ov = Overlap(backward_frac=2 / 3, buckets=4)
    on = simulate("bsp", compute, CommModel(comm_ms=10.0, gate=gate), overlap=ov)
    off = simulate("bsp", compute, CommModel(comm_ms=10.0), overlap=ov)
    cost = (on.wall_ms - off.wall_ms) / on.steps
    opens = gate.open_ms(ranks)
    if math.isinf(opens):  # the heartbeats alone take the world's store
        return ["never", "every step", "-"]
    return [f"{opens:.1f} ms", f"{cost:.1f} ms", f"{cost / (off.wall_ms / off.steps):.1%}"]


def render(
    results: dict[tuple[str, int], dict[str, Any]],
    command: str,
    rate: float,
    least: float | None = None,
    most: float | None = None,
) -> str:
    rows = []
    for (workload, world), got in results.items():
        b = got["blocks"]
        on, off = (statistics.median(b[n]) * 1000 for n in CONFIGS)
        rows.append(
            [
                workload,
                str(world),
                f"{on:.2f} ms",
                f"{off:.2f} ms",
                fmt_iqr(pair_ratios(b["gate on"], b["gate off"])),
                f"{got['requests']['gate on']:.1f}",
                f"{got['ahead']['gate on']:.1f}",
                f"{got['requests']['gate off']:.1f}",
            ]
        )
    header = [
        "workload",
        "ranks",
        "gate on, ms/step",
        "gate off, ms/step",
        "on / off (middle half)",
        "store requests/step, on: training thread",
        "on: the gate's thread",
        "off",
    ]
    return (
        "## The step gate's cost (issue 44)\n\n"
        "`bsp` on a 5,000-parameter mlp (a step that is all overhead) and on charlm (a small "
        "transformer, whose forward pass hides the gate's wait), telemetry and the "
        "divergence check off, gloo on loopback, 1 thread per rank; the gate on (the default) "
        "and off (`between_steps_timeout_s=None`) as two Synchronizers in the same processes, "
        "timed in interleaved blocks; ms/step the median block, the ratio block by block "
        "(median, middle half). Store requests per step: those of the training thread, gate "
        "and all, and those of the gate's own thread, which waits from the block's entry to "
        "the first collective (`gradsync.checks.gate_ahead`).\n\n"
        + table(header, rows)
        + f"\n\nThe store's rate with {STORE_CLIENTS} clients making the gate's own requests at "
        f"once (a set, then a wait): {rate:,.0f} requests a second (TCPStore on loopback"
        + (
            f"; the median of {RATE_REPEATS} measurements, {least:,.0f} to {most:,.0f}"
            if least is not None and most is not None
            else ""
        )
        + "). "
        "What the simulator makes of it (`gradsync simulate --gate-store-rate`, "
        "`gradsync.sim.gate`) for `bsp` with a 100 ms step (a third of it forward, "
        "the gradient in 4 buckets over the backward) and 10 ms of exchange, the gate "
        "waited ahead, flat (every rank at the one store) and in the runtime's automatic groups "
        "(`gradsync.checks.gate_groups`), the world's store also taking every rank's heartbeat "
        "once a second:\n\n"
        + table(PRICED_HEADER, priced(rate))
        + f"\n\n{machine()}. Command: `{command}`\n"
    )


def main() -> None:
    h = Harness("benchmarks.gate", __doc__, repeats=9)
    h.parser.add_argument("--steps", type=int, default=40, help="steps per block")
    h.parser.add_argument("--ranks", default="2,8", help="rank counts for mlp, comma-separated")
    h.parser.add_argument("--charlm-ranks", default="2", help="rank counts for charlm")
    args = h.parse(repeats=2, steps=5, ranks="2", charlm_ranks="2")
    results = {}
    for workload, counts in (("mlp", args.ranks), ("charlm", args.charlm_ranks)):
        # charlm's steps are about 8x mlp's: fewer per block keeps the run near a minute
        steps = args.steps if workload == "mlp" else max(2, args.steps // 4)
        job = {"repeats": args.repeats, "steps": steps, "workload": workload}
        for world in (int(n) for n in counts.split(",") if n):
            results[workload, world] = launch(worker, (job,), nproc=world)[0]
    h.finish(render(results, h.command(), *median_store_rate()))


if __name__ == "__main__":
    main()
