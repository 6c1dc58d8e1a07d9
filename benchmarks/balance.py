"""Load-balanced BSP with a straggler, against plain BSP and against no straggler.

Runs the `gradsync run` worker in two setups, each as BSP without a straggler, BSP with one and
balanced BSP with one: 4 ranks with `--slow 3:2`, the set-up issue 5 names, and 2 ranks with
`--slow 1:2`, which gives each rank a core on a 2-core machine, where the slowdown costs what it
says. Workload `charlm`, whose compute grows with a rank's samples, which is what balancing
moves; the default `mlp`'s few milliseconds are mostly fixed costs that no share changes.
"""

from __future__ import annotations

import argparse
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from benchmarks.harness import REVERSE, Harness, interleave, machine, median_of_ratios, table
from gradsync.processes.launch import launch
from gradsync.runner.config import RunConfig
from gradsync.runner.worker import run_worker
from gradsync.telemetry.records import StepRecord, read_records
from gradsync.telemetry.report import RunReport

SEED = 0
BATCH = 16  # per rank, the gradsync run default


@dataclass(frozen=True)
class Setup:
    nproc: int
    slow_rank: int
    factor: float

    @property
    def slow(self) -> str:
        return f"{self.slow_rank}:{self.factor:g}"

    @property
    def title(self) -> str:
        return f"{self.nproc} ranks, `--slow {self.slow}`"


SETUPS = (Setup(4, 3, 2.0), Setup(2, 1, 2.0))
CONFIGS = {  # name: (straggler, balance)
    "no straggler": (False, False),
    "BSP, straggler": (True, False),
    "balanced BSP, straggler": (True, True),
}


def rate(records: list[StepRecord], first_step: int = 0) -> float:
    """All ranks' samples per second of wall time over steps >= first_step."""
    recs = [r for r in records if r.step >= first_step]
    start = min(r.time for r in recs)
    end = max(r.time + r.compute + r.sync for r in recs)
    return sum(r.samples for r in recs) / (end - start)


def run_one(setup: Setup, name: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    straggler, balance = CONFIGS[name]
    cfg = RunConfig(
        nproc=setup.nproc,
        workload=args.workload,
        steps=args.steps,
        batch_size=BATCH,
        seed=SEED,
        slow=setup.slow if straggler else None,
        balance=balance,
        progress=False,
        plots=False,
        out=str(out),
    )
    out.mkdir(parents=True)
    cfg.save(out)
    launch(run_worker, (cfg.to_dict(),), nproc=cfg.processes, threads=cfg.threads)
    records = read_records(out)
    last = max(r.step for r in records)
    slow_share = [r.samples for r in records if r.step == last and r.rank == setup.slow_rank]
    return {
        "whole": rate(records),
        "steady": rate(records, args.warmup),
        "tax": RunReport.from_records([r for r in records if r.step >= args.warmup]).barrier_tax,
        "slow_rank_samples": slow_share[0],
    }


Repeats = list[dict[str, dict[str, Any]]]


def run(setup: Setup, args: argparse.Namespace, out: Path) -> Repeats:
    names = list(CONFIGS)

    def one(name: str, r: int) -> dict[str, Any]:
        return run_one(setup, name, args, out / f"{setup.nproc}-r{r}-{names.index(name)}")

    return interleave(names, args.repeats, one, REVERSE, progress=f"{setup.title}, ")


def render_setup(setup: Setup, repeats: Repeats) -> str:
    def med(name: str, key: str, over: str | None = None) -> float:
        """Median over repeats of ``name``'s figure (over ``over``'s in the same repeat)."""
        dens = [rep[over][key] if over else 1.0 for rep in repeats]
        value = median_of_ratios([rep[name][key] for rep in repeats], dens)
        assert value is not None
        return value

    plain, balanced, clean = "BSP, straggler", "balanced BSP, straggler", "no straggler"
    n, f = setup.nproc, setup.factor
    rows = [
        [
            name,
            f"{med(name, 'steady'):.0f}",
            f"{med(name, 'steady', plain):.2f}",
            f"{med(name, 'steady', clean):.2f}",
            f"{med(name, 'whole', plain):.2f}",
            f"{med(name, 'whole', clean):.2f}",
            f"{med(name, 'tax'):.1%}",
            f"{med(name, 'slow_rank_samples'):.0f} of {BATCH * n}",
        ]
        for name in CONFIGS
    ]
    body = table(
        (
            "configuration | samples/s (steady) | / plain BSP (steady) | "
            "/ no straggler (steady) | / plain BSP (whole run) | / no straggler (whole run) | "
            f"barrier tax (steady) | rank {setup.slow_rank} samples, last step"
        ),
        rows,
    )
    # Reference from the slowdown alone, with a core per rank and compute proportional to
    # samples: shares follow speeds (1, ..., 1, 1/factor), so balanced BSP keeps sum(speeds) /
    # n of the no-straggler rate and beats plain BSP by sum(speeds) / (n / factor). A fixed
    # per-step cost and shared cores both move the measurement away from it.
    speeds = n - 1 + 1 / f
    ideal_clean, ideal_plain = speeds / n, speeds / (n / f)
    vs_plain, vs_clean = med(balanced, "steady", plain), med(balanced, "steady", clean)
    plain_clean = med(plain, "steady", clean)
    cores = os.cpu_count() or 1
    text = (
        f"Balanced BSP ran at {vs_plain:.2f}x plain BSP's samples/s with the straggler and at "
        f"{vs_clean:.2f}x the no-straggler run (steady state); plain BSP with the straggler "
        f"ran at {plain_clean:.2f}x the no-straggler run. The idealised reference for a "
        f"{f:g}x slower rank of {n}, with a core per rank and compute proportional to "
        f"samples, is {ideal_plain:.2f}x plain BSP and {ideal_clean:.2f}x no straggler (and "
        f"plain BSP at {1 / f:.2f}x)."
    )
    if cores < n:
        text += (
            f" This machine has {cores} cores for {n} ranks, so ranks time-share cores: the "
            "injected slowdown is a sleep proportional to the straggler's own measured "
            "compute, during which its core goes to the other ranks, so neither the slowdown "
            "nor the gain from balancing is the one-core-per-rank figure above."
        )
    return f"### {setup.title}\n\n{body}\n\n{text}\n"


def render(results: dict[Setup, Repeats], args: argparse.Namespace, command: str) -> str:
    head = (
        "## Load-balanced BSP with a straggler (issue 5)\n\n"
        f"Command: `{command}` (repeats {args.repeats}, {args.steps} steps, steady state from "
        f"step {args.warmup}, seed {SEED}). Machine: {machine()}. Workload {args.workload}, "
        f"batch {BATCH} per rank, 1 thread per rank, gloo on loopback; the straggler is "
        "slowed 2x where stated. Medians over repeats of ratios within the same repeat; the "
        "three configurations of a setup run in alternating order (forward, then reversed). "
        "The 4-rank setup is the one issue 5 names; the 2-rank one gives every rank a core "
        "on a 2-core machine, where the slowdown costs what it says and balancing can win it "
        "back.\n"
    )
    return head + "".join("\n" + render_setup(s, results[s]) for s in results)


def main() -> None:
    h = Harness("benchmarks.balance", __doc__, repeats=2)
    h.parser.add_argument("--steps", type=int, default=90)
    h.parser.add_argument("--warmup", type=int, default=30, help="steps left out of 'steady'")
    h.parser.add_argument("--workload", default="charlm", help="charlm (default) or mlp")
    args = h.parse(repeats=1, steps=20, warmup=10)
    if args.warmup >= args.steps:
        h.error(f"--warmup {args.warmup} must be less than --steps {args.steps}")
    with tempfile.TemporaryDirectory(prefix="gradsync-balance-") as tmp:
        results = {setup: run(setup, args, Path(tmp)) for setup in SETUPS}
    h.finish(render(results, args, h.command()))


if __name__ == "__main__":
    main()
