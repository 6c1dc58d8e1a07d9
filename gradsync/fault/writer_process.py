"""One rank's background checkpoint writer as a process (``gradsync.fault.writer_child``).

The same contract as ``CheckpointWriter`` (``gradsync.fault.background``: ``submit``, ``wait``,
``flush``, ``close``, errors raised on the training thread), with the writing and, on rank 0,
the committing done by a child process instead of a thread: see ``writer_child``'s docstring
for why. The snapshot buffers come from this writer's ``pool`` and live in shared memory
(``memfd``, Linux), so handing a snapshot over costs a message, not a copy; a buffer goes back
to the pool once the child says its file is written. Small buffers (the step records) travel
in the message itself.

``make_writer`` picks this writer where it works (Linux) unless
``GRADSYNC_CHECKPOINT_WRITER=thread`` asks for the thread. A model on a GPU gets it too, so a
rank killed right after a save still has that save written, as on the CPU (the thread dies
with its rank): its snapshot, copied to host buffers of its own (``pack`` pools only CPU
sources), is copied once more into the pool's shared buffers (``_into_shared``).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import pickle
import socket
import subprocess
import sys
import threading
import weakref
from collections import deque
from typing import Any

import torch

from gradsync.fault import packed_header
from gradsync.fault.background import CheckpointWriter, WriterBase
from gradsync.fault.checkpoint import CheckpointError, CheckpointStore
from gradsync.fault.mailbox import SLOT_BYTES, Mailbox
from gradsync.fault.packing import BufferPool, Packed, raw_bytes
from gradsync.fault.writer_child import SHARES_KEPT, recv_message, send_message

__all__ = ["WRITER_ENV", "ProcessCheckpointWriter", "make_writer", "process_writer_available"]

#: ``thread`` or ``process``: which background writer ``make_writer`` builds
WRITER_ENV = "GRADSYNC_CHECKPOINT_WRITER"
WRITERS = ("process", "thread")
#: buffers smaller than this are sent in the message rather than shared: a tiny tensor whose
#: shape changes from save to save would otherwise take a new shared buffer each time. The RNG
#: states (5 and 10 KB, the same shapes every save) are above it: pooled shared buffers cost
#: no copy into the message
_SHARED_MIN_BYTES = 4 * 1024
#: the child's niceness: it writes in the moments the ranks leave a core idle
NICE = 10
#: with a checkpoint every step, one snapshot in this many is written as a file; the others
#: wait in the mailbox, and the newest is written when the rank dies or flushes. Why 64 and
#: not 16: on a 2-core machine training 2 ranks of charlm, the file writes (both ranks'
#: children, rank 0's commit) slowed the steps by 0.3-0.5 ms each on average at 16 and about
#: 0.1 ms at 64 (the snapshot alone: 0.7 ms). A kill still loses nothing held (the child
#: writes it); what the cadence bounds is a loss of rank and child together (a group SIGKILL)
#: and a machine crash, where the unsynced files since the last durable commit (30 s) may
#: be lost anyway (docs/checkpoints.md, "Durability").
FILES_EVERY = 64
_START_TIMEOUT_S = 30.0


def process_writer_available() -> bool:
    return (
        sys.platform.startswith("linux")
        and hasattr(os, "memfd_create")
        and hasattr(socket, "send_fds")
        and hasattr(socket, "SOCK_SEQPACKET")
    )


def make_writer(
    store: CheckpointStore,
    *,
    rank: int,
    world_size: int,
    save_id: str,
    timeout_s: float,
    hold: bool = False,
) -> CheckpointWriter | ProcessCheckpointWriter:
    """This rank's background writer: a process where it works, else a thread. ``hold``
    (for lockstep strategies only, see ``Strategy.lockstep``): the process writes every
    ``FILES_EVERY``-th snapshot and holds the others, writing the newest when its rank dies
    or flushes."""
    choice = os.environ.get(WRITER_ENV, "").strip().lower() or "process"
    if choice not in WRITERS:
        raise CheckpointError(
            f"{WRITER_ENV}={choice!r} is not a checkpoint writer; "
            f"choose one of {', '.join(WRITERS)}"
        )
    kwargs: dict[str, Any] = dict(
        rank=rank, world_size=world_size, save_id=save_id, timeout_s=timeout_s
    )
    if choice == "process" and process_writer_available():
        return ProcessCheckpointWriter(store, files_every=FILES_EVERY if hold else 1, **kwargs)
    return CheckpointWriter(store, **kwargs)


class _SharedBuffers:
    """Shared-memory tensors for the pool, each announced to the child once."""

    def __init__(self, send: Any) -> None:
        self._send = send
        #: data pointer -> (id, bytes)
        self.by_address: dict[int, tuple[int, int]] = {}
        #: every map, kept alive as long as the writer even when the pool drops its tensor: an
        #: address in ``by_address`` is then never reused by a later, unshared buffer, which
        #: ``part`` would take for the shared one
        self._maps: list[mmap.mmap] = []

    def allocate(self, dtype: torch.dtype, numel: int) -> torch.Tensor:
        nbytes = numel * dtype.itemsize
        if nbytes < _SHARED_MIN_BYTES:
            return torch.empty(numel, dtype=dtype)
        fd = os.memfd_create("gradsync-checkpoint", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, nbytes)
            area = mmap.mmap(fd, nbytes)
            ident = len(self._maps)
            self._send(("buffer", ident, nbytes), [fd])
        finally:
            os.close(fd)
        self._maps.append(area)
        tensor = torch.frombuffer(area, dtype=dtype, count=numel)
        self.by_address[tensor.data_ptr()] = (ident, nbytes)
        return tensor

    def part(self, buf: torch.Tensor) -> Any:
        """How the child finds ``buf``'s bytes: a shared buffer's id, or the bytes."""
        nbytes = buf.numel() * buf.element_size()
        shared = self.by_address.get(buf.data_ptr())
        if shared is not None and shared[1] == nbytes:
            return shared
        return bytes(raw_bytes(buf))


def _stop_child(child: subprocess.Popen[bytes], sock: socket.socket) -> None:
    """Close the socket: the child then writes the snapshots it holds and ends by itself (it
    is not killed: a rank leaving by an exception, or without ``close``, still gets them
    written; a restarted attempt waits for it through its lock). Reaped if already done."""
    try:
        sock.close()
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            child.wait(timeout=0.05)


class ProcessCheckpointWriter(WriterBase):
    """One rank's background writer for one checkpoint directory, in a child process (see
    the module docstring; the arguments are ``WriterBase``'s, the child's niceness, and
    whether it runs under ``SCHED_IDLE``: only on a core that nothing else wants)."""

    def __init__(
        self,
        store: CheckpointStore,
        *,
        nice: int = NICE,
        idle: bool = True,
        files_every: int = 1,
        **kwargs: Any,
    ) -> None:
        super().__init__(store, **kwargs)
        if files_every < 1:
            raise ValueError(f"files_every must be >= 1, got {files_every}")
        self.files_every = files_every
        self._send_lock = threading.Lock()
        #: submitted, not written yet (``None``: a held snapshot the child was told to write)
        self._in_flight: deque[tuple[int, Packed | None]] = deque()
        #: the newest snapshots left in the mailbox, not written: their buffers stay taken
        self._held: deque[tuple[int, Packed]] = deque()
        self._held_seq = 0
        #: encodings of the replicated share whose text the child has, by its number for them
        self._shares: dict[int, Any] = {}
        self._pinned = False  # a flush failed: held buffers stay taken (``_pin_on_error``)
        self._last_file: int | None = None  # newest step sent to be written as a file
        self._last = -1  # newest step submitted
        self._abandoned = -1  # newest step given up after an error (rank 0 commits no more)
        self._sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        try:
            self._child = subprocess.Popen(
                [sys.executable, "-m", "gradsync.fault.writer_child", str(theirs.fileno())],
                pass_fds=(theirs.fileno(),),
                stdin=subprocess.DEVNULL,
                close_fds=True,
            )
        finally:
            theirs.close()
        self._finalizer = weakref.finalize(self, _stop_child, self._child, self._sock)
        init = {
            "directory": str(store.directory),
            "keep": store.keep,
            "rank": self.rank,
            "world_size": self.world_size,
            "save_id": self.save_id,
            "timeout_s": self.timeout_s,
            "durable_every_s": self.durable_every_s,
            "nice": nice,
            "idle": idle,
        }
        self._send(("init", init))
        self._await_ready()
        self._shared = _SharedBuffers(self._send)
        self._mailbox = self._share_mailbox()
        #: buffers for this rank's snapshots: one per job in flight, two held, one being
        #: filled, one spare
        self.pool = BufferPool(self.depth + 4, allocate=self._shared.allocate)
        self._receiver = threading.Thread(
            target=self._receive, name=f"gradsync-checkpoint-writer-{self.rank}", daemon=True
        )
        self._receiver.start()

    def _await_ready(self) -> None:
        """Until the child has started: a save is written as soon as it is taken, from the
        first one on (a rank killed a few steps after its first checkpoint still resumes from
        it). Once per writer, tens of milliseconds."""
        self._sock.settimeout(_START_TIMEOUT_S)
        try:
            got = recv_message(self._sock)
        except OSError:
            got = None
        finally:
            self._sock.settimeout(None)
        if got is not None and got[0][0] == "error":
            self._finalizer()
            raise CheckpointError(f"rank {self.rank}: {got[0][1]}")
        if got is None or got[0] != ("ready",):
            self._finalizer()
            raise CheckpointError(
                f"rank {self.rank}: the checkpoint writer process did not start in "
                f"{_START_TIMEOUT_S:g} s; {self._exit_note()}"
            )

    def _share_mailbox(self, slot_bytes: int | None = None) -> Mailbox:
        slot_bytes = slot_bytes or SLOT_BYTES
        fd = os.memfd_create("gradsync-checkpoint-mailbox", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 2 * slot_bytes)
            area = mmap.mmap(fd, 2 * slot_bytes)
            self._send(("mailbox", slot_bytes), [fd])
        finally:
            os.close(fd)
        return Mailbox(area, slot_bytes)

    def _send(self, message: Any, fds: list[int] | None = None) -> None:
        try:
            with self._send_lock:
                send_message(self._sock, message, fds or ())
        except OSError as e:
            raise CheckpointError(
                f"rank {self.rank}: the checkpoint writer process is gone ({e}); "
                f"{self._exit_note()}"
            ) from None

    def _exit_note(self) -> str:
        # the socket breaks as the child dies: its exit status follows at once
        with contextlib.suppress(subprocess.TimeoutExpired):
            self._child.wait(timeout=2.0)
        code = self._child.poll()
        return "it is still running" if code is None else f"it exited with code {code}"

    # -- the training thread ------------------------------------------------------------------
    def submit(self, step: int, packed: Packed, *, durable: bool = False) -> None:
        """Hand ``packed`` to the child as this rank's file of ``step``; blocks while
        ``depth`` are in flight (see ``CheckpointWriter.submit``)."""
        with self._cond:
            self._raise_error()
            while len(self._in_flight) >= self.depth and self._error is None:
                self._cond.wait()
            self._raise_error()
            if self._closing:
                raise CheckpointError("the checkpoint writer is closed")
            self._last = max(self._last, step)
        packed = self._into_shared(packed)
        # The header is made by the child, and only for a snapshot it writes: most are held
        # and never written (``packed_header``). The tree travels pickled, the model's and
        # optimizer's part of it once per layout (``_share_ident``).
        tree, kept, sizes = packed.header_parts()
        offsets = packed_header.offsets(sizes)
        parts = [
            (offset, self._shared.part(buf))
            for offset, buf in zip(offsets, packed.buffers, strict=True)
        ]
        refs = [(index, self._share_ident(share)) for index, share in kept]
        message = ("write", step, durable, self.store.keep, (tree, refs, sizes), parts)
        if not self._to_file(step, durable):
            self._hold(step, packed, message)
            return
        with self._cond:
            self._in_flight.append((step, packed))
            self._last_file = step
        self._send(message)

    def _into_shared(self, packed: Packed) -> Packed:
        """``packed`` with each buffer that is not from this writer's pool copied into one
        that is (a GPU model's snapshot: ``pack`` pools only CPU sources, so its buffers are
        host copies of its own), handed back to the pool as a pooled snapshot's are. One copy
        on the training thread, where the message would carry the bytes, pickled and then
        written to the socket's blob (three copies: about 1.1 ms a MB on this machine)."""
        if packed.release is not None:  # pooled: its buffers are shared already
            return packed
        taken: list[tuple[Any, tuple[torch.Tensor, list[torch.Tensor]]]] = []
        buffers = []
        for buf in packed.buffers:
            if buf.numel() * buf.element_size() < _SHARED_MIN_BYTES:
                buffers.append(buf)  # small: it travels in the message, as a pooled one's
                continue
            key = self.pool.key(buf.dtype, (buf.shape,))
            entry = self.pool.take(key)
            if entry is None:
                shared = self.pool.new_buffer(buf.dtype, buf.numel())
                entry = (shared, [shared])
            entry[0].copy_(buf)
            taken.append((key, entry))
            buffers.append(entry[0])
        if not taken:
            return packed

        def release() -> None:
            for key, entry in taken:
                self.pool.give(key, entry)

        return Packed(tree=packed.tree, buffers=buffers, release=release, shares=packed.shares)

    def _share_ident(self, share: Any) -> int:
        """The child's number for a kept encoding of the replicated share (``Packed.shares``),
        its JSON text sent first if the child has not had it."""
        for ident, known in self._shares.items():
            if known is share:
                return ident
        if share.json is None:
            share.json = packed_header.dumps(share.encoded)
        ident = max(self._shares, default=-1) + 1
        self._send(("share", ident, share.json))
        self._shares[ident] = share
        while len(self._shares) > SHARES_KEPT:  # the child keeps more (``writer_child``)
            del self._shares[min(self._shares)]
        return ident

    def _to_file(self, step: int, durable: bool) -> bool:
        """Whether ``step``'s snapshot is written now rather than held: decided from the steps
        alone, so that every rank (saving after the same steps) writes the same ones."""
        last = self._last_file
        return durable or last is None or step - last >= self.files_every or step < last

    def _hold(self, step: int, packed: Packed, message: tuple[Any, ...]) -> None:
        """Leave the snapshot in the mailbox, unwritten. The one before it stays held too: a
        rank killed while leaving this one leaves that one whole."""
        data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
        if len(data) > self._mailbox.capacity:
            self._grow_mailbox(len(data))
        self._held_seq += 1
        self._mailbox.put(self._held_seq, data)
        with self._cond:
            self._held.append((step, packed))
            while len(self._held) > 2:
                _, old = self._held.popleft()
                if old.release is not None and not self._pinned:
                    old.release()

    def _grow_mailbox(self, needed: int) -> None:
        """A mailbox whose slots take ``needed`` bytes, holding the messages of the old one
        (a message too large to hold must not become a file on this rank alone: every rank
        writes the same steps). The child takes it before any later message."""
        old = self._mailbox
        slot = old.slot_bytes
        while slot - 64 < needed:
            slot *= 2
        self._mailbox = self._share_mailbox(slot)
        for seq, data in old.entries():
            self._mailbox.put(seq, data)

    def flush(self, timeout_s: float | None = None) -> None:
        """Write the newest held snapshot (the child reads it from the mailbox), then wait as
        ``WriterBase.flush`` does."""
        if self._held:
            self._write_held(self._held[-1][0])
        self._pin_on_error(super().flush, timeout_s)

    def write_newest(self) -> None:
        """Tell the child to write the newest held snapshot, without waiting."""
        if self._held:
            self._write_held(self._held[-1][0])

    def wait(self, step: int, timeout_s: float | None = None) -> None:
        """``WriterBase.wait``, writing ``step``'s snapshot first if it is held."""
        self._write_held(step)
        self._pin_on_error(super().wait, step, timeout_s)

    def _pin_on_error(self, call: Any, *args: Any) -> None:
        """``call``; if it fails (a timeout), the child may still be reading a held snapshot:
        held buffers are never given back to the pool from then on (a leak, not a file that
        mixes two steps' bytes)."""
        try:
            call(*args)
        except CheckpointError:
            self._pinned = True
            raise

    def _write_held(self, step: int) -> None:
        """Tell the child to write the held snapshot of ``step`` (if held and not yet sent)."""
        with self._cond:
            held = any(s == step for s, _ in self._held)
            sent = any(s == step for s, _ in self._in_flight) or step <= self._written
            if not held or sent or self._closing:
                return
            # ``_last_file`` stays: which steps become files depends on the steps alone, the
            # same on every rank, whoever flushes
            self._in_flight.append((step, None))
        self._send(("flush", step))

    def _settled(self) -> bool:
        done = max(self._committed, self._abandoned)
        return not self._in_flight and (not self.commits or done >= self._last)

    def close(self, timeout_s: float | None = None) -> None:
        """Write what is in flight, then stop the child; raises what went wrong in it."""
        try:
            self.flush(timeout_s)
        finally:
            with self._cond:
                self._closing = True
            with contextlib.suppress(CheckpointError):
                self._send(("close",))
            try:
                self._child.wait(timeout=5.0)  # it exits once its commits are done
            except subprocess.TimeoutExpired:  # everything was flushed: nothing to lose
                self._child.kill()
                self._child.wait()
            self._finalizer()  # closes the socket
            self._receiver.join(timeout=5.0)

    # -- the receiver thread ------------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            try:
                got = recv_message(self._sock)
            except OSError:
                got = None
            note = self._exit_note() if got is None and not self._closing else ""
            with self._cond:
                if got is None:
                    self._in_flight.clear()  # never written now: nothing left to wait for
                    self._abandoned = self._last
                    if not self._closing and self._error is None:
                        self._error = CheckpointError(
                            f"rank {self.rank}: the checkpoint writer process stopped before "
                            f"its work was done; {note}"
                        )
                    self._cond.notify_all()
                    return
                (kind, *rest), _fds = got
                if kind == "written":
                    self._on_written(rest[0])
                elif kind == "committed":
                    self._committed = max(self._committed, rest[0])
                elif kind == "error":
                    self._error = CheckpointError(rest[0])
                    self._in_flight.clear()
                    self._abandoned = self._last
                self._cond.notify_all()

    def _on_written(self, step: int) -> None:
        self._written = max(self._written, step)
        waiting: deque[tuple[int, Packed | None]] = deque()
        for entry in self._in_flight:  # in step order but for a held one written out of turn
            done, packed = entry[0] <= step, entry[1]
            if not done:
                waiting.append(entry)
            elif packed is not None and packed.release is not None:  # written: reusable
                packed.release()
        self._in_flight = waiting
