"""Issue 43, item 6: the multi-rank tier's key scenarios with the CPU oversubscribed.

Busy-loop processes (``--per-core`` per core, 3 by default: a load of about 7 on 2 cores with
the ranks) run while pytest runs the chosen multi-rank tests ``--rounds`` times; any failure is
kept with its test's name and the lines that say why. A false failure under load (a timeout
read as a death, a store call giving up) fails a scenario here that passes on a quiet machine.

``python -m benchmarks.load_stress --rounds 2 --write`` writes its section of RELIABILITY.md.
Not part of ``make bench``: a round takes about 10 minutes under that load on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from benchmarks.harness import busy_loops, machine, table, write_section

ROOT = Path(__file__).resolve().parents[1]
RELIABILITY_MD = ROOT / "RELIABILITY.md"

#: the scenarios: gates and hang diagnosis, a rank's exception, the gradient-ready point, the
#: front door, ZeRO's traps, a parameter server's blame, restarts with checkpoints
SCENARIOS = (
    "tests/ranks/test_gate.py",
    "tests/ranks/test_gate_hardening.py",
    "tests/ranks/test_gradient_ready.py",
    "tests/ranks/test_front_door.py",
    "tests/ranks/test_zero_traps.py",
    "tests/ranks/test_ps_blame.py",
    "tests/ranks/test_bucket_autotune_ranks.py",
    "tests/e2e/test_exit.py",
)


def run_round(paths: list[str], timeout_s: float) -> tuple[int, int, list[str]]:
    """pytest over ``paths`` once: (passed, failed, the failures' lines)."""
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *paths]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(
            command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout_s
        )
    except subprocess.TimeoutExpired:
        return 0, 1, [f"the round ran past {timeout_s:.0f}s"]
    out = done.stdout + done.stderr
    passed = sum(int(n) for n in re.findall(r"(\d+) passed", out))
    failed = sum(int(n) for n in re.findall(r"(\d+) (?:failed|error)", out))
    lines = [line for line in out.splitlines() if line.startswith(("FAILED", "ERROR"))]
    return passed, failed, lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--per-core", type=int, default=3, help="busy loops per core")
    parser.add_argument("--timeout", type=float, default=1800.0, help="seconds per round")
    parser.add_argument("--write", action="store_true", help="write RELIABILITY.md's section")
    args = parser.parse_args()
    cores = os.cpu_count() or 1
    loops = cores * args.per_core
    rows, failures = [], []
    t0 = time.monotonic()
    with busy_loops(loops):
        for r in range(args.rounds):
            passed, failed, lines = run_round(list(SCENARIOS), args.timeout)
            rows.append([str(r + 1), str(passed), str(failed)])
            failures += [f"round {r + 1}: {line}" for line in lines]
            print(f"round {r + 1}: {passed} passed, {failed} failed", flush=True)
    load = os.getloadavg()[0]
    body = "\n".join(
        [
            "## The multi-rank scenarios under load (issue 43, item 6)",
            "",
            f"{machine()}; {loops} busy loops ({args.per_core} per core) beside the "
            f"tests; load average {load:.1f} at the end; {(time.monotonic() - t0) / 60:.0f} "
            f"minutes. `python -m benchmarks.load_stress --rounds {args.rounds} --write`.",
            "",
            "Scenarios: " + ", ".join(f"`{Path(p).name}`" for p in SCENARIOS) + ".",
            "",
            table(["round", "passed", "failed"], rows),
            "",
            *(f"- {line}" for line in failures[:20]),
        ]
    )
    print(body)
    if args.write:
        write_section("load_stress", body, RELIABILITY_MD)


if __name__ == "__main__":
    main()
