"""``gradsync simulate`` and ``gradsync bench allreduce``: argument parsing and handlers."""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

from gradsync.errors import UsageError
from gradsync.flags import add_flags, from_namespace
from gradsync.sim import commands
from gradsync.sim.config import parse_sim_strategy
from gradsync.sim.options import (
    CALIBRATION_FILE,
    DEFAULT_STRATEGY,
    BenchOptions,
    SimulateOptions,
    emit,
)


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    """``simulate`` and ``bench allreduce``: their flags are SimulateOptions' and BenchOptions'
    fields (gradsync.sim.options), as ``run``'s are RunConfig's."""
    sim = subparsers.add_parser(
        "simulate",
        help="predict step time, idle and staleness of a strategy at any scale",
        description="Simulate data-parallel training (no processes): BSP, ZeRO stages 1, 2 and 3, "
        "SSP, async, local SGD, DiLoCo (plain and streaming), overlap, hosts with a flat or "
        "hierarchical all-reduce; sweeps over staleness and workers; or predict a real run; "
        "or the goodput of restart-from-checkpoint against live membership under failures.",
    )
    add_flags(sim, SimulateOptions)
    sim.set_defaults(func=cmd_simulate)
    bench = subparsers.add_parser("bench", help="measure collectives on the live backend")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bsub.required = True
    ar = bsub.add_parser("allreduce", help="all-reduce time, algbw, busbw; fit alpha and beta")
    add_flags(ar, BenchOptions)
    ar.set_defaults(func=cmd_bench_allreduce)


def parse_size(text: str) -> int:
    units = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    t = text.strip().upper().removesuffix("B")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(t)
    except (ValueError, OverflowError):
        raise UsageError(f"bad size {text!r}: use bytes or a K/M/G suffix, e.g. 64K") from None


def parse_sizes(text: str) -> tuple[int, ...]:
    """``--sizes``: comma-separated sizes; an empty one is refused (``--sizes ''`` ran the
    whole default set)."""
    items = text.split(",")
    if not all(item.strip() for item in items):
        what = "has an empty item" if text.strip(" ,") else "names no size"
        raise UsageError(
            f"--sizes {text!r} {what}: give comma-separated sizes in bytes, each a positive "
            "multiple of 4, K/M/G suffixes ok (e.g. 4K,64K,1M), or drop --sizes for the "
            "default 4K..64M"
        )
    return tuple(parse_size(item) for item in items)


def cmd_simulate(args: argparse.Namespace) -> int:
    opts = from_namespace(SimulateOptions, args)  # refuses what needs no simulation to refuse
    if opts.failures:
        return commands.failures(opts)
    if opts.from_run:
        return commands.from_run(opts)
    if opts.sweep_staleness or opts.sweep_workers:
        return commands.sweeps(opts)
    parse_sim_strategy(opts.strategy or DEFAULT_STRATEGY)
    return commands.single(opts)


def cmd_bench_allreduce(args: argparse.Namespace) -> int:
    from gradsync.runtime import default_backend
    from gradsync.sim.bench import DEFAULT_SIZES, BenchConfig, describe_fit, format_table, run_bench
    from gradsync.sim.calibrate import save_calibration

    opts = from_namespace(BenchOptions, args)
    sizes = DEFAULT_SIZES if opts.sizes is None else parse_sizes(opts.sizes)
    cfg = BenchConfig(nproc=opts.nproc, sizes=sizes, repeats=opts.repeats)
    backend = default_backend()
    check_out(opts.out)  # before the measurement, which takes a while, not after it
    rows, fit = run_bench(cfg)
    measurements = [
        {
            "bytes": r.nbytes,
            "time_s": r.time_s,
            "algbw": r.algbw,
            "busbw": r.busbw,
            "samples_s": list(r.samples_s),
        }
        for r in rows
    ]
    out = calibration_path(opts.out)
    save_calibration(out, fit, {"backend": backend, "measurements": measurements})
    fit_line, warnings = describe_fit(fit)
    for w in warnings:
        print(f"gradsync: warning: {w}", file=sys.stderr)
    text = "\n".join([format_table(rows, cfg.nproc, backend), "", fit_line, f"saved to {out}"])
    doc = {
        "backend": backend,
        "nproc": cfg.nproc,
        "measurements": measurements,
        "alpha_s": fit.alpha,
        "beta_s_per_byte": fit.beta,
        "max_rel_error": fit.max_rel_error,
        "warnings": warnings,
        "saved": str(out),
    }
    emit(opts, doc, text)
    return 0


def check_out(out: str | None) -> None:
    """``UsageError`` for an ``--out`` that names no file the fit could be written to: an
    existing directory, or a path below an existing file."""
    if out is None:
        return
    path = Path(out)
    if path.is_dir():
        raise UsageError(
            f"--out {out} is a directory; give the file the fit goes to, e.g. "
            f"--out {path / CALIBRATION_FILE}"
        )
    for parent in path.parents:
        if parent.exists() and not parent.is_dir():
            raise UsageError(f"--out {out}: {parent} is a file, not a directory")


def calibration_path(out: str | None) -> Path:
    """Where ``bench allreduce`` writes its fit: ``--out`` (its directory made if missing), else
    ``CALIBRATION_FILE`` in a new directory under the system's temporary directory, never the
    current one unasked. Called once the measurement is done, so a failed bench leaves no
    empty directory behind."""
    if out is None:
        return Path(tempfile.mkdtemp(prefix="gradsync-bench-")) / CALIBRATION_FILE
    path = Path(out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise UsageError(f"--out {out}: cannot make its directory: {exc}") from None
    return path
