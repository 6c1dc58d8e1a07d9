"""The background checkpoint writer's process: it writes one rank's files, and on rank 0
commits each step, while that rank trains.

Why a process rather than a thread of the training process: a thread's Python work (file
operations, the header, the commit and pruning) takes the GIL from the training thread (14-21%
of step time with a checkpoint every step on 2 cores); a process takes none, and runs at the
lowest priority, in the moments a rank waits for its peers (docs/checkpoints.md, "The writer
process"). It never imports torch (``checkpoint.files`` and ``checkpoint.commits`` are
torch-free), and reads the snapshot's bytes from the training process's buffers, shared memory
(``memfd``) whose descriptors come over the socket; the training process reuses a buffer only
after this process says the file holding it is written.

Messages (pickled tuples, one per ``SOCK_SEQPACKET`` packet; larger ones travel in a memfd):
the training process sends ``("buffer", id, nbytes)`` and ``("mailbox", slot_bytes)`` with a
descriptor, ``("share", id, text)`` (the JSON text of the model's and optimizer's part of the
tree, sent once per layout), ``("write", step, durable, keep, (tree, refs, sizes), parts)``
(this process makes the file's header from the tree, the texts ``refs`` name and the buffers'
sizes: ``gradsync.checkpoint.packed_header``), ``("flush", step)`` (write the held snapshot of
``step``, see ``gradsync.checkpoint.held_slots``), ``("commit", step)`` (rank 0: commit ``step``,
whose file is written, once every rank's is), ``("close",)``; this process
answers ``("ready",)`` once it has started, ``("written", step)``, ``("committed", step)`` and
``("error", message)``, and exits after ``close`` once its commits are done.

When the training process dies, its socket closes: this process writes what it was handed and
the snapshots held in the mailbox, rank 0's commits the newest step every rank wrote once the
peers' writers have ended, and it exits. It holds a lock for its life
(``gradsync.checkpoint.writer_locks``) so that a restarted attempt reads the directory only after.

When such a process dies, another one is sent the snapshots it had not written, as ``write``
messages carrying their bytes (``writer_process._take_over``), and ends as when a rank dies.
"""

from __future__ import annotations

import array
import contextlib
import mmap
import os
import pickle
import select
import signal
import socket
import sys
import time
from collections.abc import Sequence
from typing import Any

from gradsync.checkpoint import packed_header
from gradsync.checkpoint.commits import Commits
from gradsync.checkpoint.files import CheckpointFiles, write_chunks, write_failure
from gradsync.checkpoint.held_slots import HeldSlots
from gradsync.checkpoint.writer_locks import hold, release, released

__all__ = ["SHARES_KEPT", "recv_message", "send_message"]

#: the training process refers to at most this many share texts (the newest); this process
#: keeps twice as many, so a held snapshot never names one it dropped
SHARES_KEPT = 8

#: messages above this travel in a memfd: a packet may not exceed the socket's buffer
_INLINE_MAX = 64 * 1024
_BLOB = b"B"
_PICKLE = b"P"


def send_message(
    sock: socket.socket, message: Any, fds: Sequence[int] = (), timeout_s: float | None = None
) -> None:
    """One message (and file descriptors) as one packet. ``timeout_s``: how long to wait for
    room in the socket at most (``TimeoutError``); ``None``: as long as it takes."""
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    if len(data) <= _INLINE_MAX:
        _send_packet(sock, _PICKLE + data, list(fds), timeout_s)
        return
    blob = os.memfd_create("gradsync-message", os.MFD_CLOEXEC)
    try:
        os.write(blob, data)
        _send_packet(sock, _BLOB + len(data).to_bytes(8, "little"), [blob, *fds], timeout_s)
    finally:
        os.close(blob)


def _send_packet(
    sock: socket.socket, packet: bytes, fds: list[int], timeout_s: float | None
) -> None:
    """Why a deadline: a peer that reads nothing (a stopped process) fills the socket, and a
    plain send then waits for ever. A packet is sent whole or not at all. (``socket.send_fds``
    is not used: before Python 3.12 it drops its ``flags``, so it blocks whatever they say.)"""
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    if timeout_s is None:
        sock.sendmsg([packet], ancillary)
        return
    deadline = None
    while True:
        try:
            sock.sendmsg([packet], ancillary, socket.MSG_DONTWAIT)
            return
        except BlockingIOError:
            if deadline is None:
                deadline = time.monotonic() + timeout_s
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([], [sock], [], left)[1]:
                raise TimeoutError(f"no room to send in {timeout_s:g} s") from None


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


class _Child:
    def __init__(self, sock: socket.socket, init: dict[str, Any]) -> None:
        self.sock = sock
        self.rank: int = init["rank"]
        self.files = CheckpointFiles(init["directory"], keep=init["keep"])
        self.world_size, self.save_id = init["world_size"], init["save_id"]
        self.timeout_s: float = init["timeout_s"]
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
        self.shares: dict[int, str] = {}  # JSON texts by number (``("share", ...)``)
        self.mailbox: HeldSlots | None = None
        self.last_written = -1
        self.orphaned = False  # the training process is gone: no more reports
        self.parent = os.getppid()

    def run(self) -> None:
        try:
            self._serve()
        except (BrokenPipeError, ConnectionResetError):  # the training process is gone
            self._flush_on_exit()

    def _reply(self, message: tuple[Any, ...]) -> None:
        """Report to the training process; once it is gone, say nothing more but go on with
        the snapshots it handed over before it died (they are still in the socket)."""
        if self.orphaned:
            return
        try:
            send_message(self.sock, message)
        except (BrokenPipeError, ConnectionResetError):
            self.orphaned = True

    def _serve(self) -> None:
        closing = False
        while True:
            wait = self.commits.poll_s if self.commits is not None else None
            if not closing or wait is None:
                # At most a second between looks at the parent: a process forked from it
                # (a data loader's workers) may hold its end of the socket open after it died.
                ready, _, _ = select.select([self.sock], [], [], min(wait or 1.0, 1.0))
                if ready:
                    try:
                        got = recv_message(self.sock)
                    except ConnectionResetError:
                        # The parent died with replies unread; what it sent before is still
                        # queued behind this error: read on until the end of the stream.
                        self.orphaned = True
                        continue
                    if got is None:  # the training process is gone: write what it left
                        self._flush_on_exit()
                        return
                    closing = self._handle(*got) or closing
                elif os.getppid() != self.parent:
                    self.orphaned = True
                    self._flush_on_exit()
                    return
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
        elif kind == "mailbox":
            try:
                self.mailbox = HeldSlots(mmap.mmap(fds[0], 2 * message[1]), message[1])
            finally:
                os.close(fds[0])
        elif kind == "share":
            _, ident, text = message
            self.shares[ident] = text
            while len(self.shares) > 2 * SHARES_KEPT:
                del self.shares[min(self.shares)]
        elif kind == "write":
            self._write(*message[1:])
        elif kind == "flush":
            self._flush(message[1])
        elif kind == "commit" and self.commits is not None:
            # from a writer taking over from a dead one: this rank's file of the step is
            # written, its commit not done
            self.commits.add(message[1], False)
            self.last_written = max(self.last_written, message[1])
        elif kind == "close":
            return True
        return False

    def _held(self) -> list[tuple[Any, ...]]:
        """The ``write`` messages waiting in the mailbox, oldest first."""
        if self.mailbox is None:
            return []
        return [pickle.loads(raw) for _seq, raw in self.mailbox.entries()]

    def _flush(self, step: int) -> None:
        """Write the held snapshot of ``step`` (the training process flushes)."""
        for message in self._held():
            if message[1] == step:
                if step > self.last_written:
                    self._write(*message[1:])
                else:
                    self._reply(("written", step))
                return
        self._error(RuntimeError(f"no snapshot of step {step} in the mailbox to flush"))

    def _flush_on_exit(self) -> None:
        """The training process died: write the snapshots it left in the mailbox (both: its
        peers may have left the one before as their newest), then, on rank 0, commit the
        newest step whose every file is there once the peers' writers are done."""
        for message in self._held():
            if message[1] <= self.last_written:
                continue
            # nobody to report to: a failure leaves the other one to try
            with contextlib.suppress(Exception):
                self._write_file(*message[1:])
        if self.commits is not None:
            self._last_commit()

    def _last_commit(self) -> None:
        """Commit the newest step every rank wrote, up to this rank's newest file
        (``CheckpointFiles.commit_newest``: read from the directory, not from
        ``self.commits``, which an error clears), once the peers' writers have ended (their
        locks), or at ``timeout_s``: a peer may still be writing a newer step's file than it
        has written so far."""
        deadline = time.monotonic() + self.timeout_s
        peers = range(1, self.world_size)
        while time.monotonic() < deadline and not all(
            released(self.files.directory, self.save_id, r) for r in peers
        ):
            time.sleep(0.005)
        with contextlib.suppress(Exception):  # nobody to report to
            self.files.commit_newest(
                self.world_size, newest=self.last_written, save_id=self.save_id
            )

    def _write_file(
        self, step: int, durable: bool, keep: int, made: tuple[Any, ...], parts: list[Any]
    ) -> None:
        self.files.keep = keep
        tree, refs, sizes = made
        texts = {index: self.shares[ident] for index, ident in refs}
        start, _ = packed_header.file_start(tree, texts, sizes)
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
        finally:
            for raw in raws:
                if isinstance(raw, memoryview):
                    raw.release()
        self.last_written = max(self.last_written, step)

    def _write(
        self, step: int, durable: bool, keep: int, made: tuple[Any, ...], parts: list[Any]
    ) -> None:
        try:
            self._write_file(step, durable, keep, made, parts)
        except Exception as exc:  # noqa: BLE001 - reported to the training process
            self._error(exc)
            return
        self._reply(("written", step))
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
            self._reply(("committed", done[-1]))
        if error is not None:
            self._error(error)

    def _error(self, exc: BaseException) -> None:
        if self.commits is not None:
            self.commits.clear()
        self._reply(("error", str(write_failure(self.rank, self.files.directory, exc))))


def _lower_priority(nice: int, *, idle: bool) -> None:
    """Run behind training: ``SCHED_IDLE`` (Linux) where asked and allowed, which runs this
    process only on a core nothing else wants, else ``nice``. Why not a nice value alone: a
    niced process still takes a core from a rank it wakes beside for the rest of a time slice
    (docs/checkpoints.md, "The writer process")."""
    if nice:
        with contextlib.suppress(OSError):
            os.nice(nice)
    if idle and hasattr(os, "SCHED_IDLE"):
        with contextlib.suppress(OSError):
            os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))


def main(argv: list[str]) -> int:
    fd = int(argv[0])
    # Ctrl-C is the training process's to handle, and the SIGTERM torchrun's agent sends to
    # the rank's process group when another rank fails: this process then writes what its
    # rank left (``_flush_on_exit``) and ends by itself.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    sock = socket.socket(fileno=fd)
    got = recv_message(sock)
    if got is None:
        return 0
    (_, init), _fds = got
    _lower_priority(init["nice"], idle=init.get("idle", False))
    lock = None
    try:
        # Held until this process ends: a restarted attempt reads the directory after that.
        # Less long than the training process waits for this one to start.
        lock = hold(init["directory"], init["save_id"], init["rank"], min(init["timeout_s"], 20))
    except TimeoutError as exc:
        send_message(sock, ("error", f"the checkpoint writer could not take its lock: {exc}"))
        return 1
    except OSError:
        pass  # no directory to write in (the first write reports why), or no flock there
    send_message(sock, ("ready",))
    # A broken pipe: the training process is gone, there is nothing to report to.
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        _Child(sock, init).run()
    if lock is not None:  # done: nothing for a later attempt to wait for
        release(init["directory"], init["save_id"], init["rank"], lock)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
