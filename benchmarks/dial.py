"""The synchronization dial with a straggler: every strategy against BSP, 4 workers, charlm.

    python benchmarks/dial.py [--repeats 3] [--steps 150] [--target 2.5] [--write]

Each repeat runs `gradsync.compare.run_comparison` over bsp, ssp:2, async, local:8, diloco:16
(ssp and async add one parameter-server process), same seed, rank 3 slowed 2x (`slow="3:2"`),
in that order on even repeats and reversed on odd ones, so no strategy always runs first or
last. Every figure is a ratio against BSP from the same repeat; the table shows medians over
repeats. Samples/s and seconds to the target loss are run_comparison's: all workers' samples
over the wall time from the first step's start to the last step's end, and the first step at
which the 10-step moving average of the loss (mean over workers) is at or below the target,
stamped with the time the slowest worker finished that step.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.mdtable import machine, table, write_section  # noqa: E402
from gradsync.compare import _dirname, run_comparison  # noqa: E402
from gradsync.config import RunConfig  # noqa: E402
from gradsync.strategies.base import uses_servers  # noqa: E402
from gradsync.telemetry.records import StepRecord, read_records  # noqa: E402

COMMAND = "python benchmarks/dial.py --write"
STRATEGIES = ("bsp", "ssp:2", "async", "local:8", "diloco:16")
SLOW = "3:2"
NPROC = 4
SEED = 0
EXPECTED_SPEEDUP = 1.3  # the expectation for ssp and async against BSP


def all_busy_rate(records: list[StepRecord]) -> float:
    """Samples/s over the span in which every worker was still training.

    Every worker runs the same number of steps, so under ssp/async the fast workers finish
    early and the run's wall time ends with the straggler working alone; this rate stops the
    clock when the first worker finishes, counting the steps completed by then.
    """
    start = min(r.time for r in records)
    ends: dict[int, float] = {}
    for r in records:
        ends[r.rank] = max(ends.get(r.rank, 0.0), r.time + r.compute + r.sync)
    stop = min(ends.values())
    done = sum(r.samples for r in records if r.time + r.compute + r.sync <= stop)
    return done / (stop - start) if stop > start else 0.0


def run(args: argparse.Namespace, out: Path) -> list[dict[str, dict[str, Any]]]:
    base = RunConfig(
        nproc=NPROC,
        workload=args.workload,
        steps=args.steps,
        seed=SEED,
        slow=SLOW,
        progress=False,
        plots=False,
        out=str(out),
    )
    repeats = []
    for r in range(args.repeats):
        order = list(args.strategies) if r % 2 == 0 else list(reversed(args.strategies))
        rep_out = out / f"repeat{r}"
        print(f"repeat {r + 1}/{args.repeats}: {', '.join(order)}", file=sys.stderr)
        result = run_comparison(
            replace(base, out=str(rep_out)), order, args.target, show_progress=False
        )
        rows = {row["strategy"]: row for row in result["rows"]}
        for spec, row in rows.items():
            row["all_busy_samples_per_s"] = all_busy_rate(read_records(rep_out / _dirname(spec)))
        repeats.append(rows)
    return repeats


def _median(values: list[float | None]) -> float | None:
    known = [v for v in values if v is not None]
    return statistics.median(known) if known else None


def _fmt(value: float | None, spec: str) -> str:
    return "never" if value is None else format(value, spec)


def _ratio(a: float | None, b: float | None) -> float | None:
    return None if a is None or b is None or b == 0 else a / b


def _vs_bsp(repeats: list[dict[str, dict[str, Any]]], s: str, key: str) -> float | None:
    """Median over repeats of strategy s's figure over BSP's in the same repeat; a repeat where
    either is missing (target never reached) is left out."""
    return _median([_ratio(rep[s][key], rep["bsp"][key]) for rep in repeats])


def render(repeats: list[dict[str, dict[str, Any]]], args: argparse.Namespace) -> str:
    strategies = list(args.strategies)
    n = len(repeats)
    summary: dict[str, dict[str, Any]] = {}
    for s in strategies:
        rows = [rep[s] for rep in repeats]
        summary[s] = {
            "sps": _median([r["samples_per_s"] for r in rows]),
            "sps_ratio": _vs_bsp(repeats, s, "samples_per_s"),
            "busy_ratio": _vs_bsp(repeats, s, "all_busy_samples_per_s"),
            "steps_to": _median([r["steps_to_target"] for r in rows]),
            "s_to": _median([r["seconds_to_target"] for r in rows]),
            "s_ratio": _vs_bsp(repeats, s, "seconds_to_target"),
            "reached": sum(r["steps_to_target"] is not None for r in rows),
            "final": _median([r["final_loss"] for r in rows]),
            "mb": _median([r["mb_sent"] for r in rows]),
            "tax": _median([r["barrier_tax"] for r in rows]),
        }
    body = table(
        [
            "strategy",
            "samples/s",
            "samples/s / BSP",
            "samples/s while all train / BSP",
            "steps to target",
            "s to target",
            "s to target / BSP",
            "reached target",
            "final loss",
            "MB sent",
            "barrier tax",
        ],
        [
            [
                s,
                _fmt(m["sps"], ".0f"),
                _fmt(m["sps_ratio"], ".2f"),
                _fmt(m["busy_ratio"], ".2f"),
                _fmt(m["steps_to"], ".0f"),
                _fmt(m["s_to"], ".1f"),
                _fmt(m["s_ratio"], ".2f"),
                f"{m['reached']}/{n}",
                _fmt(m["final"], ".4f"),
                _fmt(m["mb"], ".1f"),
                _fmt(m["tax"], ".1%"),
            ]
            for s, m in summary.items()
        ],
    )
    cores = os.cpu_count() or 1
    servers = any(uses_servers(s) for s in strategies)
    head = (
        "## The synchronization dial with a straggler (issue 3)\n\n"
        f"Command: `{COMMAND}` (repeats {args.repeats}, {args.steps} steps per worker, seed "
        f"{SEED}, target loss {args.target}). Machine: {machine()}. Workload {args.workload}, "
        f"{NPROC} workers (plus 1 parameter server for ssp/async), batch 16 per worker, "
        f"1 thread per process, gloo on loopback, rank 3 slowed 2x (`--slow {SLOW}`). Medians "
        "over repeats of per-repeat ratios against BSP; strategies run in alternating order "
        "(forward, then reversed). `samples/s` is all workers' samples over the wall time from "
        "the first step to the last; `while all train` stops the clock when the first worker "
        "finishes its steps. Time to target: first step whose 10-step moving-average loss is "
        "at or below the target, at the time the slowest worker finished that step.\n"
    )
    return head + "\n" + body + "\n\n" + _findings(summary, strategies, n, cores, servers) + "\n"


def _findings(
    m: dict[str, dict[str, Any]], strategies: list[str], n: int, cores: int, servers: bool
) -> str:
    """Sentences generated from the measured medians: expectation met or not, and why."""
    out = []
    for s in ("ssp:2", "async"):
        if s not in m or m[s]["sps_ratio"] is None:
            continue
        met = m[s]["sps_ratio"] >= EXPECTED_SPEEDUP
        out.append(
            f"{s} reached {m[s]['sps_ratio']:.2f}x BSP's samples/s over the whole run "
            f"({'meets' if met else 'misses'} the expected {EXPECTED_SPEEDUP}x) and "
            f"{_fmt(m[s]['busy_ratio'], '.2f')}x while all workers trained."
        )
    reached = [s for s in strategies if m[s]["reached"] == n]
    missed = [f"{s} ({m[s]['reached']}/{n})" for s in strategies if m[s]["reached"] < n]
    out.append(
        f"Reached the target loss in every repeat: {', '.join(reached) or 'none'}"
        + (f"; not in every repeat: {', '.join(missed)}." if missed else ".")
    )
    procs = NPROC + (1 if servers else 0)
    if cores < procs:
        out.append(
            f"This machine has {cores} cores for {NPROC} workers"
            + (" plus a server" if servers else "")
            + ", so processes time-share cores and no strategy runs as it would with a core "
            "per process: the injected slowdown is a sleep, which hands the straggler's core to "
            "whoever can use it (nobody under BSP, where the others wait at the barrier; under "
            "local SGD and DiLoCo, the others until the next averaging step"
            + (
                "; the fast workers under ssp/async), and the server takes CPU from the workers"
                if servers
                else ")"
            )
            + ". The ratios here can therefore differ in either direction from those on a "
            "machine with a core per process."
        )
    if servers:
        out.append(
            "Every worker runs the same number of steps, so under ssp and async the run's wall "
            "time still ends when the straggler finishes its own steps; the whole-run samples/s "
            "therefore includes a tail in which only the straggler trains, which the "
            "while-all-train column leaves out."
        )
    return " ".join(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--target", type=float, default=2.5, help="target loss")
    parser.add_argument("--workload", default="charlm", help="charlm (default) or mlp")
    parser.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated; must include bsp"
    )
    parser.add_argument("--quick", action="store_true", help="tiny smoke run (not for tables)")
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    args = parser.parse_args()
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if "bsp" not in args.strategies:
        parser.error("--strategies must include bsp: every figure is a ratio against it")
    if args.quick:
        args.repeats, args.steps = 2, 20
    with tempfile.TemporaryDirectory(prefix="gradsync-dial-") as tmp:
        repeats = run(args, Path(tmp))
    text = render(repeats, args)
    print(text)
    if args.write:
        write_section("dial", text)


if __name__ == "__main__":
    main()
