"""Reliability under repeated worker loss: writes RELIABILITY.md.

    python benchmarks/reliability.py [--steps 500 --kills 20 --every 25 --seed 7]

Runs the same BSP job twice through `gradsync run`: once uninterrupted, once with KILLS
SIGKILLs of random ranks at random steps (--kill, --max-restarts). Reports whether the faulty
run completed, whether its final parameters are bitwise equal to the clean run's, the steps
lost per failure (kill step minus the checkpoint resumed from), the time from each kill to the
next completed step, and the checkpoint cost relative to the step time.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.mdtable import machine, table  # noqa: E402

RELIABILITY_MD = Path(__file__).resolve().parent.parent / "RELIABILITY.md"


def run(out: Path, args: argparse.Namespace, *extra: str) -> tuple[int, float]:
    cmd = [
        sys.executable, "-m", "gradsync.cli", "run", "--nproc", "2", "--workload", "mlp",
        "--steps", str(args.steps), "--seed", str(args.seed), "--checkpoint-every",
        str(args.every), "--out", str(out), "--no-plots", "--no-progress", *extra,
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode, time.perf_counter() - t0


def jsonl(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--every", type=int, default=25, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--write", action="store_true")
    args = p.parse_args()
    rng = random.Random(args.seed)
    steps = sorted(rng.sample(range(1, args.steps), args.kills))
    kills = [(rng.randrange(2), s) for s in steps]
    spec = ",".join(f"{r}:{s}" for r, s in kills)
    with TemporaryDirectory(prefix="gradsync-reliability-") as tmp:
        clean, faulty = Path(tmp) / "clean", Path(tmp) / "faulty"
        rc_clean, wall_clean = run(clean, args)
        rc, wall = run(faulty, args, "--kill", spec, "--max-restarts", str(args.kills))
        completed = rc == 0 and rc_clean == 0
        equal = False
        if completed:
            a = torch.load(clean / "final_model.pt", weights_only=True)
            b = torch.load(faulty / "final_model.pt", weights_only=True)
            equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        fired = sorted(
            (json.loads(f.read_text()) for f in (faulty / "faults").glob("kill-*.json")),
            key=lambda k: k["time"],
        )
        recoveries = sorted(
            jsonl(faulty / "faults" / "recoveries.jsonl"), key=lambda r: r["first_step_done"]
        )
        lost, outage = [], []
        for k in fired:
            after = next((r for r in recoveries if r["first_step_done"] > k["time"]), None)
            if after is not None:
                lost.append(k["step"] - after["resumed_at_step"])
                outage.append(after["first_step_done"] - k["time"])
        ckpt = [c["seconds"] for c in jsonl(clean / "checkpoints" / "log.jsonl")]
        step_times = [
            r["compute"] + r["sync"] for r in jsonl(clean / "metrics.jsonl") if r["rank"] == 0
        ]
    step_median = statistics.median(step_times) if step_times else float("nan")
    ckpt_median = statistics.median(ckpt) if ckpt else float("nan")
    lost_cell = f"{statistics.median(lost):.0f} ({max(lost)})" if lost else "n/a"
    outage_cell = f"{statistics.median(outage):.1f} s ({max(outage):.1f} s)" if outage else "n/a"
    relative = ckpt_median / step_median
    rows = [
        ["run completed", "yes" if completed else f"no (exit {rc})"],
        ["kills injected / fired / recovered", f"{args.kills} / {len(fired)} / {len(outage)}"],
        ["final parameters bitwise equal to the uninterrupted run", "yes" if equal else "no"],
        ["steps lost per failure: median (max)", lost_cell],
        ["kill to next completed step: median (max)", outage_cell],
        ["wall time: faulty run / clean run", f"{wall:.0f} s / {wall_clean:.0f} s"],
        ["checkpoint save (2 ranks, barriers included): median", f"{ckpt_median * 1e3:.1f} ms"],
        ["median step time (clean run)", f"{step_median * 1e3:.1f} ms"],
        [
            "checkpoint cost relative to one step",
            f"{relative:.2f}x, once every {args.every} steps "
            f"({relative / args.every:.1%} of step time)",
        ],
    ]
    cmd = (
        f"python benchmarks/reliability.py --steps {args.steps} --kills {args.kills} "
        f"--every {args.every} --seed {args.seed} --write"
    )
    text = (
        "# Reliability\n\n"
        f"Command: `{cmd}`. Machine: {machine()}.\n\n"
        f"BSP on `mlp` (100k parameters), 2 ranks, {args.steps} steps, a checkpoint every "
        f"{args.every} steps, {args.kills} SIGKILLs of a random rank at random steps "
        f"(`--kill {spec}`), `--max-restarts {args.kills}`. Each kill makes torch's elastic "
        "agent stop the group and start a new round; workers resume from the newest checkpoint.\n\n"
        + table(["measure", "value"], rows)
        + "\n\nThe time from a kill to the next completed step is dominated by starting new "
        "worker processes (Python and torch imports, rendezvous, gloo connection set-up) on this "
        "machine, not by loading the checkpoint.\n"
    )  # fmt: skip
    print(text)
    if args.write:
        RELIABILITY_MD.write_text(text)


if __name__ == "__main__":
    main()
