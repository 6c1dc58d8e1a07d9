"""Run every benchmark one after another and record how long the whole regeneration took.

    python benchmarks/all.py [--write] [--only NAME,NAME]

The benchmarks measure time, so they never share the cores: each runs to completion in its
own process (1 thread per rank) before the next starts. A benchmark that fails does not stop
the others; the exit status is non-zero if any failed. With ``--write`` every benchmark updates
its own section of BENCHMARKS.md (or RELIABILITY.md), and this script adds a section with the
minutes each one took, so the "regenerates in under 30 minutes" claim is a measurement.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.mdtable import machine, table, write_section  # noqa: E402

# In the order `make bench` has always used: cheap loopback ones first, the cluster (which
# needs root) last, so a machine without root still regenerates everything else.
BENCHMARKS = (
    "bsp_vs_ddp",
    "compression",
    "ps_transport",
    "dial",
    "balance",
    "sim_calibration",
    "reliability",
)
CLUSTER = "cluster"
BUDGET_MIN = 30.0


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawTextHelpFormatter
    )
    parser.add_argument("--write", action="store_true", help="update BENCHMARKS.md")
    parser.add_argument("--only", default=None, help="comma-separated subset, for a partial run")
    args = parser.parse_args()
    names = [*BENCHMARKS, CLUSTER]
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            parser.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(names)}")
        names = [n for n in names if n in wanted]
    here = Path(__file__).resolve().parent
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    rows, failed = [], []
    started = time.monotonic()
    for name in names:
        cmd = [sys.executable, str(here / f"{name}.py"), *(["--write"] if args.write else [])]
        print(f"== {name} ({time.strftime('%H:%M:%S')})", flush=True)
        t0 = time.monotonic()
        code = subprocess.call(cmd, env=env)
        minutes = (time.monotonic() - t0) / 60
        print(f"== {name}: exit {code}, {minutes:.1f} min", flush=True)
        if code == 2 and name == CLUSTER:
            status = "skipped (needs root and iproute2)"
        elif code != 0:
            status = f"failed (exit {code})"
            failed.append(name)
        else:
            status = "ok"
        rows.append([f"benchmarks/{name}.py", f"{minutes:.1f}", status])
    total = (time.monotonic() - started) / 60
    print(f"== all: {total:.1f} min; failed: {failed or 'none'}", flush=True)
    if args.write and not args.only:
        write_section(
            "bench_run",
            "## How long `make bench` takes\n\n"
            f"Command: `make bench` (runs `python benchmarks/all.py --write`). Machine: "
            f"{machine()}. One benchmark at a time. Whole run: {total:.1f} min "
            f"(budget {BUDGET_MIN:.0f} min).\n\n" + table(["benchmark", "minutes", "status"], rows),
        )
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
