"""Reliability under repeated worker loss, with a checkpoint every step: writes RELIABILITY.md.

Per strategy: (1) what a checkpoint every step costs, as the step period (start to start, rank
0) of the same job with ``--checkpoint-every 1`` against the same job without checkpoints, the
two run alternately, ``--repeats`` pairs, median of the per-pair ratios with a 90% bootstrap
interval (``benchmarks.intervals``: the cost is about the size of the noise here, and the
interval says whether a run can tell it from a bound); and measured again in
``--block-runs`` runs of their own, each of ``--block-repeats`` pairs of ``--block``-step blocks
with and without a checkpoint every step, alternating in the same processes
(``benchmarks.reliability_worker``, which says why); (2) the same job
twice, uninterrupted and with SIGKILLs of random worker ranks at random steps, recovered by the
elastic agent from the newest complete checkpoint: the outcome against the clean run (bitwise
for BSP), steps and time lost per kill.

``--strategies`` also takes ``local:H`` and ``diloco:H``, printed only: the file's section holds
``bsp`` and ``async``. With ``--every N`` the step period is read over spans of N steps
(``step_period``), and the in-run blocks, made for a checkpoint every step, are left out.
"""

from __future__ import annotations

import argparse
import json
import random
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path
from tempfile import TemporaryDirectory

import torch

from benchmarks import reliability_worker
from benchmarks.harness import (
    ROOT,
    Harness,
    interleave,
    machine,
    median,
    pair_ratios,
    table,
)
from benchmarks.intervals import median_interval, median_of_medians_interval
from gradsync.processes import forkserver
from gradsync.processes.launch import launch
from gradsync.telemetry.records import read_jsonl

RELIABILITY_MD = ROOT / "RELIABILITY.md"


def run(
    out: Path, args: argparse.Namespace, strategy: str, steps: int, *extra: str
) -> tuple[int, float]:
    cmd = [
        sys.executable, "-m", "gradsync", "run", "--nproc", "2", "--workload", args.workload,
        "--strategy", strategy, "--steps", str(steps), "--seed", str(args.seed),
        "--out", str(out), "--no-plots", "--no-progress", *extra,
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=3600)
    if proc.returncode != 0:
        print(proc.stderr[-3000:], file=sys.stderr)
    return proc.returncode, time.perf_counter() - t0


def jsonl(path: Path) -> list[dict]:
    """A run's jsonl file, as gradsync reads it: a kill can tear its last line."""
    return read_jsonl(path) if path.exists() else []


def final_loss(run_dir: Path) -> float:
    """Mean training loss of rank 0's last 10 steps."""
    rows = sorted(
        (r["step"], r["loss"]) for r in jsonl(run_dir / "metrics.jsonl") if r["rank"] == 0
    )
    last = [loss for _, loss in rows[-10:]]
    return statistics.mean(last) if last else float("nan")


def step_period(run_dir: Path, skip: int = 5, every: int = 1) -> float:
    """Seconds from one step's start to the next on rank 0 (after ``skip`` warm-up steps): the
    step with everything around it, the checkpoint's snapshot included. The median over spans of
    ``every`` steps (one checkpoint each, with a checkpoint every ``every`` steps) of the span's
    time per step: the median of single steps would miss a checkpoint taken every 4th step."""
    starts = sorted(r["time"] for r in jsonl(run_dir / "metrics.jsonl") if r["rank"] == 0)
    starts = starts[skip:]
    spans = [(starts[i + every] - starts[i]) / every for i in range(0, len(starts) - every, every)]
    return statistics.median(spans) if spans else float("nan")


def cost(strategy: str, args: argparse.Namespace) -> list[list[str]]:
    """Step period with a checkpoint every ``args.every`` steps against none, interleaved."""
    configs = {"none": (), "every": ("--checkpoint-every", str(args.every))}
    snapshot: list[float] = []

    def one(name: str, repeat: int) -> float | None:
        with TemporaryDirectory(prefix="gradsync-ckpt-cost-") as tmp:
            rc, _ = run(Path(tmp) / "run", args, strategy, args.cost_steps, *configs[name])
            if rc != 0:
                return None
            snapshot.extend(c["seconds"] for c in jsonl(Path(tmp) / "run/checkpoints/log.jsonl"))
            return step_period(Path(tmp) / "run", every=args.every)

    runs = interleave(list(configs), args.repeats, one, progress=f"{strategy} cost: ")
    with_ckpt = [r["every"] for r in runs]
    without = [r["none"] for r in runs]
    ratios = pair_ratios(with_ckpt, without)
    ratio = median(ratios)
    # Each pair's ratio on stderr: runs of the same code can then be pooled.
    print(f"{strategy} cost: per-pair ratios {[round(r, 4) for r in ratios]}", file=sys.stderr)
    ms = [
        f"{statistics.median(known) * 1e3:.2f} ms" if known else "n/a"
        for known in (
            [x for x in without if x is not None],
            [x for x in with_ckpt if x is not None],
        )
    ]
    return [
        [
            f"step period without checkpoints / with one every {args.every} step(s): median of "
            "runs",
            " / ".join(ms),
        ],
        [
            f"cost of a checkpoint every {args.every} step(s): median of {args.repeats} "
            "per-pair ratios (90% bootstrap interval over the pairs)",
            f"{ratio - 1:+.1%} of step time ({_interval(median_interval(ratios))})"
            if ratio is not None
            else "n/a",
        ],
        [
            "time on the training thread per checkpoint (the snapshot): median",
            f"{statistics.median(snapshot) * 1e3:.2f} ms" if snapshot else "n/a",
        ],
    ]


def in_run_cost(strategy: str, args: argparse.Namespace) -> list[list[str]]:
    """The same cost measured in runs of its own: blocks of steps with and without a checkpoint
    every step, alternating in the same processes (``benchmarks.reliability_worker``),
    ``--block-runs`` such runs. One run's median moved from run to run by more than its own
    pairs spread (+3.2% to +5.8% for five runs of the same code here), so the figure is the
    median of the runs' medians, each run's beside it."""
    per_run, pairs, without, with_ = [], [], [], []
    for _ in range(args.block_runs):
        times = _block_run(strategy, args)
        pairs.append([e / n for e, n in zip(times["every"], times["none"], strict=True)])
        per_run.append(statistics.median(pairs[-1]))
        without.append(statistics.median(times["none"]) * 1e3)
        with_.append(statistics.median(times["every"]) * 1e3)
        # Each run's pairs on stderr, as the separate runs' (``cost``): runs of the same code
        # can then be pooled into one median of run medians.
        rounded = [round(r, 4) for r in pairs[-1]]
        print(f"{strategy} blocks: per-pair ratios of run {len(pairs)} {rounded}", file=sys.stderr)
    return [
        [
            f"cost of a checkpoint every step, in {args.block_runs} runs of "
            f"{args.block_repeats} pairs of {args.block}-step blocks with and without, "
            "alternating: median of the runs' medians of the per-pair ratios (90% bootstrap "
            "interval over the runs and their pairs; each run's median)",
            f"{statistics.median(per_run) - 1:+.1%} of step time "
            f"({_interval(median_of_medians_interval(pairs))}; "
            f"{', '.join(f'{r - 1:+.1%}' for r in per_run)})",
        ],
        [
            "mean step time of those blocks without / with: median",
            f"{statistics.median(without):.2f} ms / {statistics.median(with_):.2f} ms",
        ],
    ]


def _interval(ends: tuple[float, float]) -> str:
    """A bootstrap interval of a ratio, as a cost: ``+2.6% to +5.2%``."""
    return f"{ends[0] - 1:+.1%} to {ends[1] - 1:+.1%}"


def _block_run(strategy: str, args: argparse.Namespace) -> dict[str, list[float]]:
    """One run of alternating blocks: mean seconds per step of each block, by kind."""
    with TemporaryDirectory(prefix="gradsync-ckpt-blocks-") as tmp:
        job = {
            "workload": args.workload,
            "seed": args.seed,
            "strategy": strategy,
            "directory": tmp,
            "repeats": args.block_repeats,
            "block": args.block,
        }
        nproc = 3 if strategy == "async" else 2  # async: 2 workers and a server
        times: dict[str, list[float]] = launch(reliability_worker.worker, (job,), nproc=nproc)[0]
    return times


def restart_note() -> str:
    """How the restarted workers of these runs started, which the time to recover depends on."""
    how = (
        "were forked from the launcher's forkserver, which imported torch once"
        if forkserver.available()
        else "were spawned (no forkserver here: not Linux, or a GPU is visible), each "
        "importing torch again"
    )
    return (
        f"The time from a kill to the next completed step: the restarted workers {how} "
        "(`gradsync.processes.forkserver`). Spawned, this time was 2.5 s (BSP) and 3.7 s "
        "(async) on this "
        "machine with the same command (RELIABILITY.md at f386f17). Forked, one BSP kill taken "
        "apart (one-off timestamps, two runs): 0.2-0.3 s from the kill to the new workers' start "
        "(the agent noticing the death, it polls every 0.1 s; stopping the survivor; a new "
        "rendezvous), then about 0.1 s to the first step (the process group, the model, the "
        "checkpoint's load). Until 0baa4a0 each start also listed the whole standard library for "
        "charlm's text (0.36 s): 0.6 s (BSP) and 1.2 s (async) at the median then.\n"
    )


def faults(strategy: str, args: argparse.Namespace) -> tuple[str, list[list[str]]]:
    """One clean and one faulty run of ``strategy``; returns the kill spec and the table rows."""
    rng = random.Random(args.seed)
    steps = sorted(rng.sample(range(1, args.steps), args.kills))
    kills = [(rng.randrange(2), s) for s in steps]  # worker ranks only (servers come after)
    spec = ",".join(f"{r}:{s}" for r, s in kills)
    every = ("--checkpoint-every", str(args.every))
    with TemporaryDirectory(prefix="gradsync-reliability-") as tmp:
        clean, faulty = Path(tmp) / "clean", Path(tmp) / "faulty"
        rc_clean, wall_clean = run(clean, args, strategy, args.steps, *every)
        restarts = ("--kill", spec, "--max-restarts", str(args.kills))
        rc, wall = run(faulty, args, strategy, args.steps, *every, *restarts)
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
    lost_cell = f"{statistics.median(lost):.0f} ({max(lost)})" if lost else "n/a"
    outage_cell = f"{statistics.median(outage):.1f} s ({max(outage):.1f} s)" if outage else "n/a"
    if strategy != "async":  # the others replay a rolled-back step exactly
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
    ]
    return spec, rows


TITLES = {
    "bsp": "BSP, 2 ranks",
    "async": "async parameter server, 2 workers + 1 server (the server's shard, optimizer "
    "state and clocks are checkpointed with the workers)",
}
#: strategies measured too, but never written to the file (its section holds ``TITLES``)
PRINTED_ONLY = re.compile(r"(local|diloco):[1-9][0-9]*")


def _title(strategy: str) -> str:
    return TITLES.get(strategy) or f"`{strategy}`, 2 ranks"


def main() -> None:
    # Its own marked section of the file (the tried/expected/now table sits beside it), and
    # nothing in it is repeated.
    h = Harness(
        "benchmarks.reliability", __doc__, repeats=3, section="reliability", md=RELIABILITY_MD
    )
    p = h.parser
    p.add_argument("--workload", default="charlm")
    p.add_argument("--steps", type=int, default=500, help="steps of the runs with kills")
    p.add_argument(
        "--cost-steps",
        type=int,
        default=300,
        help="steps of the cost runs (300: the per-pair ratios spread about half as much as "
        "with 150, 16 pairs of each here)",
    )
    p.add_argument("--kills", type=int, default=20)
    p.add_argument("--every", type=int, default=1, help="checkpoint every N steps")
    p.add_argument("--seed", type=int, default=7)
    p.add_argument(
        "--strategies",
        default="bsp,async",
        help="comma-separated: bsp, async, and (printed only) local:H, diloco:H",
    )
    p.add_argument(
        "--block",
        type=int,
        default=64,
        help="steps per block of the in-run cost (64: one file written per block under bsp, "
        "as in a run)",
    )
    p.add_argument("--block-repeats", type=int, default=12, help="pairs of blocks, in-run cost")
    p.add_argument("--block-runs", type=int, default=3, help="runs of block pairs, in-run cost")
    args = h.parse(
        steps=60, kills=2, cost_steps=40, repeats=1, block=8, block_repeats=2, block_runs=1
    )
    if args.block_runs < 1 or args.block_repeats < 1:
        h.error(
            f"--block-runs and --block-repeats take 1 or more; got {args.block_runs} and "
            f"{args.block_repeats}"
        )
    strategies = [x.strip() for x in args.strategies.split(",") if x.strip()]
    unknown = [x for x in strategies if x not in TITLES and not PRINTED_ONLY.fullmatch(x)]
    if not strategies or unknown:
        h.error(
            f"--strategies takes {', '.join(TITLES)}, local:H and diloco:H; got {args.strategies!r}"
        )
    if args.write and not set(strategies) <= set(TITLES):
        h.error(f"--write takes --strategies among {', '.join(TITLES)}; the others are printed")
    sections, spec = [], ""
    for strategy in strategies:
        rows = cost(strategy, args) + (in_run_cost(strategy, args) if args.every == 1 else [])
        spec, kill_rows = faults(strategy, args)
        sections.append(f"### {_title(strategy)}\n\n" + table("measure | value", rows + kill_rows))
    # Every setting spelled out, so the command reproduces the file whatever the defaults are.
    cmd = h.command(
        f"--workload {args.workload} --steps {args.steps} --cost-steps {args.cost_steps} "
        f"--repeats {args.repeats} --kills {args.kills} --every {args.every} --seed {args.seed} "
        f"--block {args.block} --block-repeats {args.block_repeats} --block-runs {args.block_runs} "
        f"--strategies {','.join(strategies)}".split()
        + (["--write"] if args.write else [])
    )
    text = (
        "## Repeated worker loss, a checkpoint every "
        + ("step" if args.every == 1 else f"{args.every} steps")
        + "\n\n"
        f"Command: `{cmd}`. Machine: {machine()}.\n\n"
        f"`{args.workload}`, 2 worker ranks. Cost: {args.repeats} pairs of {args.cost_steps}-step "
        f"runs, with a checkpoint every {args.every} step(s) and without, run alternately. "
        f"Faults: {args.steps} steps, a checkpoint every {args.every} step(s), {args.kills} "
        "SIGKILLs of a random worker rank at random steps "
        f"(`--kill {spec}`, the same for every strategy), "
        f"`--max-restarts {args.kills}`. Each kill makes torch's elastic agent stop the group and "
        "start a new round; every rank resumes from the newest complete checkpoint. Checkpoints "
        "are written in the background (`sync.save(wait=False)`): a step pays for a copy of its "
        "state, and a kill loses the steps whose checkpoint was not committed yet.\n\n"
        + "\n\n".join(sections)
        + "\n\n"
        + restart_note()
    )  # fmt: skip
    h.finish(text)


if __name__ == "__main__":
    main()
