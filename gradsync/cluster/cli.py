"""``gradsync cluster up | down | status | probe``: the emulated cluster from the command line."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from gradsync.cluster.netns import DEFAULT_PREFIX, Cluster, cleanup_stale, list_clusters
from gradsync.cluster.system import requirements_missing
from gradsync.errors import UsageError
from gradsync.flags import add_flags, flag, from_namespace

# The flags of each action are the fields of its dataclass below (gradsync.flags builds the
# parsers, as run's from RunConfig); the actions share fields by inheriting them.


@dataclasses.dataclass(slots=True, kw_only=True)
class ClusterOptions:
    """The flag of every action."""

    prefix: str = flag(DEFAULT_PREFIX, help="prefix of every name we create (%(default)s)")


@dataclasses.dataclass(slots=True, kw_only=True)
class LinkOptions(ClusterOptions):
    """The flags of the actions that build a cluster: its hosts and their links."""

    hosts: int = flag(2, help="emulated hosts (default %(default)s)")
    link: str = flag("1gbit", help="each host's link rate, e.g. 100mbit, 1gbit (%(default)s)")
    burst: str | None = flag(None, help="tbf bucket, e.g. 64kb (default: 1 ms)")


@dataclasses.dataclass(slots=True, kw_only=True)
class UpOptions(LinkOptions):
    name: str | None = flag(None, help="1-4 of a-z0-9 (default: random)")


@dataclasses.dataclass(slots=True, kw_only=True)
class DownOptions(ClusterOptions):
    name: str | None = flag(None, help="only this cluster")


@dataclasses.dataclass(slots=True, kw_only=True)
class ProbeOptions(LinkOptions):
    size_mb: float = flag(8.0, help="buffer, 10^6 bytes")
    iters: int = flag(3, help="timed all-reduces (median reported)")
    warmup: int = flag(1, help="untimed all-reduces first")
    nproc_per_host: int = flag(1, help="ranks per host")
    timeout: float = flag(300.0, help="seconds for the whole job")
    json_out: str | None = flag(None, option="--json", help="also write the result here")


def add_parsers(sub: Any) -> None:
    p = sub.add_parser(
        "cluster", help="emulated multi-host cluster: network namespaces + rate-limited links"
    )
    actions = p.add_subparsers(dest="cluster_command", metavar="ACTION")
    actions.required = True
    for name, options, func, summary in (
        ("up", UpOptions, cmd_up, "build a cluster and leave it up"),
        ("down", DownOptions, cmd_down, "remove clusters (all with the prefix, or --name)"),
        ("status", ClusterOptions, cmd_status, "list clusters that exist"),
        (
            "probe",
            ProbeOptions,
            cmd_probe,
            "bring a cluster up, time all-reduces across it, tear it down",
        ),
    ):
        action = actions.add_parser(name, help=summary)
        add_flags(action, options)
        action.set_defaults(func=func)


def _require() -> None:
    missing = requirements_missing()
    if missing:
        raise UsageError(f"{missing}; nothing was changed")


def cmd_up(args: argparse.Namespace) -> int:
    opts = from_namespace(UpOptions, args)
    cluster = Cluster(
        hosts=opts.hosts, link=opts.link, burst=opts.burst, prefix=opts.prefix, name=opts.name
    )
    _require()
    cluster.up()
    state = cluster.status()
    print(state.format() if state else f"cluster {cluster.base}: up")
    print(
        f"run a command on host 0:  ip netns exec {cluster.host(0).netns} COMMAND\n"
        f"remove it:                gradsync cluster down --name {cluster.tag}"
        + ("" if opts.prefix == DEFAULT_PREFIX else f" --prefix {opts.prefix}")
    )
    return 0


def cmd_down(args: argparse.Namespace) -> int:
    opts = from_namespace(DownOptions, args)
    _require()
    removed = cleanup_stale(opts.prefix, opts.name)
    if removed:
        print("removed: " + " ".join(removed))
    else:
        print(f"nothing to remove (no namespace named {opts.prefix}{opts.name or '*'}-*)")
    return 0


def cmd_status(args: argparse.Namespace) -> int:
    opts = from_namespace(ClusterOptions, args)
    _require()
    clusters = list_clusters(opts.prefix)
    if not clusters:
        print(f"no cluster (no namespace named {opts.prefix}*-h*/-sw)")
    for state in clusters:
        print(state.format())
    return 0


def cmd_probe(args: argparse.Namespace) -> int:
    from gradsync.cluster.launch import launch_on_cluster

    opts = from_namespace(ProbeOptions, args)
    cluster = Cluster(hosts=opts.hosts, link=opts.link, burst=opts.burst, prefix=opts.prefix)
    if opts.size_mb <= 0 or opts.iters < 1 or opts.warmup < 0:
        raise UsageError("need --size-mb > 0, --iters >= 1 and --warmup >= 0")
    if cluster.hosts < 2 and opts.nproc_per_host < 2:
        raise UsageError("an all-reduce needs 2 ranks: use --hosts 2 or --nproc-per-host 2")
    _require()
    with tempfile.TemporaryDirectory(prefix="gradsync-probe-") as tmp:
        out = Path(tmp) / "probe.json"
        # The probe runs as root inside the namespaces; keep its output file private.
        os.chmod(tmp, 0o700)
        module = ["gradsync.cluster.allreduce_probe", "--size-mb", str(opts.size_mb)]
        module += ["--iters", str(opts.iters), "--warmup", str(opts.warmup), "--out", str(out)]
        print(
            f"gradsync cluster probe: {cluster.hosts} host(s) x {opts.nproc_per_host} rank(s), "
            f"link {cluster.link}, all-reduce of {opts.size_mb:g} MB",
            file=sys.stderr,
        )
        with cluster:
            rc = launch_on_cluster(cluster, module, opts.nproc_per_host, {}, opts.timeout)
        if rc != 0:
            print(f"gradsync: error: the probe failed (exit code {rc})", file=sys.stderr)
            return 1
        result = json.loads(out.read_text())
    result["link_bps"] = cluster.rate_bps
    result["busbw_fraction_of_link"] = result["busbw_bps"] / cluster.rate_bps
    if opts.json_out:
        Path(opts.json_out).write_text(json.dumps(result, indent=2) + "\n")
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
