"""Calibrated prediction against real runs: does the simulator predict a 4-rank run's median
step time and barrier tax from its telemetry plus a fitted alpha/beta?

Runs, on this machine: ``gradsync bench allreduce --nproc 4`` once, then real 4-rank BSP runs
without and with a straggler (``--slow 3:2``), interleaved A B A B. Each run is predicted from
its own telemetry; the straggler run is also asked "what if the straggler were removed" and
compared with the measured runs without one. Prints a markdown table for docs/simulator.md.

    .venv/bin/python benchmarks/sim_calibration.py [--repeats 2] [--steps 60] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from gradsync.sim.bench import BenchConfig, format_table, run_bench
from gradsync.sim.calibrate import WhatIf, load_profile, predict, save_calibration


def real_run(out: Path, steps: int, slow: str | None, workload: str) -> Path:
    cmd = [
        sys.executable,
        "-m",
        "gradsync.cli",
        "run",
        "--nproc",
        "4",
        "--workload",
        workload,
        "--steps",
        str(steps),
        "--out",
        str(out),
        "--no-progress",
    ]
    if slow:
        cmd += ["--slow", slow]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=2, help="runs of each kind (A B A B ...)")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--workload", default="mlp")
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gradsync-simcal-"))
    work.mkdir(parents=True, exist_ok=True)

    rows, fit = run_bench(BenchConfig(nproc=4))
    measurements = [{"bytes": r.nbytes, "time_s": r.time_s} for r in rows]
    save_calibration(work / "cal.json", fit, {"backend": "gloo", "measurements": measurements})
    print(format_table(rows, 4, "gloo"), file=sys.stderr)
    link = fit.model()
    print(
        f"calibration: alpha {fit.alpha * 1e6:.0f} us, beta {fit.beta * 1e9:.3f} ns/B, "
        f"worst fit error {fit.max_rel_error:.0%} ({work / 'cal.json'})",
        file=sys.stderr,
    )

    table = []
    no_straggler_measured: list[float] = []
    removed_predicted: list[float] = []
    for i in range(args.repeats):
        for kind, slow in (("no straggler", None), ("straggler 3:2", "3:2")):
            run = real_run(
                work / f"{'slow' if slow else 'base'}{i}", args.steps, slow, args.workload
            )
            prof = load_profile(run)
            pred = predict(prof, link)
            table.append(
                (
                    kind,
                    run.name,
                    prof.measured_step_ms,
                    pred.step_ms,
                    prof.measured_barrier_tax,
                    pred.barrier_tax,
                )
            )
            if slow:
                removed_predicted.append(predict(prof, link, WhatIf(remove_straggler=True)).step_ms)
            else:
                no_straggler_measured.append(prof.measured_step_ms)

    print(
        "| run | kind | measured median step (ms) | predicted (ms) | error | "
        "measured barrier tax | predicted |"
    )
    print("|---|---|---:|---:|---:|---:|---:|")
    for kind, name, m, p, mt, pt in table:
        print(f"| {name} | {kind} | {m:.2f} | {p:.2f} | {p / m - 1:+.1%} | {mt:.1%} | {pt:.1%} |")
    m, p = statistics.median(no_straggler_measured), statistics.median(removed_predicted)
    print(
        f"| straggler runs, what-if straggler removed | vs measured no-straggler runs | "
        f"{m:.2f} | {p:.2f} | {p / m - 1:+.1%} | | |"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
