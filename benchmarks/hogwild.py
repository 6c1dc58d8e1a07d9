"""Hogwild against BSP and async on one host, without and with a straggler.

Each repeat runs `gradsync.runner.compare.run_comparison` over bsp, async and hogwild (2 workers,
the
same seed, data and steps; async with its one parameter server), in alternating order, once
with every worker at its own speed and once with rank 1 slowed 3x. Every ratio is against BSP
in the same repeat and set; the table holds medians over repeats.

Time to target is given twice. "every rank" is `gradsync compare`'s: the first step whose loss
(mean over ranks, smoothed) is below the target, at the moment the last rank finished that
step, which a straggler paces under every strategy. "first rank" is the moment one rank's own
smoothed loss first fell below it: what the fast rank of a free-running strategy reaches
without waiting for the slow one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.dial import all_busy_rate, run_dirname
from benchmarks.harness import (
    REVERSE,
    Harness,
    machine,
    median,
    median_of_ratios,
    order,
    span,
    table,
)
from gradsync.runner.compare import SMOOTH, run_comparison
from gradsync.runner.config import RunConfig
from gradsync.telemetry.records import StepRecord, read_records

STRATEGIES = ("bsp", "async", "hogwild")
NPROC = 2
SEED = 0
BATCH = 16  # per worker
SETS = {"no straggler": None, "rank 1 slowed 3x": "1:3"}
Rows = dict[str, dict[str, Any]]  # run_comparison's rows by strategy, plus ours


def first_rank_to_target(records: list[StepRecord], target: float) -> float | None:
    """Seconds from the run's start until some rank's own loss, smoothed as compare smooths
    it, first fell below ``target`` (None: never)."""
    start = min(r.time for r in records)
    best: float | None = None
    for rank in sorted({r.rank for r in records}):
        mine = sorted((r for r in records if r.rank == rank), key=lambda r: r.step)
        losses = np.array([np.nan if r.loss is None else r.loss for r in mine])
        for i, r in enumerate(mine):
            window = losses[max(0, i - SMOOTH + 1) : i + 1]
            if np.nanmean(window) < target:
                at = r.time + r.compute + r.sync - start
                best = at if best is None else min(best, at)
                break
    return best


def run_set(base: RunConfig, repeats: int, out: Path, target: float) -> list[Rows]:
    results = []
    for r in range(repeats):
        now = order(list(STRATEGIES), r, REVERSE)
        rep_out = out / f"repeat{r}"
        print(f"  repeat {r + 1}/{repeats}: {', '.join(now)}", file=sys.stderr, flush=True)
        result = run_comparison(replace(base, out=str(rep_out)), now, target, show_progress=False)
        rows = {row["strategy"]: row for row in result["rows"]}
        for spec, row in rows.items():
            records = read_records(rep_out / run_dirname(spec))
            row["all_busy_samples_per_s"] = all_busy_rate(records)
            row["first_rank_s"] = first_rank_to_target(records, target)
        results.append(rows)
    return results


def run(args: argparse.Namespace, out: Path) -> dict[str, list[Rows]]:
    base = RunConfig(
        nproc=NPROC,
        workload=args.workload,
        params=args.params,
        steps=args.steps,
        batch_size=BATCH,
        seed=SEED,
        progress=False,
        plots=False,
        out=str(out),
    )
    sets = {}
    for i, (name, slow) in enumerate(SETS.items()):
        print(f"{name}:", file=sys.stderr, flush=True)
        sets[name] = run_set(replace(base, slow=slow), args.repeats, out / f"set{i}", args.target)
    return sets


FIGURES = (  # (header, row key, format, ratio against bsp?)
    ("samples/s", "samples_per_s", ".0f", False),
    ("samples/s / BSP", "samples_per_s", ".2f", True),
    ("samples/s while all train / BSP", "all_busy_samples_per_s", ".2f", True),
    ("s to target, every rank", "seconds_to_target", ".2f", False),
    ("/ BSP", "seconds_to_target", ".2f", True),
    ("s to target, first rank", "first_rank_s", ".2f", False),
    ("/ BSP", "first_rank_s", ".2f", True),
    ("final loss", "final_loss", ".4f", False),
    ("barrier tax", "barrier_tax", ".1%", False),
)


def _cell(repeats: list[Rows], spec: str, key: str, fmt: str, ratio: bool) -> str:
    mine = [rep[spec][key] for rep in repeats]
    value = median_of_ratios(mine, [rep["bsp"][key] for rep in repeats]) if ratio else median(mine)
    return "never" if value is None else format(value, fmt)


def _ratio_range(repeats: list[Rows], spec: str, key: str) -> str:
    """Lowest to highest per-repeat ratio against BSP: how far the median can be trusted."""
    ratios = [rep[spec][key] / rep["bsp"][key] for rep in repeats if rep["bsp"][key]]
    return span(ratios, "{:.2f}") if ratios else "-"


def render(sets: dict[str, list[Rows]], args: argparse.Namespace, command: str) -> str:
    rows = []
    for name, repeats in sets.items():
        for spec in STRATEGIES:
            reached = sum(rep[spec]["seconds_to_target"] is not None for rep in repeats)
            cells = [_cell(repeats, spec, key, f, ratio) for _, key, f, ratio in FIGURES]
            cells.insert(2, _ratio_range(repeats, spec, "samples_per_s"))
            rows.append([name, spec, *cells, f"{reached}/{len(repeats)}"])
    head = ["set", "strategy", *(h for h, *_ in FIGURES), "reached target"]
    head.insert(4, "range over repeats")
    return (
        "## Hogwild against BSP and async on one host\n\n"
        f"Command: `{command}` (repeats {args.repeats}, {args.steps} steps per worker, seed "
        f"{SEED}, target loss {args.target}). Machine: {machine()}. Workload {args.workload} "
        f"(--params {args.params}), {NPROC} workers (async: plus 1 parameter server), batch "
        f"{BATCH} per worker, one thread each; the straggler set slows rank 1's "
        "compute 3x "
        "(`--slow 1:3`). Medians over repeats; ratios are per-repeat against BSP in the same "
        "set. \"every rank\": `gradsync compare`'s time to target (the last rank's finish of "
        'the first step whose mean loss is below it); "first rank": when one rank\'s own '
        "smoothed loss first fell below it. The runs last seconds on 2 cores that other "
        "processes share, with 2 or 3 processes each: read the range over repeats before the "
        "digits.\n\n" + table(head, rows)
    )


def main() -> int:
    h = Harness("benchmarks.hogwild", __doc__, repeats=2)
    p = h.parser
    p.add_argument("--steps", type=int, default=100, help="steps per worker (%(default)s)")
    p.add_argument("--workload", default="mlp", help="%(default)s")
    p.add_argument("--params", type=int, default=100_000, help="mlp size (%(default)s)")
    p.add_argument("--target", type=float, default=0.15, help="target loss (%(default)s)")
    p.add_argument("--workdir", type=Path, default=None, help="where the runs go (a temp dir)")
    args = h.parse(steps=20, repeats=1)
    with tempfile.TemporaryDirectory(prefix="gradsync-hogwild-bench-") as tmp:
        sets = run(args, args.workdir or Path(tmp))
    h.finish(render(sets, args, h.command()), skip="a smoke run (--quick)" if args.quick else None)
    return 0


if __name__ == "__main__":
    sys.exit(main())
