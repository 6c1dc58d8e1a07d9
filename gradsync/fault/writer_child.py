"""The background checkpoint writer's process: it writes one rank's files, and on rank 0
commits each step, while that rank trains.

Why a process rather than a thread of the training process: a thread shares the GIL, and its
Python work (file operations, the header, the commit and pruning) took the GIL from the
training thread at every release; on a 2-core machine training 2 ranks, a checkpoint every
step cost 14-21% of step time that way, of which about 1 ms per step was the snapshot and the
rest the writer (measured with the writer discarding its snapshots). A process takes no GIL
from training, and runs at the lowest priority (``SCHED_IDLE`` where Linux allows it, else
``nice``), in the moments a rank waits for its peers (docs/checkpoints.md, "The writer
process").

The process never imports torch (``gradsync.fault.files`` and ``gradsync.fault.commits`` are
torch-free): it starts in tens of milliseconds and holds about 12 MB instead of 280. It reads
the snapshot's bytes from the training process's buffers, shared memory (``memfd``) whose file
descriptors come over the socket; the training process reuses a buffer only after this process
says the file holding it is written.

Messages (pickled tuples, one per ``SOCK_SEQPACKET`` packet; larger ones travel in a memfd):
the training process sends ``("buffer", id, nbytes)`` with a descriptor, ``("write", step,
durable, keep, start, parts)``, ``("close",)``; this process answers ``("ready",)`` once it has
started, ``("written", step)``, ``("committed", step)`` and ``("error", message)``, and exits
after ``close`` once its commits are done. When the training process dies
its socket closes: this process then writes nothing more and exits (and, started from the main
thread, is killed with it by ``PR_SET_PDEATHSIG``), so a restarted run never races a writer of
the attempt before it.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import select
import signal
import socket
import sys
from collections.abc import Sequence
from typing import Any

from gradsync.fault.commits import Commits
from gradsync.fault.files import CheckpointFiles, write_chunks, write_failure

__all__ = ["recv_message", "send_message"]

#: messages above this travel in a memfd: a packet may not exceed the socket's buffer
_INLINE_MAX = 64 * 1024
_BLOB = b"B"
_PICKLE = b"P"


def send_message(sock: socket.socket, message: Any, fds: Sequence[int] = ()) -> None:
    """One message (and file descriptors) as one packet."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) <= _INLINE_MAX:
        socket.send_fds(sock, [_PICKLE + data], list(fds))
        return
    blob = os.memfd_create("gradsync-message", os.MFD_CLOEXEC)
    try:
        os.write(blob, data)
        socket.send_fds(sock, [_BLOB + len(data).to_bytes(8, "little")], [blob, *fds])
    finally:
        os.close(blob)


def recv_message(sock: socket.socket) -> tuple[Any, list[int]] | None:
    """The next message and its file descriptors; ``None`` once the peer has closed."""
    data, fds, _flags, _addr = socket.recv_fds(sock, _INLINE_MAX + 1, 16)
    if not data:
        for fd in fds:
            os.close(fd)
        return None
    if data[:1] == _BLOB:
        blob, fds = fds[0], fds[1:]
        try:
            data = _PICKLE + os.pread(blob, int.from_bytes(data[1:9], "little"), 0)
        finally:
            os.close(blob)
    return pickle.loads(data[1:]), fds


def _die_with_parent(parent: int) -> None:
    """Be killed when the training process dies (Linux), even in the middle of a write."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:  # it died before the prctl took effect
        os._exit(0)


class _Child:
    def __init__(self, sock: socket.socket, init: dict[str, Any]) -> None:
        self.sock = sock
        self.rank: int = init["rank"]
        self.files = CheckpointFiles(init["directory"], keep=init["keep"], recycle=init["recycle"])
        self.world_size, self.save_id = init["world_size"], init["save_id"]
        self.commits = (
            Commits(
                self.files,
                world_size=self.world_size,
                save_id=self.save_id,
                timeout_s=init["timeout_s"],
                durable_every_s=init["durable_every_s"],
            )
            if self.rank == 0
            else None
        )
        self.buffers: dict[int, mmap.mmap] = {}

    def run(self) -> None:
        closing = False
        while True:
            wait = self.commits.poll_s if self.commits is not None else None
            if not closing or wait is None:
                ready, _, _ = select.select([self.sock], [], [], wait)
                if ready:
                    got = recv_message(self.sock)
                    if got is None:  # the training process is gone: write nothing more
                        return
                    closing = self._handle(*got) or closing
            else:
                select.select([], [], [], wait)
            if self.commits is not None and len(self.commits):
                self._commit()
            if closing and (self.commits is None or not len(self.commits)):
                return

    def _handle(self, message: tuple[Any, ...], fds: list[int]) -> bool:
        kind = message[0]
        if kind == "buffer":
            _, ident, nbytes = message
            try:
                self.buffers[ident] = mmap.mmap(fds[0], nbytes)
            finally:
                os.close(fds[0])
        elif kind == "write":
            self._write(*message[1:])
        elif kind == "close":
            return True
        return False

    def _write(self, step: int, durable: bool, keep: int, start: bytes, parts: list[Any]) -> None:
        self.files.keep = keep
        offsets = [offset for offset, _ in parts]
        raws = [
            memoryview(self.buffers[ref[0]])[: ref[1]] if isinstance(ref, tuple) else ref
            for _, ref in parts
        ]
        try:
            self.files.write_file(
                step,
                self.rank,
                self.world_size,
                lambda f: write_chunks(f, start, raws, offsets),
                save_id=self.save_id,
                durable=durable,
            )
        except Exception as exc:  # noqa: BLE001 - reported to the training process
            self._error(exc)
            return
        finally:
            for raw in raws:
                if isinstance(raw, memoryview):
                    raw.release()
        send_message(self.sock, ("written", step))
        if self.commits is not None:
            self.commits.add(step, durable)

    def _commit(self) -> None:
        assert self.commits is not None
        error: BaseException | None
        try:
            done, error = self.commits.commit_ready()
        except Exception as exc:  # noqa: BLE001 - reported to the training process
            done, error = [], exc
        if done:
            send_message(self.sock, ("committed", done[-1]))
        if error is not None:
            self._error(error)

    def _error(self, exc: BaseException) -> None:
        if self.commits is not None:
            self.commits.clear()
        send_message(self.sock, ("error", str(write_failure(self.rank, self.files.directory, exc))))


def _lower_priority(nice: int, *, idle: bool) -> None:
    """Run behind training: ``SCHED_IDLE`` (Linux) where asked and allowed, which runs this
    process only on a core nothing else wants, else ``nice``.

    Why SCHED_IDLE rather than a nice value alone: a niced process still takes a core from a
    rank it wakes beside, for the rest of the scheduler's slice, and with every core running a
    rank and a checkpoint every step that came back as step time. Measured on this project's
    2-core machine (docs/checkpoints.md, "The writer process"): about 1 ms of a 17 ms step.
    Training never waits on this process except when ``depth`` snapshots are in flight, and
    a rank waiting then leaves its core idle for this process."""
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    if idle and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def main(argv: list[str]) -> int:
    fd, parent, die_with_parent = int(argv[0]), int(argv[1]), argv[2] == "1"
    if die_with_parent:
        _die_with_parent(parent)
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the training process's to handle
    sock = socket.socket(fileno=fd)
    got = recv_message(sock)
    if got is None:
        return 0
    (_, init), _fds = got
    _lower_priority(init["nice"], idle=init.get("idle", False))
    send_message(sock, ("ready",))
    # A broken pipe: the training process is gone, there is nothing to report to.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        _Child(sock, init).run()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
