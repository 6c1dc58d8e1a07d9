"""An emulated multi-host cluster on one Linux machine: network namespaces, veth, a bridge, tbf.

Topology for ``Cluster(hosts=H, link="100mbit")`` with tag ``t`` and prefix ``gs-``::

    netns gs-t-h0  [lo, gs-t-h0 10.213.0.1/24, tbf]--veth--[gs-t-s0, tbf]--+
    netns gs-t-h1  [lo, gs-t-h1 10.213.0.2/24, tbf]--veth--[gs-t-s1, tbf]--+-- bridge gs-t-br
    ...                                                                      (netns gs-t-sw)

Every interface is created directly inside a namespace of ours (``ip link add ... netns``), and
the bridge lives in a dedicated "switch" namespace, so the host's own interfaces, addresses and
routes are never touched and the 10.213.0.0/24 addresses cannot reach any real network.
Removing the namespaces removes everything: a veth pair dies with either end's namespace.
"""

from __future__ import annotations

import re
import secrets
import signal
import threading
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

from gradsync.cluster.system import (
    kill_pids,
    list_namespaces,
    pids_in,
    requirements_missing,
    run,
    signals_deferred,
)
from gradsync.errors import UsageError

DEFAULT_PREFIX = "gs-"
SUBNET = "10.213.0"  # the /24 this tool owns; only ever configured inside our namespaces
PREFIX_LEN = 24
MAX_HOSTS = 250
# tbf queues at most this long before dropping; a real switch port buffers about this much.
LATENCY = "50ms"

_RATE_UNITS = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "tbit": 10**12}
# tc's own size units (binary multiples); "kbit"/"mbit" are sizes in bits, as in tc's examples.
_SIZE_UNITS = {
    "": 1,
    "b": 1,
    "k": 1024,
    "kb": 1024,
    "m": 1024**2,
    "mb": 1024**2,
    "bit": 1 / 8,
    "kbit": 1024 / 8,
    "mbit": 1024**2 / 8,
}
_PREFIX_RE = re.compile(r"^[a-z][a-z0-9]{0,4}-$")
_TAG_RE = re.compile(r"^[a-z0-9]{1,4}$")


class ClusterUnavailableError(RuntimeError):
    """Root, iproute2 or network namespaces are missing; the message says which."""


def parse_rate(text: str) -> int:
    """``"100mbit"`` -> 100_000_000 bits per second (SI multiples, as tc reads rates)."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]+)\s*", str(text).lower())
    if not m or m.group(2) not in _RATE_UNITS:
        raise UsageError(
            f"bad link rate {text!r}: use a number and one of "
            f"{', '.join(_RATE_UNITS)} (e.g. 100mbit, 1gbit); "
            "bytes-per-second units such as 'mbps' are not accepted"
        )
    bps = int(float(m.group(1)) * _RATE_UNITS[m.group(2)])
    if not 10**4 <= bps <= 10**11:
        raise UsageError(f"link rate {text!r} out of range: use 10kbit to 100gbit")
    return bps


def parse_size(text: str) -> int:
    """A tc size (``"32kbit"``, ``"64kb"``, ``"16384"``) in bytes."""
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-z]*)\s*", str(text).lower())
    if not m or m.group(2) not in _SIZE_UNITS:
        raise UsageError(
            f"bad burst {text!r}: use bytes or a unit among "
            f"{', '.join(u for u in _SIZE_UNITS if u)} (e.g. 64kb, 32kbit)"
        )
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2)])


@dataclass(frozen=True)
class Host:
    index: int
    netns: str
    ifname: str  # inside ``netns``; give it to GLOO_SOCKET_IFNAME
    addr: str


def _ns_pattern(prefix: str, tag: str | None) -> re.Pattern[str]:
    t = re.escape(tag) if tag else r"[a-z0-9]{1,4}"
    return re.compile(rf"^{re.escape(prefix)}(?P<tag>{t})-(?P<role>h(?P<i>\d+)|sw)$")


def cleanup_stale(prefix: str = DEFAULT_PREFIX, tag: str | None = None) -> list[str]:
    """Remove every namespace of ours (all clusters with ``prefix``, or only ``tag``), killing
    the processes inside first: a namespace that still holds a process outlives ``ip netns del``.
    Returns the names removed. Nothing without our prefix and naming pattern is touched."""
    _check_prefix(prefix)
    if tag is not None and not _TAG_RE.match(tag):
        raise UsageError(f"bad cluster name {tag!r}: 1-4 of a-z, 0-9")
    pattern = _ns_pattern(prefix, tag)
    removed: list[str] = []
    with signals_deferred():
        ours = [ns for ns in list_namespaces() if pattern.match(ns)]
        # Hosts before the switch, so no process keeps talking through a half-removed bridge.
        ours.sort(key=lambda ns: ns.endswith("-sw"))
        kill_pids([p for ns in ours for p in pids_in(ns)])
        for ns in ours:
            run("ip", "netns", "del", ns, check=False)
            removed.append(ns)
        # Interfaces are never created in the root namespace; sweep our pattern anyway, in case
        # an older or interrupted version left one there.
        link_re = re.compile(
            rf"^{re.escape(prefix)}{re.escape(tag) if tag else r'[a-z0-9]{1,4}'}-(h\d+|s\d+|br)$"
        )
        for line in run("ip", "-o", "link", "show", check=False).splitlines():
            parts = line.split(":", 2)
            name = parts[1].strip().split("@")[0] if len(parts) > 1 else ""
            if link_re.match(name):
                run("ip", "link", "del", "dev", name, check=False)
                removed.append(name)
    return removed


def _check_prefix(prefix: str) -> None:
    if not _PREFIX_RE.match(prefix):
        raise UsageError(
            f"bad prefix {prefix!r}: a letter, up to 4 more of a-z/0-9, then '-' (e.g. 'gs-'); "
            "it keeps interface names within Linux's 15 characters"
        )


@dataclass(kw_only=True)
class Cluster:
    """H emulated hosts; use as ``with Cluster(hosts=2, link="100mbit") as c:``.

    ``link`` limits each host's egress and ingress separately (full duplex, like an Ethernet
    port). ``burst`` is tbf's bucket; by default 1 ms of the link, at least 16 KiB, which is
    enough for the kernel's timer resolution and small against any transfer worth measuring.
    """

    hosts: int = 2
    link: str = "1gbit"
    burst: str | None = None
    prefix: str = DEFAULT_PREFIX
    name: str | None = None  # the tag in every name; random when None
    rate_bps: int = field(init=False)
    burst_bytes: int = field(init=False)
    _old_handlers: dict[int, Any] = field(init=False, default_factory=dict, repr=False)

    def __post_init__(self) -> None:
        if not isinstance(self.hosts, int) or not 1 <= self.hosts <= MAX_HOSTS:
            raise UsageError(f"--hosts must be 1 to {MAX_HOSTS}, got {self.hosts!r}")
        self.rate_bps = parse_rate(self.link)
        if self.burst is None:
            self.burst_bytes = max(16 * 1024, self.rate_bps // 8 // 1000)
        else:
            self.burst_bytes = parse_size(self.burst)
            if self.burst_bytes < 2048:
                raise UsageError(
                    f"burst {self.burst!r} is below one full frame: use at least 2kb (e.g. 32kb)"
                )
        _check_prefix(self.prefix)
        if self.name is None:
            self.name = secrets.token_hex(2)
        elif not _TAG_RE.match(self.name):
            raise UsageError(f"bad cluster name {self.name!r}: 1-4 of a-z, 0-9")

    # Names -------------------------------------------------------------------------------

    @property
    def tag(self) -> str:
        assert self.name is not None
        return self.name

    @property
    def base(self) -> str:
        return f"{self.prefix}{self.tag}"

    @property
    def switch_ns(self) -> str:
        return f"{self.base}-sw"

    @property
    def bridge(self) -> str:
        return f"{self.base}-br"

    def host(self, i: int) -> Host:
        return Host(i, f"{self.base}-h{i}", f"{self.base}-h{i}", f"{SUBNET}.{i + 1}")

    def switch_port(self, i: int) -> str:
        return f"{self.base}-s{i}"

    @property
    def host_list(self) -> list[Host]:
        return [self.host(i) for i in range(self.hosts)]

    def namespaces(self) -> list[str]:
        return [h.netns for h in self.host_list] + [self.switch_ns]

    # Lifecycle ---------------------------------------------------------------------------

    def up(self) -> Cluster:
        """Build the namespaces, links and rate limits; on any failure remove what was built."""
        missing = requirements_missing()
        if missing:
            raise ClusterUnavailableError(missing)
        existing = [ns for ns in list_namespaces() if _ns_pattern(self.prefix, self.tag).match(ns)]
        if existing:
            raise UsageError(
                f"cluster {self.base} already exists ({', '.join(existing)}); "
                f"remove it with `gradsync cluster down --name {self.tag}`"
            )
        try:
            self._build()
        except BaseException:
            self.down()
            raise
        return self

    def _build(self) -> None:
        sw, br = self.switch_ns, self.bridge
        tbf = ["tbf", "rate", f"{self.rate_bps}bit", "burst", str(self.burst_bytes)]
        tbf += ["latency", LATENCY]
        run("ip", "netns", "add", sw)
        run("ip", "-n", sw, "link", "add", "name", br, "type", "bridge", "stp_state", "0")
        # No IPv6 link-local addresses: no neighbour discovery chatter on a measured link.
        run("ip", "-n", sw, "link", "set", "dev", br, "addrgenmode", "none")
        run("ip", "-n", sw, "link", "set", "dev", br, "up")
        for h in self.host_list:
            port = self.switch_port(h.index)
            run("ip", "netns", "add", h.netns)
            run("ip", "-n", h.netns, "link", "add", "name", h.ifname, "type", "veth",
                 "peer", "name", port, "netns", sw)  # fmt: skip
            run("ip", "-n", h.netns, "link", "set", "dev", h.ifname, "addrgenmode", "none")
            run("ip", "-n", sw, "link", "set", "dev", port, "addrgenmode", "none")
            run("ip", "-n", sw, "link", "set", "dev", port, "master", br)
            run("ip", "-n", sw, "link", "set", "dev", port, "up")
            run("ip", "-n", h.netns, "addr", "add", f"{h.addr}/{PREFIX_LEN}", "dev", h.ifname)
            run("ip", "-n", h.netns, "link", "set", "dev", h.ifname, "up")
            run("ip", "-n", h.netns, "link", "set", "dev", "lo", "up")
            # Egress of the host, and (on the switch port) everything sent to it.
            run("tc", "-n", h.netns, "qdisc", "add", "dev", h.ifname, "root", *tbf)
            run("tc", "-n", sw, "qdisc", "add", "dev", port, "root", *tbf)

    def down(self) -> list[str]:
        """Kill our processes in the namespaces and delete them; safe to call twice."""
        return cleanup_stale(self.prefix, self.tag)

    def status(self) -> ClusterState | None:
        """What the kernel has for this cluster now (None when nothing exists)."""
        for state in list_clusters(self.prefix):
            if state.tag == self.tag:
                return state
        return None

    def __enter__(self) -> Cluster:
        self.up()
        self._install_handlers()
        return self

    def __exit__(self, *exc: object) -> None:
        try:
            self.down()
        finally:
            self._restore_handlers()

    def _install_handlers(self) -> None:
        self._old_handlers = install_exit_handlers()

    def _restore_handlers(self) -> None:
        restore_handlers(self._old_handlers)
        self._old_handlers = {}


def install_exit_handlers() -> dict[int, Any]:
    """SIGTERM/SIGHUP would end the process without running ``finally`` blocks; turning them
    into SystemExit lets teardown run. SIGINT already raises KeyboardInterrupt. Returns the
    handlers to restore; a no-op outside the main thread, where handlers cannot be set."""
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {sig: signal.signal(sig, _exit_on_signal) for sig in (signal.SIGTERM, signal.SIGHUP)}


def restore_handlers(old: dict[int, Any]) -> None:
    for sig, handler in old.items():
        signal.signal(sig, handler)


def _exit_on_signal(signum: int, frame: FrameType | None) -> None:
    raise SystemExit(128 + signum)


@dataclass
class HostState:
    netns: str
    ifname: str
    addr: str | None
    qdisc: str | None
    sent_bytes: int | None  # through the host's egress tbf since the cluster came up
    pids: list[int]


@dataclass
class ClusterState:
    prefix: str
    tag: str
    switch: bool
    hosts: list[HostState]

    def format(self) -> str:
        sw = "switch up" if self.switch else "switch MISSING"
        lines = [f"cluster {self.prefix}{self.tag}: {len(self.hosts)} host(s), {sw}"]
        for h in self.hosts:
            lines.append(
                f"  {h.netns:<16} {h.ifname:<16} {h.addr or '-':<14} "
                f"{h.qdisc or 'no rate limit':<12} sent {(h.sent_bytes or 0) / 1e6:9.1f} MB  "
                f"processes: {len(h.pids)}"
            )
        return "\n".join(lines)


def list_clusters(prefix: str = DEFAULT_PREFIX) -> list[ClusterState]:
    """Every cluster with ``prefix`` the kernel knows about, read back from the namespaces."""
    _check_prefix(prefix)
    pattern = _ns_pattern(prefix, None)
    found: dict[str, ClusterState] = {}
    for ns in sorted(list_namespaces()):
        m = pattern.match(ns)
        if not m:
            continue
        state = found.setdefault(m["tag"], ClusterState(prefix, m["tag"], False, []))
        if m["role"] == "sw":
            state.switch = True
            continue
        ifname = ns
        addr = run("ip", "-n", ns, "-4", "-o", "addr", "show", "dev", ifname, check=False)
        qdisc = run("tc", "-n", ns, "-s", "qdisc", "show", "dev", ifname, check=False)
        a = re.search(r"inet (\S+)", addr)
        q = re.search(r"tbf .*?rate (\S+)", qdisc)
        sent = re.search(r"Sent (\d+) bytes", qdisc)
        state.hosts.append(
            HostState(
                ns,
                ifname,
                a[1] if a else None,
                f"tbf {q[1]}" if q else None,
                int(sent[1]) if sent else None,
                pids_in(ns),
            )
        )
    for state in found.values():
        state.hosts.sort(key=lambda h: int(h.netns.rsplit("-h", 1)[1]))
    return list(found.values())
