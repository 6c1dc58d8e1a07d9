"""Whether a peer's process is running, asked of the kernel rather than of its heartbeat.

A rank's heartbeat is written by a Python thread, which cannot run while the rank's main thread
holds the GIL: a C call that keeps it (a long op of an extension that does not release it)
silences the heartbeat of a process that is working. Before the step gate blames a silent
peer, it asks here whether that process still runs. Each rank publishes its
:func:`identity` (machine, pid namespace, pid and start time); a peer on the same machine and
in the same pid namespace (the emulated cluster's hosts share both) reads ``/proc/PID/stat``:
running or sleeping is alive, a zombie, a stopped process (SIGSTOP, a debugger) or a pid
now held by another process is not. A peer on another machine cannot be asked this way
(``None``): its silence is judged as before.
"""

from __future__ import annotations

import os
from pathlib import Path

_PROC = Path("/proc")
#: ``/proc/PID/stat`` states of a process that will not run again without help: zombie, dead,
#: stopped, stopped by a tracer
_NOT_RUNNING = frozenset("ZXxTt")


def _machine() -> str:
    """This boot of this machine and this pid namespace: where a pid means the same process."""
    try:
        boot = (_PROC / "sys/kernel/random/boot_id").read_text().strip()
        return f"{boot}:{os.readlink(_PROC / 'self/ns/pid')}"
    except OSError:
        return ""


def _stat(pid: int) -> tuple[str, str] | None:
    """The state and the start time (clock ticks after boot) of ``pid``, or None when gone."""
    try:
        text = (_PROC / str(pid) / "stat").read_text()
    except OSError:
        return None
    # The command name (in parentheses) may hold spaces: the fields follow its last ')'.
    fields = text[text.rfind(")") + 2 :].split()
    return (fields[0], fields[19]) if len(fields) > 19 else None


def identity() -> str:
    """This process, as :func:`running` recognises it: ``machine|pid|start`` ("" where /proc
    is not there)."""
    machine, stat = _machine(), _stat(os.getpid())
    if not machine or stat is None:
        return ""
    return f"{machine}|{os.getpid()}|{stat[1]}"


def running(peer: str) -> bool | None:
    """Whether the process ``peer`` (its :func:`identity`) runs: None where it cannot be told
    from here (another machine or pid namespace, no identity published)."""
    parts = peer.split("|")
    if len(parts) != 3 or not parts[1].isdigit():
        return None
    machine = parts[0]
    if not machine or machine != _machine():
        return None
    stat = _stat(int(parts[1]))
    if stat is None or stat[1] != parts[2]:
        return False  # gone, or its pid reused by another process
    return stat[0] not in _NOT_RUNNING


__all__ = ["identity", "running"]
