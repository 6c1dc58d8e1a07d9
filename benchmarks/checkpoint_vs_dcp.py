"""gradsync's checkpointer against torch's DCP ``async_save``: the cost of a save on the training
thread, side by side in one run on the same model.

Per workload, one run of 2 ``bsp`` ranks (gloo on loopback, ``gradsync.processes.launch``) trains
the
same model with AdamW and alternates blocks of steps (``benchmarks.checkpoint_vs_dcp_worker``,
which says how): none without saves, and for each cadence (``--every``) one block with
``sync.save(DIR, wait=False)`` and one with ``torch.distributed.checkpoint.async_save`` of
``{"model": model.state_dict(), "optimizer": optimizer.state_dict()}`` (process-based where
this torch has it), each save waiting for the previous one's future as a real loop must, that
wait counted as the save's time on the training thread. The order of the blocks rotates repeat
by repeat. Before the table is trusted both checkpointers' last checkpoints are loaded back and
compared with the state saved, bit for bit; the run fails if either differs.

The table: per save, the median and 90th percentile of the seconds on the training thread
(both ranks' saves pooled); the median over blocks of the mean step time without saves and
with each; how many of the timed saves became files (gradsync under ``bsp`` holds most
snapshots in memory and writes a file every ``FILES_EVERY`` steps; DCP writes every save).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from tempfile import TemporaryDirectory
from typing import Any

from benchmarks import checkpoint_vs_dcp_worker as w
from benchmarks.harness import Harness, machine, median_iqr, pair_ratios, table
from gradsync.checkpoint.writer_process import FILES_EVERY
from gradsync.processes.launch import launch

HEADING = "Checkpoint cost against torch's DCP"


def run(workload: str, args: argparse.Namespace, repeats: int) -> dict[int, Any]:
    with TemporaryDirectory(prefix="gradsync-ckpt-vs-dcp-", dir=args.workdir) as tmp:
        job = {
            "workload": workload,
            "params": args.params,
            "seed": args.seed,
            "directory": tmp,
            "every": args.every,
            "block": args.block,
            "repeats": repeats,
            "dcp": args.dcp,
        }
        print(f"{workload}: {repeats} repeats ({time.strftime('%H:%M:%S')})", file=sys.stderr)
        return launch(w.worker, (job,), nproc=2)


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 10 else f"{seconds:.0f} s"


def _med_p90(values: list[float]) -> str:
    if not values:
        return "n/a"
    p90 = (
        statistics.quantiles(values, n=10, method="inclusive")[8] if len(values) > 1 else values[0]
    )
    return f"{_ms(statistics.median(values))} ({_ms(p90)})"


def _check(name: str, out: dict[int, Any]) -> list[str]:
    """What failed in the load-back checks and the counts, in words (nothing: all good)."""
    failed = []
    for rank, o in sorted(out.items()):
        c = o["checks"]
        for key, what in (
            ("dcp_ring_complete", "DCP's timed checkpoints complete (.metadata in both slots)"),
            ("dcp_loads_equal", "DCP's checkpoint loads back equal (dcp.load)"),
            ("gradsync_loads_equal", "gradsync's checkpoint loads back equal (sync.load)"),
            ("gradsync_extra_ok", "gradsync's extras and step load back"),
        ):
            if not c[key]:
                failed.append(f"{name}, rank {rank}: {what}: no")
        for key in ("dcp_bytes", "gradsync_bytes"):
            if c[key] < o["state_bytes"]:
                failed.append(
                    f"{name}, rank {rank}: {key} {c[key]} is less than the state "
                    f"({o['state_bytes']} bytes)"
                )
    return failed


def rows_for(name: str, out: dict[int, Any], every: list[int]) -> tuple[list[list[str]], dict]:
    """The table's rows for one workload, and the figures the reading quotes."""
    ranks = sorted(out)
    zero = out[ranks[0]]
    steps = zero["step_times"]  # the blocks start and end at barriers: the same on every rank
    med, q1, q3 = median_iqr(steps["none"])
    # Fewer than 4 blocks have no interquartile range to speak of.
    facts: dict[str, Any] = {"spread": (q3 - q1) / med if len(steps["none"]) >= 4 else None}
    rows = []
    for n in every:
        gs_kind, dcp_kind = f"gradsync@{n}", f"dcp@{n}"
        gs_saves = [t for r in ranks for t in out[r]["save_times"][gs_kind]]
        dcp_saves = [t for r in ranks for t in out[r]["save_times"][dcp_kind]]
        dcp_waits = [t for r in ranks for t in out[r]["wait_times"][dcp_kind]]
        ratio = statistics.median(gs_saves) / statistics.median(dcp_saves)
        none = statistics.median(steps["none"])
        gs_step, dcp_step = statistics.median(steps[gs_kind]), statistics.median(steps[dcp_kind])
        gs_cost = statistics.median(pair_ratios(steps[gs_kind], steps["none"])) - 1
        dcp_cost = statistics.median(pair_ratios(steps[dcp_kind], steps["none"])) - 1
        files = zero["gradsync_files"][gs_kind]  # one directory: rank 0 listed it
        timed = zero["gradsync_saves"][gs_kind]
        dcp_timed = len(zero["save_times"][dcp_kind])
        rows.append(
            [
                name,
                "step" if n == 1 else f"{n} steps",
                _med_p90(gs_saves),
                f"{_med_p90(dcp_saves)}; waiting {_ms(statistics.median(dcp_waits))}",
                f"{ratio:.3f}",
                f"{_ms(none)} / {_ms(gs_step)} ({gs_cost:+.0%}) / {_ms(dcp_step)} "
                f"({dcp_cost:+.0%})",
                f"{files} of {timed} / {dcp_timed} of {dcp_timed}",
            ]
        )
        facts[n] = {
            "ratio": ratio,
            "gs": statistics.median(gs_saves),
            "dcp": statistics.median(dcp_saves),
            "wait": statistics.median(dcp_waits),
            "gs_cost": gs_cost,
            "dcp_cost": dcp_cost,
            "files": files,
            "saves": timed,
        }
    return rows, facts


def main() -> None:
    h = Harness("benchmarks.checkpoint_vs_dcp", __doc__, repeats=4)
    p = h.parser
    p.add_argument("--workloads", default="charlm,mlp", help="comma-separated: charlm, mlp")
    p.add_argument("--params", type=int, default=20_000_000, help="mlp's parameters")
    p.add_argument("--every", default="1,10", help="cadences: a save every N steps")
    p.add_argument("--block", type=int, default=10, help="steps per block (at least 2 saves)")
    p.add_argument(
        "--charlm-repeats",
        type=int,
        default=12,
        help="repeats of the charlm run (its steps are short); --repeats: mlp's",
    )
    p.add_argument(
        "--dcp",
        choices=("process", "thread"),
        default="process",
        help="DCP's async_checkpointer_type (process: where this torch has it, else thread)",
    )
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--workdir", default=None, help="where the checkpoints go (a temporary dir)")
    args = h.parse(params=2_000_000, block=4, repeats=1, charlm_repeats=1)
    try:
        args.every = sorted({int(x) for x in args.every.split(",") if x.strip()})
    except ValueError:
        h.error(f"--every takes comma-separated integers; got {args.every!r}")
    workloads = [x.strip() for x in args.workloads.split(",") if x.strip()]
    if not args.every or min(args.every) < 1 or args.block < 1 or args.charlm_repeats < 1:
        h.error("--every, --block and --charlm-repeats take integers of 1 or more")
    if not workloads or not set(workloads) <= {"charlm", "mlp"}:
        h.error(f"--workloads takes charlm and mlp; got {args.workloads!r}")
    load_before = os.getloadavg()[0]
    started = time.monotonic()
    rows: list[list[str]] = []
    facts: dict[str, Any] = {}
    failed: list[str] = []
    how, sizes, prefix = "", {}, True
    for workload in workloads:
        repeats = args.charlm_repeats if workload == "charlm" else args.repeats
        out = run(workload, args, repeats)
        name = workload if workload == "charlm" else f"mlp ({args.params:,} params)"
        failed += _check(name, out)
        # The raw figures on stderr, for pooling runs: block step times (rank 0), save times.
        raw = {k: out[0][k] for k in ("step_times", "save_times", "wait_times")}
        print(f"{name} raw: {json.dumps(raw)}", file=sys.stderr)
        workload_rows, facts[workload] = rows_for(name, out, args.every)
        rows += workload_rows
        how = out[0]["dcp_how"]
        prefix = prefix and all(o["dcp_prefix_store"] for o in out.values())
        sizes[name] = out[0]["state_bytes"]
    minutes = (time.monotonic() - started) / 60
    load_after = os.getloadavg()[0]
    for line in failed:
        print(f"check failed: {line}", file=sys.stderr)
    cores = os.cpu_count() or 1
    shared = max(load_before, load_after) > cores
    header = (
        "workload | a save every | gradsync per save: median (p90) | DCP per save: median "
        "(p90); of it waiting for the save before | gradsync / DCP, per save | step time: "
        "without saves / gradsync / DCP (cost: median of per-repeat ratios) | files written: "
        "gradsync / DCP, of the timed saves"
    )
    cmd = h.command()
    text = (
        f"## {HEADING}\n\n"
        f"Command: `{cmd}`. Date: {time.strftime('%Y-%m-%d')}. Machine: {machine()}. "
        f"Whole run: {minutes:.1f} min. 1-minute load average {load_before:.1f} before the "
        f"run and {load_after:.1f} after, on {cores} cores"
        + (
            ": the machine was shared with other work while this ran, so the times are noisy "
            "(a rerun on a quiet machine is due)"
            if shared
            else ""
        )
        + ".\n\n"
        "2 ranks, `bsp`, gloo on loopback, AdamW (state per rank: "
        + ", ".join(f"{k} {v / 1e6:.1f} MB" for k, v in sizes.items())
        + f"). DCP: `dcp.async_save`, {how}, into a ring of two directories"
        + (
            " (its checkpoint processes' gloo group met through the launcher's loopback store, "
            "`DCP_USE_PREFIX_STORE=1`, rather than a new store on every interface)"
            if prefix
            else ""
        )
        + "; gradsync: "
        "`sync.save(DIR, wait=False)`. Per workload one run alternates blocks of steps without "
        f"saves and with each checkpointer at each cadence, the order rotating repeat by repeat "
        f"({args.repeats} repeats for mlp, {args.charlm_repeats} for charlm; blocks of "
        f"{args.block} steps or more, at least two saves each), after an untimed warm-up of "
        "each. The time on the training thread per save is the call, and for DCP also the wait "
        "for that save's future before the next save (or at the block's end, as many steps "
        "later), which blocks the loop; both ranks' saves pooled. Both checkpoints were loaded "
        "back and compared with the state saved, bit for bit (DCP with `dcp.load`, gradsync "
        "with `sync.load`): "
        + ("equal." if not failed else "FAILED: " + "; ".join(failed) + ".")
        + "\n\n"
        + table(header, rows)
        + "\n\n"
        + reading(facts, args.every)
        + "\n"
    )
    h.finish(text, skip="a load-back check failed" if failed else None)
    if failed:
        sys.exit(1)


def reading(facts: dict[str, Any], every: list[int]) -> str:
    """One paragraph: what the figures say, from the figures."""
    parts, files = [], []
    spread = ", ".join(
        f"{'n/a' if per['spread'] is None else format(per['spread'], '.0%')} ({workload})"
        for workload, per in facts.items()
    )
    for workload, per in facts.items():
        for n in every:
            f = per[n]
            parts.append(
                f"{workload}, a save every {'step' if n == 1 else f'{n} steps'}: "
                f"{_ms(f['gs'])} against {_ms(f['dcp'])} ({f['ratio']:.2f}; DCP waited "
                f"{_ms(f['wait'])} of it), {f['gs_cost']:+.0%} against {f['dcp_cost']:+.0%} "
                "of step time"
            )
            alone = -(-FILES_EVERY // n)  # saves per file in a run of these saves alone
            files.append(f"{f['files']} of {f['saves']} ({workload}, every {n}; 1 in {alone})")
    return (
        "Reading: per save, gradsync's training thread paid a copy of the state into shared "
        "buffers it reuses and a message to its writer process; DCP's paid `state_dict()`, a "
        "copy into freshly allocated staging memory (the default stager, made for each save), "
        "and whatever of the previous save's write had not finished: "
        + "; ".join(parts)
        + ". The two do not write the same amount: DCP wrote every save (its `FileSystemWriter` "
        "fsyncs each file by default), while gradsync, under `bsp`, wrote a file every "
        f"{FILES_EVERY} steps and held the other snapshots in memory, written if the rank dies "
        'or flushes (docs/checkpoints.md, "Held snapshots"); the files column counts what '
        "each wrote. The other blocks' steps count towards gradsync's cadence too, so its timed "
        "saves can become files more often than in a run of such saves alone (timed saves that "
        "became files, and the rate alone): "
        + ", ".join(files)
        + ". The step times carry the rest: the writers' work competes with the two ranks for "
        "the cores. The mean step times of the blocks without saves spread by "
        + spread
        + " of their median (interquartile range; n/a: fewer than 4 blocks): a step-time cost "
        "smaller than that is not "
        "resolved by this run, while the time per save, taken on the training thread itself, is."
    )


if __name__ == "__main__":
    main()
