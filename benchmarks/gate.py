"""What the step gate costs (issue 44): step time with the gate on and off, and the store
requests it makes per step, on 2 and 8 gloo ranks over loopback.

The gate (``gradsync.checks.gate``) waits in the store, before each step's first collective,
until every rank is back from its own code. A step that is all overhead shows its cost best:
``bsp`` on an mlp of a few thousand parameters, telemetry and the divergence check off so that
only the gate differs. Both configurations are Synchronizers over the same process group, each
its own replica from the same seed, timed in interleaved blocks (order rotated by repeat);
ratios are block by block within a repeat. The store requests are counted on the training
thread only (the heartbeat thread's one write a beat is not on the step's path), from the
watch's store while the blocks run. Not measured here: the emulated cluster, where each round
trip is a network one, and many ranks (8 processes on 2 cores already share them 4 to 1).
"""

from __future__ import annotations

import statistics
import threading
from typing import Any

import torch

import gradsync as gs
from benchmarks.harness import Harness, fmt_iqr, machine, pair_ratios, table, time_interleaved
from gradsync.processes.launch import launch
from gradsync.workloads import make_workload

CONFIGS = ("gate on", "gate off")


class _Counted:
    """The watch's store, counting the requests the training thread makes."""

    def __init__(self, store: Any, thread: int) -> None:
        self._store, self._thread, self.requests = store, thread, 0

    def __getattr__(self, name: str) -> Any:
        found = getattr(self._store, name)
        if not callable(found):
            return found

        def counted(*args: Any, **kwargs: Any) -> Any:
            if threading.get_ident() == self._thread:
                self.requests += 1
            return found(*args, **kwargs)

        return counted


def _trainer(gate: bool, rank: int, world: int) -> tuple[Any, gs.Synchronizer]:
    w = make_workload("mlp", seed=3, params=5000)
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
        steps[name], syncs[name] = _trainer(name == "gate on", rank, world)
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
    }


def render(results: dict[int, dict[str, Any]], command: str) -> str:
    rows = []
    for world, got in sorted(results.items()):
        b = got["blocks"]
        on, off = (statistics.median(b[n]) * 1000 for n in CONFIGS)
        rows.append(
            [
                str(world),
                f"{on:.2f} ms",
                f"{off:.2f} ms",
                fmt_iqr(pair_ratios(b["gate on"], b["gate off"])),
                f"{got['requests']['gate on']:.1f}",
                f"{got['requests']['gate off']:.1f}",
            ]
        )
    header = [
        "ranks",
        "gate on, ms/step",
        "gate off, ms/step",
        "on / off (middle half)",
        "store requests/step, on",
        "off",
    ]
    return (
        "## The step gate's cost (issue 44)\n\n"
        "`bsp` on a 5,000-parameter mlp (a step that is all overhead), telemetry and the "
        "divergence check off, gloo on loopback, 1 thread per rank; the gate on (the default) "
        "and off (`between_steps_timeout_s=None`) as two Synchronizers in the same processes, "
        "timed in interleaved blocks; ms/step the median block, the ratio block by block "
        "(median, middle half). Store requests per step: those of the training thread, gate "
        "and all.\n\n" + table(header, rows) + f"\n\n{machine()}. Command: `{command}`\n"
    )


def main() -> None:
    h = Harness("benchmarks.gate", __doc__, repeats=9)
    h.parser.add_argument("--steps", type=int, default=40, help="steps per block")
    h.parser.add_argument("--ranks", default="2,8", help="rank counts, comma-separated")
    args = h.parse(repeats=2, steps=5, ranks="2")
    job = {"repeats": args.repeats, "steps": args.steps}
    results = {}
    for world in (int(n) for n in args.ranks.split(",")):
        results[world] = launch(worker, (job,), nproc=world)[0]
    h.finish(render(results, h.command()))


if __name__ == "__main__":
    main()
