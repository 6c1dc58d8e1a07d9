"""Reliability under repeated worker loss: writes RELIABILITY.md.

Per strategy, the same `gradsync run` job twice: uninterrupted, and with SIGKILLs of random
worker ranks at random steps, recovered by the elastic agent from checkpoints; the faulty run's
outcome against the clean one (bitwise for BSP), steps and time lost per kill, checkpoint cost.
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

from benchmarks.harness import ROOT, Harness, machine, table

RELIABILITY_MD = ROOT / "RELIABILITY.md"


def run(out: Path, args: argparse.Namespace, strategy: str, *extra: str) -> tuple[int, float]:
    cmd = [
        sys.executable, "-m", "gradsync.cli", "run", "--nproc", "2", "--workload", "mlp",
        "--strategy", strategy,
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


def final_loss(run_dir: Path) -> float:
    """Mean training loss of rank 0's last 10 steps."""
    rows = sorted(
        (r["step"], r["loss"]) for r in jsonl(run_dir / "metrics.jsonl") if r["rank"] == 0
    )
    last = [loss for _, loss in rows[-10:]]
    return statistics.mean(last) if last else float("nan")


def measure(strategy: str, args: argparse.Namespace) -> tuple[str, list[list[str]]]:
    """One clean and one faulty run of ``strategy``; returns the kill spec and the table rows."""
    rng = random.Random(args.seed)
    steps = sorted(rng.sample(range(1, args.steps), args.kills))
    kills = [(rng.randrange(2), s) for s in steps]  # worker ranks only (servers come after)
    spec = ",".join(f"{r}:{s}" for r, s in kills)
    with TemporaryDirectory(prefix="gradsync-reliability-") as tmp:
        clean, faulty = Path(tmp) / "clean", Path(tmp) / "faulty"
        rc_clean, wall_clean = run(clean, args, strategy)
        rc, wall = run(faulty, args, strategy, "--kill", spec, "--max-restarts", str(args.kills))
        completed = rc == 0 and rc_clean == 0
        equal = False
        if completed:
            a = torch.load(clean / "final_model.pt", weights_only=True)
            b = torch.load(faulty / "final_model.pt", weights_only=True)
            equal = a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        losses = (final_loss(faulty), final_loss(clean))
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
    if strategy == "bsp":
        same = ["final parameters bitwise equal to the uninterrupted run", "yes" if equal else "no"]
    else:
        same = [
            "final loss (last 10 steps), faulty / uninterrupted run (not bitwise: async)",
            f"{losses[0]:.4f} / {losses[1]:.4f} ({losses[0] / losses[1] - 1:+.1%})",
        ]
    rows = [
        ["run completed", "yes" if completed else f"no (exit {rc})"],
        ["kills injected / fired / recovered", f"{args.kills} / {len(fired)} / {len(outage)}"],
        same,
        ["steps lost per failure: median (max)", lost_cell],
        ["kill to next completed step: median (max)", outage_cell],
        ["wall time: faulty run / clean run", f"{wall:.0f} s / {wall_clean:.0f} s"],
        ["checkpoint save (all ranks, barriers included): median", f"{ckpt_median * 1e3:.1f} ms"],
        ["median step time (clean run)", f"{step_median * 1e3:.1f} ms"],
        [
            "checkpoint cost relative to one step",
            f"{relative:.2f}x, once every {args.every} steps "
            f"({relative / args.every:.1%} of step time)",
        ],
    ]
    return spec, rows


TITLES = {
    "bsp": "BSP, 2 ranks",
    "async": "async parameter server, 2 workers + 1 server (the server's shard, optimizer "
    "state and clocks are checkpointed with the workers)",
}


def main() -> None:
    # Its own marked section of the file (the tried/expected/now table sits beside it), and
    # nothing in it is repeated.
    h = Harness(
        "benchmarks.reliability", __doc__, repeats=None, section="reliability", md=RELIABILITY_MD
    )
    p = h.parser
    p.add_argument("--steps", type=int, default=500)
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--every", type=int, default=25, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--strategies", default="bsp,async", help="comma-separated: bsp, async")
    args = h.parse(steps=60, kills=2, every=10)
    strategies = [x.strip() for x in args.strategies.split(",") if x.strip()]
    if not strategies or not set(strategies) <= set(TITLES):
        h.error(f"--strategies takes {', '.join(TITLES)}; got {args.strategies!r}")
    sections, spec = [], ""
    for strategy in strategies:
        spec, rows = measure(strategy, args)
        sections.append(f"### {TITLES[strategy]}\n\n" + table("measure | value", rows))
    # Every setting spelled out, so the command reproduces the file whatever the defaults are.
    cmd = h.command(
        f"--steps {args.steps} --kills {args.kills} --every {args.every} --seed {args.seed} "
        f"--strategies {','.join(strategies)} --write".split()
    )
    text = (
        "## Repeated worker loss\n\n"
        f"Command: `{cmd}`. Machine: {machine()}.\n\n"
        f"`mlp` (100k parameters), {args.steps} steps, a checkpoint every "
        f"{args.every} steps, {args.kills} SIGKILLs of a random worker rank at random steps "
        f"(`--kill {spec}`, the same for every strategy), `--max-restarts {args.kills}`. Each "
        "kill makes torch's elastic agent stop the group and start a new round; every rank "
        "resumes from the newest checkpoint.\n\n"
        + "\n\n".join(sections)
        + "\n\nThe time from a kill to the next completed step is dominated by starting new "
        "worker processes (Python and torch imports, rendezvous, gloo connection set-up) on this "
        "machine, not by loading the checkpoint.\n"
    )  # fmt: skip
    h.finish(text)


if __name__ == "__main__":
    main()
