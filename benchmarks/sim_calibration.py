"""Calibrated prediction against real runs: does the simulator predict a 4-rank run's median
step time and barrier tax from its telemetry plus a measured all-reduce calibration?

Runs, on this machine: ``gradsync bench allreduce --nproc 4`` once (sizes around both
payloads, every repeat kept), then real 4-rank BSP runs of two workloads, without and with a
straggler (``--slow 3:2``), interleaved A B A B. Workloads: ``tiny`` (mlp defaults, compute
under 1 ms, all-reduce-bound) and ``big`` (``--params 500000 --batch-size 64``, compute about
10 ms, a 1.9 MB all-reduce). Each run is predicted from its own telemetry several ways:

- ``pred``: whole measured steps resampled (compute of every rank at one step), all-reduce
  drawn from the calibration's measured repeats, plus the run's host overhead around it;
- ``ranks``: the same, but each rank's compute drawn independently;
- ``no ovh``: calibration all-reduce only, no host overhead (what a link model alone says);
- ``line``: the calibration's alpha-beta line instead of its measured repeats.

Straggler runs are also asked "what if the straggler were removed", against the measured runs
without one. Prints markdown tables (per run, then medians) for docs/simulator.md.

    .venv/bin/python benchmarks/sim_calibration.py [--repeats 3] [--steps 80] [--workdir DIR]
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

from gradsync.sim.bench import BenchConfig, format_table, run_bench
from gradsync.sim.calibrate import (
    WhatIf,
    load_calibration_table,
    load_profile,
    predict,
    save_calibration,
)

WORKLOADS = {
    "tiny": ["--workload", "mlp"],
    "big": ["--workload", "mlp", "--params", "500000", "--batch-size", "64"],
}
SIZES = tuple(2**k for k in range(16, 25))  # 64 KiB .. 16 MiB, x2 steps


def real_run(out: Path, steps: int, slow: str | None, workload: list[str]) -> Path:
    cmd = [sys.executable, "-m", "gradsync.cli", "run", "--nproc", "4", *workload]
    cmd += ["--steps", str(steps), "--out", str(out), "--no-progress", "--no-plots"]
    if slow:
        cmd += ["--slow", slow]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return out


def err(p: float, m: float) -> str:
    return f"{p / m - 1:+.1%}" if m > 0 else "n/a"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3, help="runs of each kind (A B A B ...)")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--workdir", default=None)
    args = ap.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="gradsync-simcal-"))
    work.mkdir(parents=True, exist_ok=True)

    rows, fit = run_bench(BenchConfig(nproc=4, sizes=SIZES, repeats=40))
    measurements = [
        {"bytes": r.nbytes, "time_s": r.time_s, "samples_s": list(r.samples_s)} for r in rows
    ]
    cal = work / "cal.json"
    save_calibration(cal, fit, {"backend": "gloo", "measurements": measurements})
    print(format_table(rows, 4, "gloo"), file=sys.stderr)
    link, table = fit.model(), load_calibration_table(cal)
    print(
        f"calibration: alpha {fit.alpha * 1e6:.0f} us, beta {fit.beta * 1e9:.3f} ns/B, "
        f"worst fit error {fit.max_rel_error:.0%} ({cal})",
        file=sys.stderr,
    )

    cols = ["measured", "pred", "ranks", "no ovh", "line", "tax", "pred tax"]
    per_run: list[tuple[str, str, list[float]]] = []
    groups: dict[tuple[str, str], list[list[float]]] = defaultdict(list)
    removed: dict[str, list[float]] = defaultdict(list)
    for i in range(args.repeats):
        for wl, flags in WORKLOADS.items():
            for kind, slow in (("no straggler", None), ("straggler 3:2", "3:2")):
                name = f"{wl}-{'slow' if slow else 'base'}{i}"
                prof = load_profile(real_run(work / name, args.steps, slow, flags))
                pred = predict(prof, link, table=table)
                vals = [
                    prof.measured_step_ms,
                    pred.step_ms,
                    predict(prof, link, table=table, resample="ranks").step_ms,
                    predict(prof, link, table=table, host_overhead=False).step_ms,
                    predict(prof, link).step_ms,
                    prof.measured_barrier_tax,
                    pred.barrier_tax,
                ]
                per_run.append((name, kind, vals))
                groups[(wl, kind)].append(vals)
                if slow:
                    wi = WhatIf(remove_straggler=True)
                    removed[wl].append(predict(prof, link, wi, table=table).step_ms)
                print(f"{name}: measured {vals[0]:.2f} predicted {vals[1]:.2f}", file=sys.stderr)

    print(
        "| run | kind | measured step (ms) | predicted (ms) | error | ranks indep. | no host "
        "overhead | alpha-beta line | measured tax | predicted tax |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name, kind, v in per_run:
        m = v[0]
        print(
            f"| {name} | {kind} | {m:.2f} | {v[1]:.2f} | {err(v[1], m)} | {err(v[2], m)} | "
            f"{err(v[3], m)} | {err(v[4], m)} | {v[5]:.1%} | {v[6]:.1%} |"
        )
    print()
    print(f"Medians over {args.repeats} runs of each kind (errors of the medians):")
    print()
    print(
        "| workload | kind | measured step (ms) | predicted (ms) | error | ranks indep. | "
        "no host overhead | alpha-beta line | measured tax | predicted tax |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for (wl, kind), runs in groups.items():
        med = [statistics.median(r[j] for r in runs) for j in range(len(cols))]
        m = med[0]
        print(
            f"| {wl} | {kind} | {m:.2f} | {med[1]:.2f} | {err(med[1], m)} | "
            f"{err(med[2], m)} | {err(med[3], m)} | {err(med[4], m)} | {med[5]:.1%} | "
            f"{med[6]:.1%} |"
        )
    for wl in WORKLOADS:
        m = statistics.median(r[0] for r in groups[(wl, "no straggler")])
        p = statistics.median(removed[wl])
        print(
            f"| {wl} | straggler runs, what-if straggler removed, vs measured no-straggler | "
            f"{m:.2f} | {p:.2f} | {err(p, m)} | | | | | |"
        )
    return 0


def write_benchmarks() -> int:
    """Run main() and, with --write, put its markdown into BENCHMARKS.md's section."""
    import contextlib
    import io

    write = "--write" in sys.argv
    if write:
        sys.argv.remove("--write")
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        rc = main()
    text = buf.getvalue()
    print(text)
    if write and rc == 0:
        sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
        from benchmarks.mdtable import machine, write_section

        head = (
            "## Calibrated prediction against measured runs (simulator)\n\n"
            f"Command: `python benchmarks/sim_calibration.py {' '.join(sys.argv[1:])} --write`. "
            f"Machine: {machine()}. Method and reading: docs/simulator.md.\n\n"
        )
        write_section("sim_calibration", head + text)
    return rc


if __name__ == "__main__":
    sys.exit(write_benchmarks())
