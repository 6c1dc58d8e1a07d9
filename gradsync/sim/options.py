"""Turning ``gradsync simulate``'s parsed flags into the simulator's inputs, and printing results.

Shared by the argument parsing in ``gradsync.sim.cli`` and the modes in ``gradsync.sim.commands``.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from typing import Any

from gradsync.errors import UsageError
from gradsync.sim.config import CommModel, ComputeModel, Hosts
from gradsync.sim.model import AlphaBeta
from gradsync.sim.simulate import Overlap


def parse_floats(text: str, flag: str) -> list[float]:
    try:
        values = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"{flag} needs comma-separated numbers, got {text!r}") from None
    if not values:
        raise UsageError(f"{flag} needs at least one number, got {text!r}")
    return values


def parse_pair(text: str, flag: str) -> tuple[float, float]:
    head, sep, tail = text.partition(":")
    try:
        if not sep:
            raise ValueError
        return float(head), float(tail)
    except ValueError:
        raise UsageError(f"{flag} needs A:B (e.g. 3:2.0), got {text!r}") from None


def parse_straggler(text: str) -> tuple[int, float]:
    head, sep, _ = text.partition(":")
    try:
        rank = int(head)
    except ValueError:
        rank = None
    if rank is None or not sep:
        raise UsageError(
            f"--straggler needs RANK:FACTOR with an integer rank (e.g. 3:2.0), got {text!r}"
        )
    return rank, parse_pair(text, "--straggler")[1]


def compute_model(args: argparse.Namespace) -> ComputeModel:
    base = parse_floats(args.compute, "--compute")
    if args.workers is not None and args.workers < 1:
        # Checked here, not left to "or": 0 would otherwise fall back to the default silently.
        raise UsageError(f"--workers must be at least 1, got {args.workers}")
    workers = args.workers or (len(base) if len(base) > 1 else 4)
    if len(base) > 1 and len(base) != workers and not args.sweep_workers:
        raise UsageError(
            f"--compute has {len(base)} values but --workers is {workers}; "
            "give one value per worker or a single value"
        )
    stragglers = tuple(parse_straggler(s) for s in args.straggler)
    prob, factor = parse_pair(args.transient, "--transient") if args.transient else (0.0, 1.0)
    return ComputeModel(
        workers=workers,
        steps=args.steps,
        base_ms=tuple(base),
        jitter_ms=args.jitter,
        stragglers=stragglers,
        transient_prob=prob,
        transient_factor=factor,
        seed=args.seed,
    )


def link_from_args(args: argparse.Namespace) -> AlphaBeta | None:
    given = [args.alpha_us, args.link_gbps, args.algorithm]
    if args.calibration:
        from gradsync.sim.calibrate import load_calibration

        link = load_calibration(args.calibration)
        if args.algorithm:
            link = AlphaBeta(alpha=link.alpha, beta=link.beta, algorithm=args.algorithm)
        return link
    if args.message_mb is None and all(v is None for v in given):
        return None
    gbps = 10.0 if args.link_gbps is None else args.link_gbps
    if gbps <= 0:
        raise UsageError(f"--link-gbps must be > 0, got {gbps}")
    alpha_us = 20.0 if args.alpha_us is None else args.alpha_us
    return AlphaBeta(
        alpha=alpha_us * 1e-6, beta=8.0 / (gbps * 1e9), algorithm=args.algorithm or "ring"
    )


def comm_model(args: argparse.Namespace) -> CommModel:
    link = link_from_args(args)
    ratio = args.compression_ratio
    hosts = hosts_from_args(args)
    if link is None:
        fixed = 0.0 if args.comm_ms is None else args.comm_ms
        return CommModel(comm_ms=fixed, ratio=ratio, hosts=hosts)
    if args.comm_ms is not None:
        raise UsageError(
            "--comm-ms is a fixed cost; it cannot be combined with the alpha-beta "
            "flags (--message-mb, --alpha-us, --link-gbps, --algorithm, "
            "--calibration)"
        )
    if args.message_mb is None or args.message_mb < 0:
        raise UsageError("the alpha-beta model needs --message-mb (gradient size in MiB, >= 0)")
    return CommModel(link=link, nbytes=args.message_mb * 2**20, ratio=ratio, hosts=hosts)


# The defaults of the path inside a host: ten times the default link between hosts, and a
# quarter of its latency (shared memory or a PCIe/NVLink hop, against a network round trip).
INTRA_GBPS, INTRA_ALPHA_US = 100.0, 5.0


def hosts_from_args(args: argparse.Namespace) -> Hosts | None:
    """``--hosts H`` with ``--allreduce`` and the intra-host link; None without ``--hosts``,
    where the flags that only mean something on hosts are refused rather than ignored."""
    if args.hosts is None:
        given = [
            f
            for f, v in (
                ("--intra-gbps", args.intra_gbps),
                ("--intra-alpha-us", args.intra_alpha_us),
            )
            if v is not None
        ]
        if args.allreduce == "hierarchical":
            given.insert(0, "--allreduce hierarchical")
        if given:
            raise UsageError(
                f"{', '.join(given)} describe(s) hosts: give --hosts H too (the --workers are "
                "spread evenly over H hosts; --link-gbps is then the link between hosts)"
            )
        return None
    gbps = INTRA_GBPS if args.intra_gbps is None else args.intra_gbps
    if not gbps > 0:
        raise UsageError(f"--intra-gbps must be > 0, got {gbps}")
    alpha_us = INTRA_ALPHA_US if args.intra_alpha_us is None else args.intra_alpha_us
    algorithm = args.algorithm or "ring"
    intra = AlphaBeta(alpha=alpha_us * 1e-6, beta=8.0 / (gbps * 1e9), algorithm=algorithm)
    return Hosts(hosts=args.hosts, intra=intra, allreduce=args.allreduce)


def layers_from_args(args: argparse.Namespace) -> list[float] | None:
    """``--layers``: the model's layer sizes, for streaming DiLoCo's fragments."""
    return None if args.layers is None else parse_floats(args.layers, "--layers")


def overlap_from_args(args: argparse.Namespace) -> Overlap:
    return Overlap(backward_frac=args.backward_frac, buckets=args.buckets)


def emit(args: argparse.Namespace, doc: dict[str, Any], text: str) -> None:
    if args.json:
        json.dump(_jsonable(doc), sys.stdout, indent=2)
        sys.stdout.write("\n")
    else:
        print(text)


def _jsonable(x: Any) -> Any:
    if isinstance(x, float) and math.isinf(x):
        return "inf"
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, list | tuple):
        return [_jsonable(v) for v in x]
    return x
