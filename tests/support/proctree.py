"""A run's process tree, seen from /proc while it runs: its processes and its listening sockets.

For the end-to-end tests that check what a ``gradsync run`` leaves open or running (Linux)."""

from __future__ import annotations

import contextlib
import ipaddress
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

PROC = Path("/proc")
LISTEN = "0A"  # the TCP state column of /proc/net/tcp*


def start_run(*args: str) -> subprocess.Popen[str]:
    """``gradsync run ARGS`` in a session of its own, stderr captured for the messages."""
    return subprocess.Popen(
        [sys.executable, "-m", "gradsync", "run", *args],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def descendants(root: int) -> set[int]:
    """``root`` and every live process below it, by parent links."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir(PROC):
        if entry.isdigit():
            with contextlib.suppress(OSError, IndexError, ValueError):
                with open(f"/proc/{entry}/stat", "rb") as f:
                    stat = f.read()
                ppid = int(stat.rsplit(b")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(entry))
    found, stack = {root}, [root]
    while stack:
        for child in children.get(stack.pop(), []):
            found.add(child)
            stack.append(child)
    return found


def _stat(pid: int) -> list[bytes] | None:
    """The fields of /proc/PID/stat after the command name (state first), or None."""
    try:
        return (PROC / str(pid) / "stat").read_bytes().rsplit(b")", 1)[1].split()
    except OSError:
        return None


def started(pid: int) -> int | None:
    """When ``pid`` started (clock ticks since boot): with the pid, names one process for good."""
    fields = _stat(pid)
    return int(fields[19]) if fields else None


def alive(pid: int, start: int | None = None) -> bool:
    """Running or stopped (and, given ``start``, the same process, not a reuse of its pid); a
    zombie (dead, waiting for its parent to read its status) is not."""
    fields = _stat(pid)
    if fields is None or fields[0] in (b"Z", b"X"):
        return False
    return start is None or int(fields[19]) == start


def reaped_within(pid: int, within_s: float = 10.0) -> bool:
    """Whether ``pid`` is gone, reaped too (``os.kill`` still finds a zombie), within
    ``within_s`` seconds."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


def pids_in_netns(inodes: set[int]) -> list[int]:
    """The processes whose network namespace is one of ``inodes`` (an emulated host's)."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            link = os.readlink(f"/proc/{entry}/ns/net")
        except OSError:
            continue
        if int(link.split("[")[1].rstrip("]")) in inodes:
            found.append(int(entry))
    return found


def _socket_inodes(pid: int) -> set[int]:
    inodes = set()
    fds = f"/proc/{pid}/fd"
    with contextlib.suppress(OSError):
        for fd in os.listdir(fds):
            with contextlib.suppress(OSError):
                target = os.readlink(f"{fds}/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[len("socket:[") : -1]))
    return inodes


def _netns(pid: int) -> str | None:
    """``pid``'s network namespace ("net:[INODE]"), or None once it is gone."""
    try:
        return os.readlink(f"/proc/{pid}/ns/net")
    except OSError:
        return None


def _address(hex_addr: str) -> str:
    """/proc/net/tcp's address column (host-order 32-bit words in hex) as text."""
    raw = bytes.fromhex(hex_addr)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))
    return str(ipaddress.ip_address(words))


def _listening(pid: int) -> dict[int, str]:
    """inode -> "address:port" of every listening TCP socket in ``pid``'s network namespace."""
    found = {}
    for table in ("tcp", "tcp6"):
        with contextlib.suppress(OSError):
            for line in (PROC / str(pid) / "net" / table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == LISTEN:
                    addr, port = cols[1].split(":")
                    found[int(cols[9])] = f"{_address(addr)}:{int(port, 16)}"
    return found


def listeners_of(pid: int) -> list[str]:
    """ "address:port" of every TCP socket ``pid`` listens on."""
    listening = _listening(pid)
    return sorted(listening[inode] for inode in _socket_inodes(pid) & listening.keys())


def is_loopback(listener: str) -> bool:
    ip = ipaddress.ip_address(listener.rpartition(":")[0])
    mapped = ip.ipv4_mapped if isinstance(ip, ipaddress.IPv6Address) else None
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


@dataclass
class Watched:
    """What was seen of a run's tree: every process (and when it started), every listener
    (with its process's command line)."""

    pids: set[int] = field(default_factory=set)
    listeners: set[tuple[str, int, str]] = field(default_factory=set)  # (address:port, pid, cmd)
    starts: dict[int, int] = field(default_factory=dict)
    samples: int = 0

    def sample(self, root: int) -> None:
        tree = descendants(root)
        for pid in tree - self.pids:
            start = started(pid)
            if start is not None:
                self.starts[pid] = start
        self.pids |= tree
        # A network namespace's listening sockets, read once a sample for all of its processes
        # (the kernel writes out every socket of the namespace each time the table is read:
        # once per process, that was most of a sample's time, taken from the run it watches).
        tables: dict[str, dict[int, str]] = {}
        for pid in tree:
            inodes = _socket_inodes(pid)
            if not inodes:
                continue
            netns = _netns(pid)
            listening = tables.get(netns) if netns is not None else None
            if listening is None:
                listening = _listening(pid)
                if netns is not None and _netns(pid) == netns:  # read whole: still running
                    tables[netns] = listening
            for inode in inodes & listening.keys():
                with contextlib.suppress(OSError):
                    cmd = (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ")
                    self.listeners.add((listening[inode], pid, cmd.decode()[:120]))
        self.samples += 1

    def survivors(self) -> list[int]:
        """The processes seen that are still alive."""
        return sorted(pid for pid, start in self.starts.items() if alive(pid, start))

    def kill_all(self) -> None:
        """SIGKILL every process seen that is still alive (a failed test leaves nothing)."""
        for pid in self.survivors():
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, signal.SIGKILL)


def watch_until_exit(
    proc: subprocess.Popen[str], watched: Watched, timeout_s: float, interval_s: float = 0.05
) -> int | None:
    """Sample ``proc``'s tree until it exits (its return code) or ``timeout_s`` passes (None)."""
    deadline = time.monotonic() + timeout_s
    while proc.poll() is None and time.monotonic() < deadline:
        watched.sample(proc.pid)
        time.sleep(interval_s)
    return proc.poll()


def watched_run(*args: str, timeout_s: float = 200) -> tuple[Watched, str]:
    """``gradsync run ARGS`` to its end, its tree sampled all along (every listener it opened
    is in ``listeners``); fails the test unless it exits 0. Returns what was seen and stderr."""
    proc = start_run(*args)
    watched = Watched()
    try:
        rc = watch_until_exit(proc, watched, timeout_s)
    finally:
        watched.kill_all()
        proc.kill()
        _, stderr = proc.communicate(timeout=30)
    assert rc == 0, stderr[-3000:]
    return watched, stderr


def describe_listeners(listeners: set[tuple[str, int, str]]) -> str:
    return "\n  ".join(f"{addr} (pid {pid}: {cmd})" for addr, pid, cmd in sorted(listeners))


def assert_listens_on_loopback_only(watched: Watched) -> None:
    """Some listener was seen (else the check saw nothing), and none beyond loopback."""
    assert watched.listeners, (
        f"no listener seen in {watched.samples} samples: the check saw nothing"
    )
    outside = {entry for entry in watched.listeners if not is_loopback(entry[0])}
    assert not outside, "listening beyond loopback:\n  " + describe_listeners(outside)


def assert_listens_on_hosts_only(
    listeners: set[tuple[str, int, str]], hosts: ipaddress.IPv4Network
) -> None:
    """None of ``listeners`` beyond loopback (inside a namespace, that host's own) or the
    emulated hosts' subnet ``hosts``: a wildcard socket is what this catches."""
    outside = {
        entry
        for entry in listeners
        if not is_loopback(entry[0])
        and ipaddress.ip_address(entry[0].rpartition(":")[0]) not in hosts
    }
    assert not outside, "listening beyond the hosts' addresses:\n  " + describe_listeners(outside)
