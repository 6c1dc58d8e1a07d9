"""``gradsync cluster up | down | status | probe``: the emulated cluster from the command line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from gradsync.cluster.netns import DEFAULT_PREFIX, Cluster, cleanup_stale, list_clusters
from gradsync.cluster.system import requirements_missing
from gradsync.errors import UsageError


def add_parsers(sub: Any) -> None:
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--prefix", default=DEFAULT_PREFIX, help="prefix of every name we create (%(default)s)"
    )
    link = argparse.ArgumentParser(add_help=False)
    link.add_argument("--hosts", type=int, default=2, help="emulated hosts (default %(default)s)")
    link.add_argument(
        "--link", default="1gbit", help="each host's link rate, e.g. 100mbit, 1gbit (%(default)s)"
    )
    link.add_argument("--burst", default=None, help="tbf bucket, e.g. 64kb (default: 1 ms)")

    p = sub.add_parser(
        "cluster", help="emulated multi-host cluster: network namespaces + rate-limited links"
    )
    actions = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    actions.required = True

    up = actions.add_parser("up", parents=[common, link], help="build a cluster and leave it up")
    up.add_argument("--name", default=None, help="1-4 of a-z0-9 (default: random)")
    up.set_defaults(func=cmd_up)

    down = actions.add_parser(
        "down", parents=[common], help="remove clusters (all with the prefix, or --name)"
    )
    down.add_argument("--name", default=None, help="only this cluster")
    down.set_defaults(func=cmd_down)

    status = actions.add_parser("status", parents=[common], help="list clusters that exist")
    status.set_defaults(func=cmd_status)

    probe = actions.add_parser(
        "probe",
        parents=[common, link],
        help="bring a cluster up, time all-reduces across it, tear it down",
    )
    probe.add_argument("--size-mb", type=float, default=8.0, help="buffer, 10^6 bytes")
    probe.add_argument("--iters", type=int, default=3, help="timed all-reduces (median reported)")
    probe.add_argument("--warmup", type=int, default=1, help="untimed all-reduces first")
    probe.add_argument("--nproc-per-host", type=int, default=1, help="ranks per host")
    probe.add_argument("--timeout", type=float, default=300.0, help="seconds for the whole job")
    probe.add_argument("--json", dest="json_out", default=None, help="also write the result here")
    probe.set_defaults(func=cmd_probe)


def _require() -> None:
    missing = requirements_missing()
    if missing:
        raise UsageError(f"{missing}; nothing was changed")


def cmd_up(args: argparse.Namespace) -> int:
    cluster = Cluster(
        hosts=args.hosts, link=args.link, burst=args.burst, prefix=args.prefix, name=args.name
    )
    _require()
    cluster.up()
    state = cluster.status()
    print(state.format() if state else f"cluster {cluster.base}: up")
    print(
        f"run a command on host 0:  ip netns exec {cluster.host(0).netns} COMMAND\n"
        f"remove it:                gradsync cluster down --name {cluster.tag}"
        + ("" if args.prefix == DEFAULT_PREFIX else f" --prefix {args.prefix}")
    )
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    _require()
    removed = cleanup_stale(args.prefix, args.name)
    if removed:
        print("removed: " + " ".join(removed))
    else:
        print(f"nothing to remove (no namespace named {args.prefix}{args.name or '*'}-*)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    _require()
    clusters = list_clusters(args.prefix)
    if not clusters:
        print(f"no cluster (no namespace named {args.prefix}*-h*/-sw)")
    for state in clusters:
        print(state.format())
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from gradsync.cluster.launch import launch_on_cluster

    cluster = Cluster(hosts=args.hosts, link=args.link, burst=args.burst, prefix=args.prefix)
    if args.size_mb <= 0 or args.iters < 1 or args.warmup < 0:
        raise UsageError("need --size-mb > 0, --iters >= 1 and --warmup >= 0")
    if cluster.hosts < 2 and args.nproc_per_host < 2:
        raise UsageError("an all-reduce needs 2 ranks: use --hosts 2 or --nproc-per-host 2")
    _require()
    with tempfile.TemporaryDirectory(prefix="gradsync-probe-") as tmp:
        out = Path(tmp) / "probe.json"
        # The probe runs as root inside the namespaces; keep its output file private.
        os.chmod(tmp, 0o700)
        module = ["gradsync.cluster.allreduce_probe", "--size-mb", str(args.size_mb)]
        module += ["--iters", str(args.iters), "--warmup", str(args.warmup), "--out", str(out)]
        print(
            f"gradsync cluster probe: {cluster.hosts} host(s) x {args.nproc_per_host} rank(s), "
            f"link {cluster.link}, all-reduce of {args.size_mb:g} MB",
            file=sys.stderr,
        )
        with cluster:
            rc = launch_on_cluster(cluster, module, args.nproc_per_host, {}, args.timeout)
        if rc != 0:
            print(f"gradsync: error: the probe failed (exit code {rc})", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    result["link_bps"] = cluster.rate_bps
    result["busbw_fraction_of_link"] = result["busbw_bps"] / cluster.rate_bps
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(result, indent=2) + "\n")
    print(format_probe(result))
    return 0


def format_probe(result: dict[str, Any]) -> str:
    return (
        f"all-reduce {result['bytes'] / 1e6:g} MB over {result['world_size']} ranks, "
        f"median of {result['iters']}: {result['time_s']:.3f} s\n"
        f"algbw {result['algbw_Bps'] * 8 / 1e6:.1f} Mbit/s, "
        f"busbw {result['busbw_bps'] / 1e6:.1f} Mbit/s = "
        f"{100 * result['busbw_fraction_of_link']:.0f}% of the {result['link']} link "
        "(busbw = algbw * 2(n-1)/n, the rate each rank's link carried)"
    )
