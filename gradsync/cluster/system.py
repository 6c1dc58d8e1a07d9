"""The kernel side of the emulated cluster: iproute2 commands, the requirements check, and
processes inside namespaces."""

from __future__ import annotations

import functools
import os
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress

from gradsync import procfs

CMD_TIMEOUT_S = 20.0
_SBIN = "/usr/sbin:/sbin:/usr/bin:/bin"


def tool(name: str) -> str | None:
    return shutil.which(name) or shutil.which(name, path=_SBIN)


def run(*argv: str, check: bool = True) -> str:
    """Run an iproute2 command; failures raise with the command and its stderr."""
    exe = tool(argv[0]) or argv[0]
    proc = subprocess.run(
        [exe, *argv[1:]],
        capture_output=True,
        text=True,
        timeout=CMD_TIMEOUT_S,
        check=False,
    )
    if check and proc.returncode != 0:
        raise RuntimeError(f"`{' '.join(argv)}` failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


@functools.cache
def requirements_missing() -> str | None:
    """None when clusters can be built here, else a message that says what is missing."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        uid = os.geteuid() if hasattr(os, "geteuid") else "?"
        return f"the emulated cluster needs root (running as uid {uid})"
    for name in ("ip", "tc"):
        if tool(name) is None:
            return f"the emulated cluster needs iproute2: `{name}` was not found on PATH"
    # A real try is the only reliable test: containers can be root yet lack CAP_SYS_ADMIN,
    # the veth module or sch_tbf.
    ns = f"gs-probe{os.getpid() % 100000}"
    try:
        run("ip", "netns", "add", ns)
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"network namespaces are not permitted here: {exc}"
    try:
        run("ip", "-n", ns, "link", "add", "name", "gsa", "type", "veth", "peer", "name", "gsb")
        run("tc", "-n", ns, "qdisc", "add", "dev", "gsa", "root", "tbf", "rate", "1mbit",
             "burst", "16kb", "latency", "50ms")  # fmt: skip
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        return f"veth pairs or the tbf qdisc are not available: {exc}"
    finally:
        run("ip", "netns", "del", ns, check=False)
    return None


def list_namespaces() -> list[str]:
    return [line.split()[0] for line in run("ip", "netns", "list").splitlines() if line.strip()]


def pids_in(ns: str) -> list[int]:
    out = run("ip", "netns", "pids", ns, check=False)
    return [int(p) for p in out.split() if p.isdigit()]


def alive(pid: int) -> bool:
    return procfs.state(pid) not in (None, "Z")


def kill_pids(pids: list[int], grace_s: float = 3.0) -> None:
    """SIGTERM, wait up to ``grace_s``, then SIGKILL whatever is left."""
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in pids:
            with suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)
        deadline = time.monotonic() + grace_s
        while any(alive(p) for p in pids) and time.monotonic() < deadline:
            time.sleep(0.05)
        pids = [p for p in pids if alive(p)]
        if not pids:
            return


@contextmanager
def signals_deferred() -> Iterator[None]:
    """Teardown must finish: a second Ctrl-C during it is delivered only afterwards."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    sigs = {signal.SIGINT, signal.SIGTERM, signal.SIGHUP}
    old = signal.pthread_sigmask(signal.SIG_BLOCK, sigs)
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)
