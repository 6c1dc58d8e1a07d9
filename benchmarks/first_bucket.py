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

from benchmarks.harness import ROOT, fmt_iqr, machine, pair_ratios, table, write_section
from gradsync.cluster import Cluster, launch_on_cluster, requirements_missing

PREFIX = "gsfb-"
MODULE = "benchmarks.first_bucket_worker"


def run_one(hosts: int, link: str, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    path = os.environ.get("PYTHONPATH")
    env = {"OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT) + (os.pathsep + path if path else "")}
    worker = [MODULE, "--model", args.model, "--params", str(args.params)]
    worker += ["--batch", str(args.batch)]
    worker += ["--repeats", str(args.repeats), "--block", str(args.block), "--out", str(out)]
    with Cluster(hosts=hosts, link=link, prefix=PREFIX) as cluster:
        rc = launch_on_cluster(cluster, worker, env=env, timeout_s=900)
    if rc != 0 or not out.exists():
        raise RuntimeError(f"the launch on {hosts} hosts at {link} failed (rc {rc})")
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def render(results: list[tuple[int, str, dict[str, Any]]], command: str) -> str:
    rows = []
    for hosts, link, r in results:
        b = r["blocks"]
        rows.append(
            [
                f"{r['model']}, {hosts} hosts, {link}",
                f"{r['grad_mb']:.1f} MB",
                fmt_iqr([1000 * s for s in b["ddp"]], ".1f", " ms"),
                fmt_iqr(pair_ratios(b["gradsync"], b["ddp"])),
                fmt_iqr(pair_ratios(b["gradsync-auto"], b["ddp"])) if "gradsync-auto" in b else "-",
                fmt_iqr(pair_ratios(b["gradsync-1mb"], b["ddp"])),
                fmt_iqr(pair_ratios(b["gradsync-25mb"], b["ddp"])),
                fmt_iqr([1000 * s for s in b["compute-only"]], ".1f", " ms"),
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
        "compute only",
    ]
    return (
        "gradsync `bsp` with its defaults (a first bucket of at most 1 MiB, then an eighth of "
        "the gradient, 1 to 25 MiB: `spec.default_bucket_mb`), with `bucket_mb='auto'` (a few "
        "plans timed over its first steps, the fastest kept), with `bucket_mb=1` and with "
        "`bucket_mb=25` (the plan before), against "
        "torch DDP with its defaults (1 MiB, then 25 MiB), one rank per emulated host, step "
        "time ratios per block (<= 1.00: gradsync as fast or faster), median and interquartile "
        "range.\n\n" + table(header, rows) + f"\n\n{machine()}. Command: `{command}`\n"
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
    p.add_argument("--write", action="store_true", help="add the section to BENCHMARKS.md")
    args = p.parse_args()
    missing = requirements_missing()
    if missing:
        print(f"first_bucket: skipped, the emulated cluster is unavailable: {missing}")
        return 0
    results = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="gradsync-first-bucket-") as tmp:
        for hosts in (int(h) for h in args.hosts.split(",")):
            for link in args.links.split(","):
                out = Path(tmp) / f"{hosts}-{link}.json"
                results.append((hosts, link, run_one(hosts, link, args, out)))
                print(f"  {hosts} hosts, {link}: {time.monotonic() - started:.0f}s", flush=True)
    command = "python -m benchmarks.first_bucket " + " ".join(
        f"--{k.replace('_', '-')} {v}" for k, v in vars(args).items() if k != "write"
    )
    body = render(results, command)
    print(body)
    if args.write:
        write_section(f"first_bucket_{args.model}", body)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
