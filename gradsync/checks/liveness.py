"""Whether a peer's process is running, asked of the kernel rather than of its heartbeat.

A rank's heartbeat is written by a Python thread, which cannot run while the rank's main thread
holds the GIL: a C call that keeps it (a long op of an extension that does not release it)
silences the heartbeat of a process that is working. Before the step gate blames a silent
peer, it asks here whether that process still runs. Each rank publishes its
:func:`identity` (machine, pid namespace, pid and start time); a peer on the same machine and
in the same pid and network namespaces reads ``/proc/PID/stat``: running or sleeping is
alive, a zombie, a stopped process (SIGSTOP, a debugger) or a pid now held by another process
is not. A peer on another machine cannot be asked this way (``None``): a process beside it,
its voucher, asks its kernel instead (``gradsync.checks.voucher``).

Why the network namespace counts too: each host of the emulated cluster
(``gradsync.cluster``) is a network namespace of one machine, sharing its pid namespace. A pid
there could be read across hosts, but then a test on the cluster would never exercise what
runs between real machines; a peer in another network namespace is taken for another machine
(it is then vouched for, which works as well).
"""

from __future__ import annotations

import os
from pathlib import Path

from gradsync.procfs import state_and_start

_PROC = Path("/proc")
#: ``/proc/PID/stat`` states of a process that is over: zombie, dead
GONE = frozenset("ZXx")
#: and of one that will not run again without help: those, stopped, stopped by a tracer
NOT_RUNNING = GONE | frozenset("Tt")


def machine() -> str:
    """This boot of this machine, its pid namespace (where a pid means the same process) and
    its network namespace (see the module's docstring); "" where /proc is not there."""
    try:
        boot = (_PROC / "sys/kernel/random/boot_id").read_text().strip()
        pid_ns, net_ns = (os.readlink(_PROC / f"self/ns/{ns}") for ns in ("pid", "net"))
        return f"{boot}:{pid_ns}:{net_ns}"
    except OSError:
        return ""


def state(pid: int, start: str) -> str | None:
    """The ``/proc/PID/stat`` state of process ``pid`` if it is still the one that started at
    ``start`` (clock ticks after boot, as :func:`start_of` says), else None (gone, or its pid
    reused)."""
    stat = state_and_start(pid)
    return stat[0] if stat is not None and stat[1] == start else None


def start_of(pid: int) -> str | None:
    """When process ``pid`` started (clock ticks after boot), or None when it is gone."""
    stat = state_and_start(pid)
    return stat[1] if stat is not None else None


def identity() -> str:
    """This process, as :func:`running` recognises it: ``machine|pid|start`` ("" where /proc
    is not there)."""
    here, start = machine(), start_of(os.getpid())
    if not here or start is None:
        return ""
    return f"{here}|{os.getpid()}|{start}"


def running(peer: str) -> bool | None:
    """Whether the process ``peer`` (its :func:`identity`) runs: None where it cannot be told
    from here (another machine or pid namespace, no identity published)."""
    parts = peer.split("|")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    if not parts[0] or parts[0] != machine():
        return None
    now = state(int(parts[1]), parts[2])
    return now is not None and now not in NOT_RUNNING  # None: gone, or its pid reused


__all__ = ["GONE", "NOT_RUNNING", "identity", "machine", "running", "start_of", "state"]
