"""The cost of a checkpoint every step by the issue-14 measure, with workers forked from the
launcher's forkserver and with workers spawned, side by side.

Each repeat runs four `gradsync run`s of the same job (charlm, 2 ranks, BSP by default): forked
and spawned (``GRADSYNC_START_METHOD=spawn``), each with ``--checkpoint-every 1`` and without,
in an order that rotates from one repeat to the next. The cost is the ratio of the median step
periods with and without, within one repeat and one start method (``reliability.step_period``);
the table gives the median and IQR of those ratios, and how often the forked ratio of a repeat
was below the spawned one.
"""

from __future__ import annotations

import argparse
import os
import statistics
from pathlib import Path
from tempfile import TemporaryDirectory

from benchmarks.harness import Harness, interleave, machine, median_iqr, table
from benchmarks.reliability import RELIABILITY_MD, run, step_period
from gradsync.processes import forkserver

CONFIGS = [("forked", False), ("forked", True), ("spawned", False), ("spawned", True)]


def one(args: argparse.Namespace, config: tuple[str, bool]) -> float:
    how, every = config
    extra = ("--checkpoint-every", "1") if every else ()
    saved = os.environ.get(forkserver.START_METHOD_ENV)
    os.environ[forkserver.START_METHOD_ENV] = "auto" if how == "forked" else "spawn"
    try:
        with TemporaryDirectory(prefix="gradsync-start-method-") as tmp:
            rc, _ = run(Path(tmp) / "run", args, args.strategy, args.cost_steps, *extra)
            if rc != 0:
                raise SystemExit(f"gradsync run failed ({how}, every={every})")
            return step_period(Path(tmp) / "run")
    finally:
        if saved is None:
            os.environ.pop(forkserver.START_METHOD_ENV, None)
        else:
            os.environ[forkserver.START_METHOD_ENV] = saved


def main() -> None:
    h = Harness(
        "benchmarks.start_method", __doc__, repeats=10, section="start_method", md=RELIABILITY_MD
    )
    p = h.parser
    p.add_argument("--workload", default="charlm")
    p.add_argument("--strategy", default="bsp")
    p.add_argument("--cost-steps", type=int, default=150)
    p.add_argument("--seed", type=int, default=7)
    args = h.parse(cost_steps=30, repeats=1)
    if not forkserver.available():
        h.error("workers cannot be forked here (not Linux, or a GPU is visible)")
    runs = interleave(CONFIGS, args.repeats, lambda c, _r: one(args, c), progress="")
    cost = {how: [r[(how, True)] / r[(how, False)] for r in runs] for how in ("forked", "spawned")}
    below = sum(f < s for f, s in zip(cost["forked"], cost["spawned"], strict=True))
    rows = []
    for how in ("forked", "spawned"):
        med, q1, q3 = median_iqr(cost[how])
        periods = [statistics.median(r[(how, e)] for r in runs) * 1e3 for e in (False, True)]
        rows.append(
            [
                how,
                f"{periods[0]:.2f} / {periods[1]:.2f} ms",
                f"{med - 1:+.1%} ({q1 - 1:+.1%} to {q3 - 1:+.1%})",
                ", ".join(f"{c - 1:+.1%}" for c in cost[how]),
            ]
        )
    text = (
        "## A checkpoint every step, workers forked and spawned\n\n"
        f"Command: `{h.command()}`. Machine: {machine()}.\n\n"
        f"`{args.workload}`, 2 worker ranks, `{args.strategy}`, {args.cost_steps} steps a run, "
        f"seed {args.seed}; {args.repeats} repeats of the four runs. Cost: step period with "
        "`--checkpoint-every 1` over the period without (median of rank 0's step periods), "
        "within a repeat.\n\n"
        + table(
            [
                "workers",
                "step period without / with: median",
                "cost: median (IQR) of the repeats",
                "cost in each repeat",
            ],
            rows,
        )
        + f"\n\nThe forked cost was below the spawned one in {below} of {args.repeats} repeats.\n"
    )
    h.finish(text)


if __name__ == "__main__":
    main()
