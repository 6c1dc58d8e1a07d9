"""``gradsync simulate`` and ``gradsync bench allreduce``: argument parsing and handlers."""

from __future__ import annotations

import argparse
import math
import sys
from pathlib import Path

from gradsync.errors import UsageError
from gradsync.sim import commands
from gradsync.sim.config import ALLREDUCE_CHOICES, parse_strategy
from gradsync.sim.model import ALGORITHMS
from gradsync.sim.options import emit

DEFAULT_SWEEP_STRATEGIES = "bsp,zero:1,zero:2,ssp:4,async,local:8"


def add_parsers(subparsers: argparse._SubParsersAction) -> None:
    sim = subparsers.add_parser(
        "simulate",
        help="predict step time, idle and staleness of a strategy at any scale",
        description="Simulate data-parallel training (no processes): BSP, ZeRO stages 1, 2 and 3, "
        "SSP, async, local SGD, DiLoCo (plain and streaming), overlap, hosts with a flat or "
        "hierarchical all-reduce; sweeps over staleness and workers; or predict a real run.",
    )
    g = sim.add_argument_group("workers and compute")
    g.add_argument(
        "--workers",
        type=int,
        default=None,
        help="workers (default: one per --compute value, 4 for a single value)",
    )
    g.add_argument("--steps", type=int, default=100, help="steps per worker (default 100)")
    g.add_argument("--compute", default="20", help="base ms per step: one value or one per worker")
    g.add_argument("--jitter", type=float, default=0.0, help="uniform jitter in [-J, J] ms")
    g.add_argument(
        "--straggler",
        action="append",
        default=[],
        metavar="RANK:FACTOR",
        help="persistent straggler: multiply RANK's base compute (repeatable)",
    )
    g.add_argument(
        "--transient",
        default=None,
        metavar="P:FACTOR",
        help="each worker-step slows by FACTOR with probability P",
    )
    g.add_argument("--seed", type=int, default=0, help="seed of random.Random for the jitter")
    _add_communication_and_strategy(sim)
    _add_prediction(sim)
    sim.set_defaults(func=cmd_simulate)
    _add_bench(subparsers)


def _add_communication_and_strategy(sim: argparse.ArgumentParser) -> None:
    c = sim.add_argument_group("communication (fixed, or alpha-beta for a message)")
    c.add_argument("--comm-ms", type=float, default=None, help="fixed ms per exchange")
    c.add_argument("--message-mb", type=float, default=None, help="gradient size in MiB")
    c.add_argument("--alpha-us", type=float, default=None, help="latency per message, us (20)")
    c.add_argument("--link-gbps", type=float, default=None, help="link bandwidth, Gbit/s (10)")
    c.add_argument("--algorithm", choices=ALGORITHMS, default=None, help="all-reduce algorithm")
    c.add_argument("--calibration", default=None, help="alpha/beta JSON from bench allreduce")
    c.add_argument(
        "--compression-ratio",
        type=float,
        default=1.0,
        help="a compressor's: each exchange carries bytes / R (int4 about 7.5, int8 about 4; "
        "not zero:N's collectives); with --from, the what-if",
    )
    _add_hosts(sim)
    s = sim.add_argument_group("strategy and output")
    s.add_argument(
        "--strategy",
        default="bsp",
        help="bsp | zero:1 | zero:2 | zero:3 | ssp:S | async | local:H | "
        "diloco:H[:F[:TAU[:ALPHA]][:SPLIT]] | hogwild",
    )
    s.add_argument(
        "--layers",
        default=None,
        metavar="LIST",
        help="sizes of the model's layers in module order (any unit), for streaming DiLoCo's "
        "fragments under the layers split (diloco:H:F:TAU:ALPHA:layers; layer i in fragment "
        "i %% F); the default rows split cuts every layer F ways, and without --layers too "
        "each fragment carries 1/F of the bytes",
    )
    s.add_argument("--overlap", action="store_true", help="BSP (or zero:1) with bucketed overlap")
    s.add_argument(
        "--backward-frac",
        type=float,
        default=2 / 3,
        help="share of compute that is the backward pass (default 0.667)",
    )
    s.add_argument("--buckets", type=int, default=4, help="gradient buckets for --overlap")
    s.add_argument("--sweep-staleness", default=None, metavar="LIST", help="e.g. 0,1,2,4,8,inf")
    s.add_argument("--sweep-workers", default=None, metavar="LIST", help="e.g. 8,16,64,1024")
    s.add_argument(
        "--strategies",
        default=DEFAULT_SWEEP_STRATEGIES,
        help=f"strategies for --sweep-workers (default {DEFAULT_SWEEP_STRATEGIES})",
    )
    s.add_argument("--plot-dir", default=".", help="where sweep PNGs go (default .)")
    s.add_argument("--table-steps", type=int, default=20, help="rows of the BSP step table")
    s.add_argument("--json", action="store_true", help="machine-readable output")


def _add_hosts(sim: argparse.ArgumentParser) -> None:
    h = sim.add_argument_group(
        "hosts (as gradsync run --hosts H --allreduce KIND; alpha-beta model only)"
    )
    h.add_argument(
        "--hosts",
        type=int,
        default=None,
        metavar="H",
        help="spread the workers evenly over H hosts; --link-gbps and --alpha-us are then the "
        "link between hosts (default: one link, no hosts)",
    )
    h.add_argument(
        "--allreduce",
        choices=ALLREDUCE_CHOICES,
        default="ring",
        help="ring: one flat ring over every rank, paced by the slower link; hierarchical: "
        "reduce in each host, all-reduce among one leader per host, broadcast back (bsp, "
        "zero:1, local:H, diloco:H), shown beside ring (default ring)",
    )
    h.add_argument(
        "--intra-gbps", type=float, default=None, help="bandwidth inside a host, Gbit/s (100)"
    )
    h.add_argument(
        "--intra-alpha-us", type=float, default=None, help="latency inside a host, us (5)"
    )


def _add_prediction(sim: argparse.ArgumentParser) -> None:
    f = sim.add_argument_group("calibrated prediction from a real run")
    f.add_argument(
        "--from",
        dest="from_run",
        default=None,
        metavar="RUN_DIR",
        help="predict this run from its telemetry",
    )
    f.add_argument("--remove-straggler", action="store_true", help="what-if: slowest rank fixed")
    f.add_argument("--warmup", type=int, default=2, help="steps of the run to skip (default 2)")
    f.add_argument(
        "--resample",
        choices=("steps", "ranks"),
        default="steps",
        help="draw whole measured steps (keeps cross-rank correlation; default) or each "
        "rank's compute independently",
    )


def _add_bench(subparsers: argparse._SubParsersAction) -> None:
    bench = subparsers.add_parser("bench", help="measure collectives on the live backend")
    bsub = bench.add_subparsers(dest="bench_command", metavar="BENCH")
    bsub.required = True
    ar = bsub.add_parser("allreduce", help="all-reduce time, algbw, busbw; fit alpha and beta")
    ar.add_argument("--nproc", type=int, default=2, help="ranks (default 2)")
    ar.add_argument(
        "--sizes",
        default=None,
        help="bytes, comma-separated; K/M suffixes ok (default 4K..64M in x4 steps)",
    )
    ar.add_argument("--repeats", type=int, default=20, help="timed repeats per size (default 20)")
    ar.add_argument("--out", default="allreduce_calibration.json", help="where the fit goes")
    ar.add_argument("--json", action="store_true", help="machine-readable output")
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


# Float flags of ``simulate``, by argparse dest; each must be a finite number when given.
FLOAT_FLAGS = {
    "jitter": "--jitter",
    "comm_ms": "--comm-ms",
    "message_mb": "--message-mb",
    "alpha_us": "--alpha-us",
    "link_gbps": "--link-gbps",
    "backward_frac": "--backward-frac",
    "compression_ratio": "--compression-ratio",
    "intra_gbps": "--intra-gbps",
    "intra_alpha_us": "--intra-alpha-us",
}


def check_finite(args: argparse.Namespace) -> None:
    """argparse's ``type=float`` takes 'nan' and 'inf'; no flag here means anything by them."""
    for dest, flag in FLOAT_FLAGS.items():
        value = getattr(args, dest, None)
        if value is not None and not math.isfinite(value):
            raise UsageError(f"{flag} must be a finite number, got {value}")


def cmd_simulate(args: argparse.Namespace) -> int:
    if args.table_steps < 0:
        raise UsageError(f"--table-steps must be >= 0, got {args.table_steps}")
    if args.warmup < 0:
        raise UsageError(f"--warmup must be >= 0 steps, got {args.warmup}")
    check_finite(args)
    if args.from_run:
        extra = [
            flag
            for flag, given in (
                ("--hosts", args.hosts is not None),
                ("--layers", args.layers is not None),
                ("--allreduce hierarchical", args.allreduce != "ring"),
            )
            if given
        ]
        if extra:
            # --from prices the run's own measured exchanges, not a link model.
            raise UsageError(
                f"{', '.join(extra)} apply to a simulation, not to --from's prediction of a run; "
                "drop them, or simulate without --from"
            )
        return commands.from_run(args)
    if args.sweep_staleness or args.sweep_workers:
        return commands.sweeps(args)
    parse_strategy(args.strategy)
    return commands.single(args)


def cmd_bench_allreduce(args: argparse.Namespace) -> int:
    from gradsync.runtime import default_backend
    from gradsync.sim.bench import DEFAULT_SIZES, BenchConfig, describe_fit, format_table, run_bench
    from gradsync.sim.calibrate import save_calibration

    sizes = tuple(parse_size(s) for s in args.sizes.split(",")) if args.sizes else DEFAULT_SIZES
    cfg = BenchConfig(nproc=args.nproc, sizes=sizes, repeats=args.repeats)
    backend = default_backend()
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
    save_calibration(args.out, fit, {"backend": backend, "measurements": measurements})
    fit_line, warnings = describe_fit(fit)
    for w in warnings:
        print(f"gradsync: warning: {w}", file=sys.stderr)
    text = "\n".join(
        [format_table(rows, cfg.nproc, backend), "", fit_line, f"saved to {Path(args.out)}"]
    )
    doc = {
        "backend": backend,
        "nproc": cfg.nproc,
        "measurements": measurements,
        "alpha_s": fit.alpha,
        "beta_s_per_byte": fit.beta,
        "max_rel_error": fit.max_rel_error,
        "warnings": warnings,
        "saved": str(args.out),
    }
    emit(args, doc, text)
    return 0
