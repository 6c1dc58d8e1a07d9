"""Issue 49: does every finished run exit 0? Two-rank scripts launched with torchrun, as users
run them, many times each, with busy-loop processes keeping every core loaded (the abort
gradsync fixed needed a gloo thread to be descheduled at the script's last exchange).

Two script shapes: ``teardown`` ends with ``sync.report()``, ``sync.close()`` and
``dist.destroy_process_group()``; ``bare`` ends after its last step with none of them. Each
with ``bsp``, ``zero:1`` and ``local:4``. A run fails when torchrun exits non-zero (an abort
of one rank shows as exit code -6 there); the failures' lines naming the cause are kept.

``python -m benchmarks.exit_stress --runs 50 --write`` writes its section of RELIABILITY.md;
``PYTHONPATH=OTHER_CHECKOUT`` runs another version of gradsync (the baseline). Not part of
``make bench``: 300 launches take about 25 minutes on 2 cores.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.harness import busy_loops, machine, table, write_section

ROOT = Path(__file__).resolve().parents[1]
RELIABILITY_MD = ROOT / "RELIABILITY.md"

SCRIPT = """\
import sys

import torch
import torch.distributed as dist

import gradsync as gs

torch.set_num_threads(1)
gs.init()
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))
optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
sync = gs.Synchronizer(model, optimizer, strategy=sys.argv[1])
for step in range(20):
    with sync.step():
        x, y = torch.randn(16, 32), torch.randint(0, 4, (16,))
        torch.nn.functional.cross_entropy(model(x), y).backward()
if sys.argv[2] == "teardown":
    sync.report()
    sync.close()
    dist.destroy_process_group()
"""

SHAPES = ("teardown", "bare")
STRATEGIES = ("bsp", "zero:1", "local:4")


def launch(script: Path, strategy: str, shape: str, timeout_s: float) -> tuple[int, str]:
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2"]
    command += ["--rdzv-backend", "c10d", "--rdzv-endpoint", "127.0.0.1:0"]
    command += [str(script), strategy, shape]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    try:
        done = subprocess.run(
            command, env=env, capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except subprocess.TimeoutExpired:
        return 124, "timed out"
    cause = [
        line
        for line in done.stderr.splitlines()
        if "terminate called" in line or "exitcode" in line or "Error" in line
    ]
    return done.returncode, " | ".join(cause[:2])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=50, help="launches per shape and strategy")
    parser.add_argument("--load", type=int, default=os.cpu_count() or 1, help="busy loops")
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per launch")
    parser.add_argument("--label", default="gradsync", help="the version's name in the table")
    parser.add_argument("--write", action="store_true", help="write RELIABILITY.md's section")
    args = parser.parse_args()
    rows, failures = [], []
    t0 = time.monotonic()
    with busy_loops(args.load), tempfile.TemporaryDirectory(prefix="gradsync-exit-") as tmp:
        script = Path(tmp) / "train.py"
        script.write_text(SCRIPT)
        for shape in SHAPES:
            for strategy in STRATEGIES:
                bad = 0
                for i in range(args.runs):
                    rc, cause = launch(script, strategy, shape, args.timeout)
                    if rc != 0:
                        bad += 1
                        failures.append(f"{shape} {strategy} run {i + 1}: rc {rc}: {cause}")
                rows.append([shape, strategy, str(args.runs), str(bad)])
                print(f"{shape:9} {strategy:8} {bad} of {args.runs} failed", flush=True)
    minutes = (time.monotonic() - t0) / 60
    body = "\n".join(
        [
            f"## Every finished run exits 0 (issue 49, {args.label})",
            "",
            f"{machine()}; {args.load} busy loops beside the 2 ranks; {minutes:.0f} minutes.",
            f"`python -m benchmarks.exit_stress --runs {args.runs} --write` (issue 49).",
            "",
            table(["script ends with", "strategy", "runs", "non-zero exits"], rows),
            "",
            *(f"- {line}" for line in failures[:10]),
        ]
    )
    print(body)
    if args.write:
        write_section("exit_stress", body, RELIABILITY_MD)


if __name__ == "__main__":
    main()
