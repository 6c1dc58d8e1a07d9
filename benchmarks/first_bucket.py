"""Issue 48: gradsync ``bsp`` with its default bucket plan against torch DDP with its
defaults, on the emulated cluster (one rank per host, rate-limited links), where a bucket
plan that puts a gradient of a few MB in one bucket sends it only once backward ends.

Needs root and iproute2 (``gradsync cluster``). Per link and number of hosts, one launch runs
every configuration of ``benchmarks.first_bucket_worker`` in interleaved blocks; the ratios
are taken block by block within a repeat (gradsync's step time over DDP's), medians with
their interquartile range. Not part of ``make bench`` (the cluster's launches take minutes):
``python -m benchmarks.first_bucket --write`` adds its section to BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path
from typing import Any

from benchmarks.first_bucket_worker import KINDS
from benchmarks.harness import ROOT, fmt_iqr, machine, pair_ratios, table, write_section
from gradsync.cluster import Cluster, launch_on_cluster, requirements_missing

PREFIX = "gsfb-"
MODULE = "benchmarks.first_bucket_worker"


def run_one(hosts: int, link: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    path = os.environ.get("PYTHONPATH")
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    worker = [MODULE, "--model", args.model, "--params", str(args.params)]
    worker += ["--batch", str(args.batch), "--kinds", args.kinds]
    worker += ["--repeats", str(args.repeats), "--block", str(args.block), "--out", str(out)]
    with Cluster(hosts=hosts, link=link, prefix=PREFIX) as cluster:
        rc = launch_on_cluster(cluster, worker, env=env, timeout_s=900)
    if rc != 0 or not out.exists():
        raise RuntimeError(f"the launch on {hosts} hosts at {link} failed (rc {rc})")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def _ratio(b: dict[str, list[float]], kind: str) -> str:
    return fmt_iqr(pair_ratios(b[kind], b["ddp"])) if kind in b else "-"


def _plans(results: list[tuple[int, str, dict[str, Any]]]) -> str:
    """Each gradsync configuration's buckets (MB, in launch order) as the runs ended, once per
    distinct plan set: which columns ran the same plan (the default may equal a fixed size)."""
    seen: dict[str, str] = {}
    for hosts, link, r in results:
        plans = r.get("plans", {})
        text = "; ".join(f"{k}: {', '.join(f'{mb:g}' for mb in mbs)}" for k, mbs in plans.items())
        seen.setdefault(text, f"{hosts} hosts, {link}")
    return " ".join(f"Buckets, MB ({where}): {text}." for text, where in seen.items() if text)


def render(
    results: list[tuple[int, str, dict[str, Any]]], command: str, conditions: str = ""
) -> str:
    rows = []
    for hosts, link, r in results:
        b = r["blocks"]
        rows.append(
            [
                f"{r['model']}, {hosts} hosts, {link}",
                f"{r['grad_mb']:.1f} MB",
                fmt_iqr([1000 * s for s in b["ddp"]], ".1f", " ms"),
                _ratio(b, "gradsync"),
                _ratio(b, "gradsync-auto"),
                _ratio(b, "gradsync-1mb"),
                _ratio(b, "gradsync-25mb"),
                _ratio(b, "gradsync-nogate"),
                _ratio(b, "gradsync-bare"),
                fmt_iqr([1000 * s for s in b["compute-only"]], ".1f", " ms")
                if "compute-only" in b
                else "-",
            ]
        )
    header = [
        "cluster",
        "gradient",
        "DDP step",
        "bsp / DDP",
        "bsp auto / DDP",
        "bsp 1 MB / DDP",
        "bsp 25 MB / DDP",
        "bsp, gate off / DDP",
        "bsp bare / DDP",
        "compute only",
    ]
    return (
        "gradsync `bsp` with its defaults (a first bucket of at most 1 MiB, then an eighth of "
        "the gradient, 1 to 25 MiB: `spec.default_bucket_mb`), with `bucket_mb='auto'` (a few "
        "plans timed over its first steps, the fastest kept), with `bucket_mb=1` and with "
        "`bucket_mb=25` (the plan before), with the defaults' plan and the step gate off, and "
        "'bare' (gate, telemetry, divergence check and non-finite guard off), against "
        "torch DDP with its defaults (1 MiB, then 25 MiB), one rank per emulated host, step "
        "time ratios per block (<= 1.00: gradsync as fast or faster), median and interquartile "
        "range.\n\n"
        + table(header, rows)
        + f"\n\n{_plans(results)}\n\n{machine()}. {conditions}Command: `{command}`\n"
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--model", choices=("mlp", "transformer"), default="mlp")
    p.add_argument("--params", type=int, default=1_500_000, help="mlp parameters")
    p.add_argument("--batch", type=int, default=256, help="samples per rank per step")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--block", type=int, default=10, help="steps per timed block")
    p.add_argument("--links", default="1gbit,100mbit")
    p.add_argument("--hosts", default="2")
    p.add_argument(
        "--kinds",
        default=",".join(KINDS),
        help="configurations (benchmarks.first_bucket_worker.KINDS), ddp among them; repeats "
        "that are a multiple of their number give each one every place in the rotation",
    )
    p.add_argument("--write", action="store_true", help="add the section to BENCHMARKS.md")
    args = p.parse_args()
    missing = requirements_missing()
    if missing:
        print(f"first_bucket: skipped, the emulated cluster is unavailable: {missing}")
        return 0
    results = []
    started = time.monotonic()
    # the machine may be shared: the load average says how far to trust the blocks
    load_before, date = os.getloadavg()[0], time.strftime("%Y-%m-%d", time.gmtime())
    with tempfile.TemporaryDirectory(prefix="gradsync-first-bucket-") as tmp:
        for hosts in (int(h) for h in args.hosts.split(",")):
            for link in args.links.split(","):
                out = Path(tmp) / f"{hosts}-{link}.json"
                results.append((hosts, link, run_one(hosts, link, args, out)))
                print(f"  {hosts} hosts, {link}: {time.monotonic() - started:.0f}s", flush=True)
    command = "python -m benchmarks.first_bucket " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "write"
    )
    minutes = (time.monotonic() - started) / 60
    conditions = (
        f"Date: {date}. Whole run: {minutes:.1f} min. 1-minute load average {load_before:.1f} "
        f"before the run and {os.getloadavg()[0]:.1f} after. "
    )
    body = render(results, command, conditions)
    print(body)
    if args.write:
        write_section(f"first_bucket_{args.model}", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
