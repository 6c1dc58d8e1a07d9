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
start none): one process per rank, whatever the number of its Synchronizers (each claims a key
of its own, :func:`claim`), importing torch's store client (about 145 MB of private memory and
1.7 s of CPU at start, measured with torch 2.13 on CPU), then one store write per key and
heartbeat interval (0.4 ms of CPU each). It writes to the TCPStore beneath the rank's prefixes
(``PrefixStore.underlying_store``; the peers read it there), at keys the rank names through the
run's secret and hands it over a pipe (the secret itself is not handed over). It leaves nothing
behind: it exits when the pipe from its rank closes (the last claim was closed, or the rank
exited or was killed, SIGKILL included: the kernel closes the pipe), when the rank is gone or a
zombie, when it finds itself reparented, or when the store is gone.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import select
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from gradsync.checks import liveness

#: how long the voucher waits for the store to answer when it connects and on each write
_STORE_TIMEOUT_S = 30.0
#: the voucher's niceness, taken before it imports torch (see ``main``)
NICE = 19
_MODULE = "gradsync.checks.voucher"


def tcp_store(store: Any) -> Any | None:
    """The TCPStore under ``store``'s prefixes, or None where there is none (a FileStore or
    a HashStore: no other machine reaches those)."""
    import torch.distributed as dist  # the rank's, imported already (see ``main``)

    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    return store if isinstance(store, dist.TCPStore) else None


#: this process's voucher for each store (host, port): one, however many watches claim it
_VOUCHERS: dict[tuple[str, int], Voucher] = {}
_LOCK = threading.Lock()


class Voucher:
    """This process's voucher process for one store, as this process sees it."""

    def __init__(self, process: subprocess.Popen[bytes]) -> None:
        self._process = process
        self._owner = os.getpid()
        #: the claims not yet closed: the voucher is told to exit when none is left
        self.claims = 0

    @classmethod
    def start(cls, host: str, port: int) -> Voucher | None:
        """A voucher for this process writing to the TCPStore at ``host:port``; None where it
        cannot be started (no /proc)."""
        start = liveness.start_of(os.getpid())
        if start is None:
            return None
        # The same gradsync as this process's, wherever that was imported from.
        root = str(Path(__file__).resolve().parents[2])
        # It is handed keys already named through the run's secret: it needs none.
        from gradsync.checks.secret import SECRET_ENV  # imports torch: the rank's, not here

        env = {k: v for k, v in os.environ.items() if k != SECRET_ENV}
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        args = [str(os.getpid()), start, host, str(port)]
        try:
            process = subprocess.Popen(
                [sys.executable, "-m", _MODULE, *args],
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,
                env=env,
            )
        except OSError:
            return None
        return cls(process)

    @property
    def pid(self) -> int:
        return self._process.pid

    @property
    def usable(self) -> bool:
        """Whether it runs, for this process (a forked child of it has a voucher of its own)."""
        return self._owner == os.getpid() and self._process.poll() is None and self.claims > 0

    def send(self, line: str) -> None:
        if self._process.stdin is not None:
            with contextlib.suppress(OSError, ValueError):  # it is gone: nothing to tell it
                self._process.stdin.write(f"{line}\n".encode())
                self._process.stdin.flush()

    def close(self) -> None:
        """Tell the voucher to exit (it sees its pipe close), without waiting."""
        if self._process.stdin is not None:
            with contextlib.suppress(OSError):
                self._process.stdin.close()

    def wait(self, timeout_s: float) -> None:
        """Wait for the voucher to exit; kill it if it has not within ``timeout_s`` (a child
        of this process that forked holds the pipe open)."""
        try:
            self._process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self._process.kill()
            self._process.wait()


class Claim:
    """One watch's key, written by this process's voucher until ``close``."""

    def __init__(self, voucher: Voucher, key: str, beat_s: float) -> None:
        self._voucher = voucher
        self._key = key
        self._beat_s = beat_s
        self._closed = False
        voucher.send(f"+{beat_s!r} {key}")

    @property
    def pid(self) -> int:
        """The voucher's process."""
        return self._voucher.pid

    def rename(self, key: str) -> None:
        """Write at ``key`` instead (the keys were renamed through a secret agreed after the
        claim was made)."""
        with _LOCK:
            if not self._closed:
                self._voucher.send(f"-{self._key}")
                self._key = key
                self._voucher.send(f"+{self._beat_s!r} {key}")

    def close(self) -> None:
        """Stop writing at this claim's key; the voucher exits with its last claim."""
        with _LOCK:
            if self._closed:
                return
            self._closed = True
            self._voucher.send(f"-{self._key}")
            self._voucher.claims -= 1
            if self._voucher.claims == 0:
                self._voucher.close()
                for where, voucher in list(_VOUCHERS.items()):
                    if voucher is self._voucher:
                        del _VOUCHERS[where]

    def stop(self, timeout_s: float = 2.0) -> None:
        """Close, and wait for the voucher to exit if this was its last claim."""
        self.close()
        if self._voucher.claims == 0:
            self._voucher.wait(timeout_s)


def claim(store: Any, key: str, beat_s: float) -> Claim | None:
    """Have this process's voucher for ``store``'s TCPStore (started on the first claim)
    write at ``key`` once every ``beat_s`` or more often; None where no voucher can (no
    TCPStore, no /proc)."""
    tcp = tcp_store(store)
    if tcp is None:
        return None
    where = (str(tcp.host), int(tcp.port))
    with _LOCK:
        voucher = _VOUCHERS.get(where)
        if voucher is None or not voucher.usable:
            voucher = Voucher.start(*where)
            if voucher is None:
                return None
            _VOUCHERS[where] = voucher
        voucher.claims += 1
        return Claim(voucher, key, beat_s)


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


def _read(pending: bytes, keys: dict[str, float]) -> bytes:
    """Apply the whole lines of ``pending`` to ``keys`` (``+BEAT_S KEY``: write at KEY every
    BEAT_S; ``-KEY``: no more); what follows the last whole line."""
    *lines, rest = pending.split(b"\n")
    for line in lines:
        text = line.decode()
        if text.startswith("+"):
            beat_s, _, key = text[1:].partition(" ")
            keys[key] = float(beat_s)
        elif text.startswith("-"):
            keys.pop(text[1:], None)
    return rest


def _vouch(pid: int, start: str, store: Any) -> None:
    """Write rank ``pid``'s state at the keys its pipe (stdin) names, each as often as asked,
    until the pipe closes or the rank is gone."""
    keys: dict[str, float] = {}
    pending, seq = b"", 0
    while True:
        ready, _, _ = select.select([0], [], [], min(keys.values(), default=1.0))
        if ready:
            data = os.read(0, 4096)
            if not data:
                return  # the rank closed the pipe, or died
            pending = _read(pending + data, keys)
        state = liveness.state(pid, start)
        if state is None or state in liveness.GONE or os.getppid() != pid:
            return  # gone, a zombie, or dead and this process handed to another parent
        seq += 1
        for key in keys:
            store.set(key, f"{seq}|{state}")


def main(argv: list[str]) -> int:
    """``python -m gradsync.checks.voucher PID START HOST PORT``, started by
    :meth:`Voucher.start`; the keys to write at come on stdin (see ``_read``)."""
    pid, start, host, port = argv
    # A terminal's Ctrl-C is for the rank to act on; its voucher follows it out when it goes.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Behind training, and before torch's import (about 1.7 s of CPU): on a machine whose
    # cores the ranks fill (the emulated cluster: every host on one machine's cores), each
    # voucher's import at nice 0 took that from the ranks' first steps, in a run of a few
    # seconds up to about half their CPU (issue 46's frontier). At 19 it still gets a small
    # share of a busy core, so its writes keep coming (0.4 ms of CPU each, one a heartbeat
    # interval); until its first, peers judge the rank by its heartbeat, as before.
    with contextlib.suppress(OSError):
        os.nice(NICE)
    import torch.distributed as dist

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
        _vouch(int(pid), start, store)
    return 0


__all__ = ["Claim", "Vouch", "Voucher", "claim", "tcp_store"]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
