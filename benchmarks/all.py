"""Run every benchmark one after another and record how long the whole regeneration took.

The benchmarks measure time, so each runs alone in its own process before the next starts; one
that fails does not stop the others (the exit status says). With ``--write`` each updates its
own section and this script adds the minutes each took, so "regenerates in under 30 minutes"
is a measurement; ``--quick`` passes ``--quick`` on: a smoke run of the lot.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

from benchmarks.harness import ROOT, Harness, machine, table

# In the order `make bench` has always used: cheap loopback ones first, the cluster (which
# needs root) last, so a machine without root still regenerates everything else.
BENCHMARKS = (
    "bsp_vs_ddp",
    "compression",
    "codec_speed",
    "guard_costs",  # issue 44; about 0.6 minutes (2026-11-30), which the 40-minute budget holds
    "store_calls",  # issue 44; a few seconds
    "ps_transport",
    "dial",
    "hogwild",
    "balance",
    "sim_calibration",
    "reliability",
    "zero",  # 3.8 minutes (2026-11-29, with torch's pieces at 4 ranks; was 2.7 without them)
    "heldout",  # about 1.4 minutes
    # About 4.6 minutes (2026-11-28, on a shared machine): with it the whole run comes to about
    # 38.5 of its 40 minutes (33.4 timed, heldout's 0.9, reliability 0.4 shorter since).
    "checkpoint_vs_dcp",
    "zero_cluster",  # needs root (exit 2 without), like the cluster; about 4 minutes
    "topology",  # needs root too (exit 2 without), like the cluster; a few minutes
    "streaming_sim",  # needs root too; about 2 minutes (4 gradsync runs on the cluster)
)
# Not run by `make bench`: benchmarks/frontier.py (issue 16's goals on the emulated cluster,
# about 6 minutes at its smallest) would take the whole run past its 40-minute budget (33.4
# minutes timed without it and without heldout, which was added then); run it on its own (as
# root): `.venv/bin/python -m benchmarks.frontier --write`. Nor is benchmarks/start_method.py
# (about 5 minutes; RELIABILITY.md, start_method). Nor is benchmarks/gpu.py, which needs
# a CUDA device (issue 18): `python -m benchmarks.gpu --write` on a machine with one. Nor is
# benchmarks/gate.py (issue 44, about a minute): `python -m benchmarks.gate --write`. Nor is
# benchmarks/host_overhead.py (issue 44, about a minute; it would take the run past its
# budget too): `python -m benchmarks.host_overhead --write`. Nor is benchmarks/kept_encoding.py
# (issue 40, about half a minute): `python -m benchmarks.kept_encoding --write`.
CLUSTER = "cluster"
#: these exit 2 where they cannot build an emulated cluster (no root, no iproute2): skipped
NEEDS_ROOT = (CLUSTER, "topology", "zero_cluster", "streaming_sim")
BUDGET_MIN = 40.0


def main() -> int:
    h = Harness("benchmarks.all", __doc__, repeats=None, section="bench_run")
    h.parser.add_argument("--only", default=None, help="comma-separated subset, for a partial run")
    args = h.parse()
    names = [*BENCHMARKS, CLUSTER]
    if args.only:
        wanted = [n.strip() for n in args.only.split(",") if n.strip()]
        unknown = sorted(set(wanted) - set(names))
        if unknown:
            h.error(f"unknown benchmark(s) {unknown}; choose from {', '.join(names)}")
        names = [n for n in names if n in wanted]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    # --md is not passed on: every benchmark writes its own file (BENCHMARKS.md, RELIABILITY.md).
    passed = [f for f, on in (("--write", args.write), ("--quick", args.quick)) if on]
    rows, failed = [], []
    started = time.monotonic()
    for name in names:
        cmd = [sys.executable, "-m", f"benchmarks.{name}", *passed]
        print(f"== {name} ({time.strftime('%H:%M:%S')})", flush=True)
        t0 = time.monotonic()
        # From the repository root, where `benchmarks` is importable as a package.
        code = subprocess.call(cmd, env=env, cwd=ROOT)
        minutes = (time.monotonic() - t0) / 60
        print(f"== {name}: exit {code}, {minutes:.1f} min", flush=True)
        if code == 2 and name in NEEDS_ROOT:
            status = "skipped (needs root and iproute2)"
        elif code != 0:
            status = f"failed (exit {code})"
            failed.append(name)
        else:
            status = "ok"
        rows.append([f"benchmarks/{name}.py", f"{minutes:.1f}", status])
    total = (time.monotonic() - started) / 60
    print(f"== all: {total:.1f} min; failed: {failed or 'none'}", flush=True)
    text = (
        "## How long `make bench` takes\n\n"
        f"Command: `make bench` (runs `{h.command()}`). Machine: "
        f"{machine()}. One benchmark at a time. Whole run: {total:.1f} min "
        f"(budget {BUDGET_MIN:.0f} min).\n\n" + table("benchmark | minutes | status", rows)
    )
    # A partial run says nothing about the whole one: its timings are printed only.
    h.finish(text, skip="a partial run (--only)" if args.only else None)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
