"""The synchronization dial with a straggler: every strategy against BSP, 4 workers, charlm.

Each repeat runs `gradsync.runner.compare.run_comparison` over the strategies, rank 3 slowed 2x, in
alternating order, and every figure is a ratio against BSP from the same repeat. A second,
shorter set (`--jitter-repeats`, 0 skips it) moves the straggler every step: that is where a
staleness slack can pay off, unlike with a straggler that stays slow.
"""

from __future__ import annotations

import argparse
import os
import re
import sys
import tempfile
from dataclasses import replace
from pathlib import Path
from typing import Any

from benchmarks.harness import REVERSE, Harness, machine, median, median_of_ratios, order, table
from gradsync.runner.compare import run_comparison
from gradsync.runner.config import RunConfig
from gradsync.strategies import uses_servers
from gradsync.telemetry.records import StepRecord, read_records
from gradsync.workloads import make_workload

STRATEGIES = ("bsp", "ssp:2", "async", "local:8", "diloco:16")
SLOW_RANK, SLOW_FACTOR = 3, 2.0
SLOW = f"{SLOW_RANK}:{SLOW_FACTOR:g}"
NPROC = 4
SEED = 0
EXPECTED_SPEEDUP = 1.3  # the expectation for ssp and async against BSP
JITTER_STRATEGIES = ("bsp", "ssp:2", "async")
JITTER_STEPS = 50
JITTER_FACTOR = 3.0
Repeats = list[dict[str, dict[str, Any]]]  # per repeat, run_comparison's row by strategy


def jitter_slow(steps: int, nproc: int = NPROC, factor: float = JITTER_FACTOR) -> str:
    """A straggler that moves every step: rank s mod nproc is slowed ``factor``x at step s."""
    return ",".join(f"{s % nproc}:{factor:g}@{s}-{s + 1}" for s in range(steps))


def run_dirname(spec: str) -> str:
    """The directory ``run_comparison`` gives a strategy's run under its ``out``: the spec with
    every run of other characters than letters and digits made one '-' (``ssp:2`` -> ``ssp-2``).
    Kept in step with gradsync.runner.compare by hand; a mismatch fails loudly (no metrics
    found)."""
    return re.sub(r"[^A-Za-z0-9]+", "-", spec).strip("-")


def _all_busy_stop(records: list[StepRecord]) -> float:
    """When the first worker finished its last step."""
    ends: dict[int, float] = {}
    for r in records:
        ends[r.rank] = max(ends.get(r.rank, 0.0), r.time + r.compute + r.sync)
    return min(ends.values())


def all_busy_rate(records: list[StepRecord]) -> float:
    """Samples/s until the first worker finished: under ssp/async the fast workers finish
    early and the run's wall time ends with the straggler working alone."""
    start = min(r.time for r in records)
    stop = _all_busy_stop(records)
    done = sum(r.samples for r in records if r.time + r.compute + r.sync <= stop)
    return done / (stop - start) if stop > start else 0.0


def straggler_step_s(records: list[StepRecord], rank: int) -> float | None:
    """Mean wall time (compute + sync) of ``rank``'s steps while every worker trained."""
    stop = _all_busy_stop(records)
    mine = [
        r.compute + r.sync
        for r in records
        if r.rank == rank and r.time + r.compute + r.sync <= stop
    ]
    return sum(mine) / len(mine) if mine else None


def run_set(
    base: RunConfig,
    strategies: list[str],
    repeats: int,
    out: Path,
    target: float | None = None,
    straggler: int | None = None,
) -> Repeats:
    """``repeats`` comparisons of ``strategies`` (forward, then reversed order), each row with
    the while-all-train rate and the straggler's step time added."""
    results = []
    for r in range(repeats):
        # One run_comparison runs the whole repeat, in this order.
        now = order(strategies, r, REVERSE)
        rep_out = out / f"repeat{r}"
        print(f"repeat {r + 1}/{repeats}: {', '.join(now)}", file=sys.stderr)
        result = run_comparison(replace(base, out=str(rep_out)), now, target, show_progress=False)
        rows = {row["strategy"]: row for row in result["rows"]}
        for spec, row in rows.items():
            records = read_records(rep_out / run_dirname(spec))
            row["all_busy_samples_per_s"] = all_busy_rate(records)
            row["straggler_step_s"] = (
                None if straggler is None else straggler_step_s(records, straggler)
            )
        results.append(rows)
    return results


def run(args: argparse.Namespace, out: Path) -> dict[str, Repeats]:
    base = RunConfig(
        nproc=NPROC,
        workload=args.workload,
        steps=args.steps,
        seed=SEED,
        slow=SLOW,
        progress=False,
        plots=False,
        out=str(out),
    )
    fixed = run_set(base, args.strategies, args.repeats, out / "straggler", args.target, SLOW_RANK)
    sets = {"straggler": fixed}
    if args.jitter_repeats > 0:
        jitter = replace(base, steps=args.jitter_steps, slow=jitter_slow(args.jitter_steps))
        sets["jitter"] = run_set(
            jitter, list(JITTER_STRATEGIES), args.jitter_repeats, out / "jitter"
        )
    return sets


def _fmt(value: float | None, spec: str) -> str:
    return "never" if value is None else format(value, spec)


# The summary's figures: medians over repeats of a row's value, and medians of per-repeat
# ratios against BSP (a repeat where either is missing, a target never reached, is left out).
MEDIANS = {
    "sps": "samples_per_s",
    "steps_to": "steps_to_target",
    "s_to": "seconds_to_target",
    "final": "final_loss",
    "mb": "mb_sent",
    "tax": "barrier_tax",
}
RATIOS = {
    "sps_ratio": "samples_per_s",
    "busy_ratio": "all_busy_samples_per_s",
    "s_ratio": "seconds_to_target",
}


def _summary(repeats: Repeats, strategies: list[str]) -> dict[str, dict[str, Any]]:
    summary: dict[str, dict[str, Any]] = {}
    for s in strategies:
        rows = [rep[s] for rep in repeats]
        m = {k: median([r[key] for r in rows]) for k, key in MEDIANS.items()}
        for k, key in RATIOS.items():
            bsp = [rep["bsp"][key] for rep in repeats]
            m[k] = median_of_ratios([r[key] for r in rows], bsp)
        m["reached"] = sum(r["steps_to_target"] is not None for r in rows)
        straggler = [r.get("straggler_step_s") for r in rows]
        m["straggler_ms"] = median([None if x is None else x * 1e3 for x in straggler])
        summary[s] = m
    return summary


def _optimizer_name(workload: str) -> str:
    """The class of the workload's optimizer, which the parameter server rebuilds."""
    w = make_workload(workload, seed=SEED)
    return type(w.make_optimizer(w.build_model(), w.default_lr)).__name__


def render(
    sets: dict[str, Repeats], args: argparse.Namespace, command: str, optimizer: str | None = None
) -> str:
    strategies = list(args.strategies)
    repeats = sets["straggler"]
    n = len(repeats)
    summary = _summary(repeats, strategies)
    head = (
        "strategy | samples/s | samples/s / BSP | samples/s while all train / BSP | "
        "straggler ms/step while all train | steps to target | s to target | s to target / BSP | "
        "reached target | final loss | MB sent | barrier tax"
    )
    first = (("sps", ".0f"), ("sps_ratio", ".2f"), ("busy_ratio", ".2f"), ("straggler_ms", ".1f"))
    first += (("steps_to", ".0f"), ("s_to", ".1f"), ("s_ratio", ".2f"))
    last = (("final", ".4f"), ("mb", ".1f"), ("tax", ".1%"))
    body = table(
        head,
        [
            [s, *(_fmt(m[k], f) for k, f in first), f"{m['reached']}/{n}"]
            + [_fmt(m[k], f) for k, f in last]
            for s, m in summary.items()
        ],
    )
    cores = os.cpu_count() or 1
    servers = any(uses_servers(s) for s in strategies)
    opt = optimizer if optimizer is not None else _optimizer_name(args.workload)
    head = (
        "## The synchronization dial with a straggler (issue 3)\n\n"
        f"Command: `{command}` (repeats {args.repeats}, {args.steps} steps per worker, seed "
        f"{SEED}, target loss {args.target}). Machine: {machine()}. Workload {args.workload} "
        f"({opt}), {NPROC} workers (plus 1 parameter server for ssp/async), batch 16 per "
        "worker, 1 thread per process, gloo on loopback, rank 3 slowed 2x "
        f"(`--slow {SLOW}`). Medians "
        "over repeats of per-repeat ratios against BSP; strategies run in alternating order "
        "(forward, then reversed). `samples/s` is all workers' samples over the wall time from "
        "the first step to the last; `while all train` stops the clock when the first worker "
        "finishes its steps. Time to target: first step whose 10-step moving-average loss is "
        "at or below the target, at the time the slowest worker finished that step. MB sent: "
        "every rank's payload, for ssp/async the workers' pushes plus the servers' replies "
        "(the pulled parameters), so about twice BSP's.\n"
    )
    findings = _findings(summary, strategies, n, cores, servers, args.steps, opt)
    text = f"{head}\n{body}\n\n{findings}\n"
    if "jitter" in sets:
        text += "\n" + _render_jitter(sets["jitter"], args)
    return text


def _render_jitter(repeats: Repeats, args: argparse.Namespace) -> str:
    strategies = [s for s in JITTER_STRATEGIES if s in repeats[0]]
    m = _summary(repeats, strategies)
    cells = (("sps", ".0f"), ("sps_ratio", ".2f"), ("final", ".4f"), ("tax", ".1%"))
    body = table(
        "strategy | samples/s | samples/s / BSP | final loss | barrier tax",
        [[s, *(_fmt(m[s][k], f) for k, f in cells)] for s in strategies],
    )
    gains = [f"{s} {_fmt(m[s]['sps_ratio'], '.2f')}x" for s in strategies if s != "bsp"]
    # Ideal: BSP pays the slowed rank's step every step; with enough slack every worker pays
    # its own slow step once every NPROC steps.
    ideal = JITTER_FACTOR / (1 + (JITTER_FACTOR - 1) / NPROC)
    return (
        "### A moving straggler\n\n"
        f"The same set-up with {args.jitter_steps} steps per worker and "
        f"{args.jitter_repeats} repeat{'s' if args.jitter_repeats != 1 else ''}, but at step "
        f"s rank s mod {NPROC} is slowed "
        f"{JITTER_FACTOR:g}x for that step only (`--slow 0:{JITTER_FACTOR:g}@0-1,"
        f"1:{JITTER_FACTOR:g}@1-2,...`): every worker is as slow as every other on average, "
        "and each step has one straggler. BSP waits for it every step; a staleness slack "
        "lets the others run on and the slowed worker catch up on its next fast steps.\n\n"
        f"{body}\n\nAgainst BSP: {', '.join(gains)} (ideal with enough slack and a core per "
        f"process: {ideal:.2f}x, every worker paying its own slow step once every {NPROC} "
        "steps instead of every step paying one).\n"
    )


def _findings(
    m: dict[str, dict[str, Any]],
    strategies: list[str],
    n: int,
    cores: int,
    servers: bool,
    steps: int,
    optimizer: str,
) -> str:
    """Sentences generated from the measured medians: expectation met or not, and why."""
    out = []
    ps = [s for s in strategies if uses_servers(s)]
    for s in ps:
        if m[s]["sps_ratio"] is None:
            continue
        met = m[s]["sps_ratio"] >= EXPECTED_SPEEDUP
        out.append(
            f"{s} reached {m[s]['sps_ratio']:.2f}x BSP's samples/s over the whole run "
            f"({'meets' if met else 'misses'} the expected {EXPECTED_SPEEDUP}x) and "
            f"{_fmt(m[s]['busy_ratio'], '.2f')}x while all workers trained."
        )
    reached = [s for s in strategies if m[s]["reached"] == n]
    missed = [f"{s} ({m[s]['reached']}/{n})" for s in strategies if m[s]["reached"] < n]
    out.append(
        f"Reached the target loss in every repeat: {', '.join(reached) or 'none'}"
        + (f"; not in every repeat: {', '.join(missed)}." if missed else ".")
    )
    paragraphs = [" ".join(out)]
    if ps:
        paragraphs += _why_not_faster(m, ps, steps, cores)
    for s in ps:
        if not s.startswith("ssp") or m[s]["steps_to"] is None or m["bsp"]["steps_to"] is None:
            continue
        if "adam" in optimizer.lower() and m[s]["steps_to"] < m["bsp"]["steps_to"]:
            paragraphs.append(
                f"Why {s} reached the target in fewer steps than BSP ({m[s]['steps_to']:.0f} "
                f"against {m['bsp']['steps_to']:.0f}): the server applies every push with the "
                f"workload's optimizer ({optimizer}), scaled by 1/W so that, with plain SGD, a "
                f"round of W pushes moves as far as one BSP step. {optimizer} normalises each "
                "coordinate's update by its running gradient scale, which cancels the 1/W: "
                f"each push then moves the parameters about as far as a whole BSP step, and a "
                f"round of {NPROC} pushes about {NPROC} times as far, on {NPROC} gradients of "
                "one worker's batch each instead of their mean. Per step index that is more "
                "progress than BSP (with more noise per update), so the step counts are not "
                "the same unit of work across these strategies."
            )
    procs = NPROC + (1 if servers else 0)
    if cores < procs:
        paragraphs.append(
            f"This machine has {cores} cores for {NPROC} workers"
            + (" plus a server" if servers else "")
            + ", so processes time-share cores and no strategy runs as it would with a core "
            "per process: the injected slowdown is a sleep, which hands the straggler's core to "
            "whoever can use it (nobody under BSP, where the others wait at the barrier; under "
            "local SGD and DiLoCo, the others until the next averaging step"
            + (
                "; the fast workers under ssp/async), and the server takes CPU from the workers"
                if servers
                else ")"
            )
            + ". The ratios here can therefore differ in either direction from those on a "
            "machine with a core per process."
        )
    return "\n\n".join(paragraphs)


def _why_not_faster(
    m: dict[str, dict[str, Any]], ps: list[str], steps: int, cores: int
) -> list[str]:
    """Why the parameter server cannot reach the expected speed-up with this straggler."""
    out = []
    factor = SLOW_FACTOR
    ideal = ((NPROC - 1) * factor + 1) / NPROC
    missed = [
        s for s in ps if m[s]["sps_ratio"] is not None and m[s]["sps_ratio"] < EXPECTED_SPEEDUP
    ]
    if missed:
        out.append(
            f"Why not {EXPECTED_SPEEDUP}x over the whole run: every worker runs the same "
            f"{steps} steps, so the run ends when the straggler (rank {SLOW_RANK}, "
            f"{factor:g}x) finishes its own, under ssp and async as under BSP. The run's samples "
            "are fixed, so with a core per process whole-run samples/s can exceed BSP's only by "
            "what BSP adds to the straggler's own step (its all-reduce; it never waits at the "
            "barrier, it is the one waited for), whatever the strategy; the fast workers' head "
            "start only ends in a tail where the straggler trains alone. The while-all-train "
            "column is the figure that can show a gain: with "
            f"{NPROC - 1} workers at full speed and one at 1/{factor:g}, its ideal is "
            f"(({NPROC - 1} × {factor:g} + 1) / {NPROC}) = {ideal:.2f}x BSP's."
        )
    for s in ps:
        busy = m[s]["busy_ratio"]
        if not s.startswith("ssp") or busy is None or busy >= EXPECTED_SPEEDUP:
            continue
        bound = int(s.split(":")[1])
        extra = (NPROC - 1) * bound / (NPROC * steps)
        out.append(
            f"Why {s} stays near BSP even while all train "
            f"({_fmt(m[s]['busy_ratio'], '.2f')}x): a fast worker may be at most {bound} "
            "steps ahead of the slowest one. With a straggler that stays "
            f"{factor:g}x slower, the fast workers are {bound} steps ahead after a few steps "
            "and from then on wait for it at every step, so everyone moves at the straggler's "
            f"pace, as under BSP. The slack is worth at most {bound} extra steps per fast "
            f"worker over the run, {NPROC - 1} × {bound} of {NPROC} × {steps} worker-steps "
            f"({extra:.1%} more samples): {EXPECTED_SPEEDUP}x is out of reach by design for "
            "a persistent straggler, and what is left is the parameter server's own cost "
            "(a push/pull round trip through one server each step, and the server's CPU). "
            "SSP pays off when slowness is transient or jittery: the slack absorbs a slow "
            "step and the straggler catches up afterwards."
        )
    if "async" in ps and m["async"]["s_ratio"] is not None and m["bsp"]["steps_to"]:
        out.append(_async_to_target(m, cores))
    return out


def _async_to_target(m: dict[str, dict[str, Any]], cores: int) -> str:
    """Why async reaches the target loss when it does, against BSP."""
    a, b = m["async"], m["bsp"]
    staleness = (NPROC - 1) * SLOW_FACTOR
    if a["steps_to"] is not None and a["steps_to"] <= 1.1 * b["steps_to"]:
        text = (
            f"Time to target under async: about as many steps as BSP ({a['steps_to']:.0f} "
            f"against {b['steps_to']:.0f}), so its stale gradients cost little progress "
            f"per step index here, but {a['s_ratio']:.2f}x BSP's time."
        )
    else:
        text = (
            f"Time to target under async: {_fmt(a['steps_to'], '.0f')} steps against "
            f"BSP's {b['steps_to']:.0f}, and {a['s_ratio']:.2f}x BSP's time. Its gradients "
            f"are stale: each of the straggler's is applied after about {staleness:.0f} "
            "pushes of the fast workers have moved the parameters it was computed from, "
            "and the fast workers' miss the straggler's latest, so each update is worth "
            "less."
        )
    text += (
        " A step's loss is the mean over the workers at that step index, stamped when the "
        "slowest worker finished it, so the time to target is the straggler's time to "
        "reach that step: the fast workers' extra steps help only through the parameters "
        "the straggler pulls."
    )
    slower = (
        a["straggler_ms"] is not None
        and b["straggler_ms"] is not None
        and a["straggler_ms"] > 1.05 * b["straggler_ms"]
    )
    if slower:
        text += (
            " And the straggler itself ran more slowly than under BSP (its steps took "
            f"{a['straggler_ms']:.0f} ms against {b['straggler_ms']:.0f} ms while all "
            "trained, push/pull included)"
            + (
                f": it shares the {cores} cores with {NPROC - 1} fast workers and the "
                "server, which never wait for it, while under BSP the others block at the "
                "barrier and leave it the CPU."
                if cores < NPROC + 1
                else "."
            )
        )
    if a["sps_ratio"]:
        text += (
            f" Over the whole run, async's wall time (the straggler's) was "
            f"{1 / a['sps_ratio']:.2f}x BSP's."
        )
    return text


def main() -> None:
    h = Harness("benchmarks.dial", __doc__, repeats=2)
    p = h.parser
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--target", type=float, default=2.5, help="target loss")
    p.add_argument("--workload", default="charlm", help="charlm (default) or mlp")
    p.add_argument(
        "--strategies", default=",".join(STRATEGIES), help="comma-separated; must include bsp"
    )
    p.add_argument(
        "--jitter-repeats",
        type=int,
        default=2,
        help="repeats of the moving-straggler set (bsp, ssp:2, async); 0 skips it",
    )
    p.add_argument("--jitter-steps", type=int, default=JITTER_STEPS)
    args = h.parse(repeats=2, steps=20, jitter_repeats=1, jitter_steps=12)
    args.strategies = [s.strip() for s in args.strategies.split(",") if s.strip()]
    if "bsp" not in args.strategies:
        h.error("--strategies must include bsp: every figure is a ratio against it")
    with tempfile.TemporaryDirectory(prefix="gradsync-dial-") as tmp:
        sets = run(args, Path(tmp))
    h.finish(render(sets, args, h.command()))


if __name__ == "__main__":
    main()
