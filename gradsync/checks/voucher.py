"""A rank's liveness vouched for by a process beside it, for peers on other machines.

A rank's heartbeat (``gradsync.checks.diagnose``) is written by a Python thread: while the
rank's main thread holds the GIL (a long C call of an extension that does not release it), the
heartbeat stops although the process works. A peer on the same machine then asks the kernel
(``gradsync.checks.liveness``); a peer on another machine cannot. So where some peer is on
another machine, each rank starts a voucher at its first step gate: a small process of its own
that reads the rank's ``/proc/PID/stat`` once a heartbeat interval and writes what it saw into
the run's store as ``seq|state``. The number advances while the voucher runs; the state says
whether the rank runs (``R``, ``S``, ``D``) or is stopped (``T``, ``t``: SIGSTOP, a debugger).
A peer whose heartbeat is silent reads it before blaming (``ArrivalWatch.running``): a rank
its voucher says runs is busy in its own code and is waited for up to
``between_steps_timeout_s``; one stopped, or whose voucher fell silent too (its machine is
gone), is blamed after ``timeout_s``. Until the voucher first writes (it imports torch: a
couple of seconds after the first gate), and where it cannot start, a rank is judged by its
heartbeat alone, as before.

Why a process per rank that writes to the store, and not:

- a thread that needs no GIL: it would cost nothing, but Python has no such thread without an
  extension of gradsync's own to build for every platform;
- a reporter in the launcher's agent: it adds no process, but exists only under ``gradsync
  run``; under plain torchrun the agent is torch's, with no hook for it;
- one voucher per machine: less memory, but the ranks of a machine would have to agree who
  starts it and hand it over when that rank dies; per rank, the voucher lives and dies with
  its rank, and nothing is shared;
- a voucher that listens on a port of its own: the store is the one endpoint every rank is
  known to reach; a port of the voucher's would need an address the peers can reach, which a
  rank cannot know in general (several interfaces, a hostname that resolves to loopback);
- a client of the store's wire protocol without torch: it would save the import below, but
  tie gradsync to a protocol torch keeps private.

The cost is paid only where a peer is on another machine (ranks that all share one machine
start none): one process per rank, importing torch's store client (about 145 MB of private
memory and 1.7 s of CPU at start, measured with torch 2.13 on CPU), then one store write per
heartbeat interval (0.4 ms of CPU each). It writes to the TCPStore beneath the rank's
prefixes (``PrefixStore.underlying_store``; the peers read it there), at a key the rank names
through the run's secret and hands it over a pipe (the secret itself is not handed over). It leaves nothing behind: it exits when
the pipe from its rank closes (the rank stopped its watch, exited or was killed, SIGKILL
included: the kernel closes the pipe), when the rank is gone or a zombie, when it finds itself
reparented, or when the store is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import select
import signal
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist

from gradsync.checks import liveness
from gradsync.checks.secret import SECRET_ENV

#: how long the voucher waits for the store to answer when it connects and on each write
_STORE_TIMEOUT_S = 30.0
_MODULE = "gradsync.checks.voucher"


def tcp_store(store: Any) -> Any | None:
    """The TCPStore under ``store``'s prefixes, or None where there is none (a FileStore or
    a HashStore: no other machine reaches those)."""
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


class Voucher:
    """This rank's voucher process, as the rank sees it."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process

    @classmethod
    def start(cls, store: Any, key: str, beat_s: float) -> Voucher | None:
        """A voucher for this process writing to ``store``'s TCPStore at ``key`` every
        ``beat_s``; None where it cannot be started (no TCPStore, no /proc)."""
        tcp = tcp_store(store)
        start = liveness.start_of(os.getpid())
        if tcp is None or start is None:
            return None
        # The same gradsync as this process's, wherever that was imported from.
        root = str(Path(__file__).resolve().parents[2])
        # It is handed keys already named through the run's secret: it needs none.
        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        args = [str(os.getpid()), start, str(tcp.host), str(tcp.port), repr(beat_s)]
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", _MODULE, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        except OSError:
            return None
        voucher = cls(process)
        voucher.rename(key)
        return voucher

    @property
    def pid(self) -> int:
        return self._process.pid

    def rename(self, key: str) -> None:
        """Write at ``key`` from now on (the keys were renamed through a secret agreed after
        the voucher started)."""
        if self._process.stdin is not None:
            with contextlib.suppress(OSError, ValueError):  # it is gone: nothing to rename
                self._process.stdin.write(f"{key}\n".encode())
                self._process.stdin.flush()

    def close(self) -> None:
        """Tell the voucher to exit (it sees its pipe close), without waiting."""
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()

    def stop(self, timeout_s: float = 2.0) -> None:
        """Close and wait for the voucher to exit; kill it if it has not within ``timeout_s``
        (a child of this process that forked holds the pipe open)."""
        self.close()
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


@dataclass
class Vouch:
    """What a peer has seen of one rank's voucher."""

    seq: int = -1
    #: when ``seq`` last changed (the reader's clock: the machines' clocks may disagree)
    seen_at: float = 0.0

    def running(self, value: bytes | str, now: float, stale_s: float) -> bool:
        """Whether the rank runs, by its voucher's last word ``value``: it said so, and its
        number has advanced within ``stale_s`` (a voucher silent that long went with its
        machine). ``ValueError`` if ``value`` is not a voucher's."""
        text = value.decode() if isinstance(value, bytes) else value
        seq, _, state = text.partition("|")
        if int(seq) != self.seq:
            self.seq, self.seen_at = int(seq), now
        return bool(state) and state not in liveness.NOT_RUNNING and now - self.seen_at < stale_s


def _keys(pending: bytes) -> tuple[str | None, bytes]:
    """The last whole line of ``pending`` (the key to write at), and what follows it."""
    *lines, rest = pending.split(b"\n")
    return (lines[-1].decode() if lines else None), rest


def _vouch(pid: int, start: str, store: Any, beat_s: float) -> None:
    """Write rank ``pid``'s state at the key its pipe (stdin) names, once every ``beat_s``,
    until the pipe closes or the rank is gone."""
    key, pending, seq = "", b"", 0
    while True:
        ready, _, _ = select.select([0], [], [], beat_s)
        if ready:
            data = os.read(0, 4096)
            if not data:
                return  # the rank closed the pipe, or died
            named, pending = _keys(pending + data)
            key = named if named is not None else key
        state = liveness.state(pid, start)
        if state is None or state in "ZXx" or os.getppid() != pid:
            return  # gone, a zombie, or dead and this process handed to another parent
        if key:
            seq += 1
            store.set(key, f"{seq}|{state}")


def main(argv: list[str]) -> int:
    """``python -m gradsync.checks.voucher PID START HOST PORT BEAT_S``, started by
    :meth:`Voucher.start`; the key to write at comes on stdin, a line each time it changes."""
    pid, start, host, port, beat_s = argv
    # A terminal's Ctrl-C is for the rank to act on; its voucher follows it out when it goes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    timeout = datetime.timedelta(seconds=_STORE_TIMEOUT_S)
    try:
        store = dist.TCPStore(host, int(port), is_master=False, timeout=timeout)
    except (RuntimeError, OSError) as exc:
        print(
            f"gradsync: rank process {pid}'s voucher could not reach the store at "
            f"{host}:{port} ({exc}); peers on other machines judge it by its heartbeat alone",
            file=sys.stderr,
        )
        return 1
    with contextlib.suppress(RuntimeError, OSError):  # the store went with the end of the run
        _vouch(int(pid), start, store, float(beat_s))
    return 0


__all__ = ["Vouch", "Voucher", "tcp_store"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
