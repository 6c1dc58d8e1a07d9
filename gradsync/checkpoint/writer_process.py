"""One rank's background checkpoint writer as a process (``gradsync.checkpoint.writer_child``,
whose docstring says why a process).

The same contract as ``InlineCheckpointWriter`` (``submit``, ``wait``, ``flush``, ``close``,
errors raised on the training thread). The snapshot buffers come from this writer's ``pool``
and live in shared memory (``memfd``, Linux), so handing a snapshot over costs a message, not a
copy; a buffer goes back to the pool once the child says its file is written. ``make_writer``
picks this writer on Linux unless ``GRADSYNC_CHECKPOINT_WRITER=inline``, for a GPU's model too.

A child that dies is an error of the rank's next call, naming its pid and how it ended; first
another child writes the snapshots the dead one had not written (``_take_over``). Every wait on
the child is bounded by ``timeout_s``, and a stopped child is continued as the writer lets it
go (``_stop_child``), so that it writes what it holds and ends (docs/checkpoints.md).
"""

from __future__ import annotations

import contextlib
import mmap
import multiprocessing.util
import os
import pickle
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import deque
from typing import Any

import torch

from gradsync import procfs, runtime
from gradsync.checkpoint import packed_header
from gradsync.checkpoint.commits import POLL_S
from gradsync.checkpoint.held_slots import SLOT_BYTES, HeldSlots
from gradsync.checkpoint.packing import BufferPool, Packed, raw_bytes
from gradsync.checkpoint.store import CheckpointError, CheckpointStore
from gradsync.checkpoint.writer_child import SHARES_KEPT, recv_message, send_message
from gradsync.checkpoint.writer_inline import InlineCheckpointWriter, WriterBase
from gradsync.logs import get_logger

__all__ = ["WRITER_ENV", "ProcessCheckpointWriter", "make_writer", "process_writer_available"]

#: ``process`` or ``inline``: which writer ``make_writer`` builds (``thread``, the writer
#: before ``inline``, is taken as ``inline``)
WRITER_ENV = "GRADSYNC_CHECKPOINT_WRITER"
WRITERS = ("process", "inline")
#: buffers smaller than this are sent in the message rather than shared: a tiny tensor whose
#: shape changes from save to save would otherwise take a new shared buffer each time. The RNG
#: states (5 and 10 KB, the same shapes every save) are above it: pooled shared buffers cost
#: no copy into the message
_SHARED_MIN_BYTES = 4 * 1024
#: the child's niceness: it writes in the moments the ranks leave a core idle
NICE = 10
#: with a checkpoint every step, one snapshot in this many is written as a file; the others
#: wait in the mailbox, and the newest is written when the rank dies or flushes (why 64:
#: docs/checkpoints.md, "Held snapshots")
FILES_EVERY = 64
_START_TIMEOUT_S = 30.0

logger = get_logger("checkpoint")


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
) -> InlineCheckpointWriter | ProcessCheckpointWriter:
    """This rank's writer: a background process where it works, else inline. ``hold``
    (for lockstep strategies only, see ``Strategy.lockstep``): the process writes every
    ``FILES_EVERY``-th snapshot and holds the others, writing the newest when its rank dies
    or flushes."""
    choice = os.environ.get(WRITER_ENV, "").strip().lower() or "process"
    choice = "inline" if choice == "thread" else choice
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
    return InlineCheckpointWriter(store, **kwargs)


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

    def copied(self, part: Any) -> Any:
        """``part`` (see ``part``) as bytes: for a child that has not got the shared buffers."""
        if isinstance(part, tuple):
            ident, nbytes = part
            return self._maps[ident][:nbytes]
        return part


def _spawn(init: dict[str, Any], timeout_s: float) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """A writer child process given ``init``, and this end of its socket, once it has started:
    a save is written as soon as it is taken, from the first one on (a rank killed a few steps
    after its first checkpoint still resumes from it). Tens of milliseconds."""
    sock, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        child = subprocess.Popen(
            [sys.executable, "-m", "gradsync.checkpoint.writer_child", str(theirs.fileno())],
            pass_fds=(theirs.fileno(),),
            stdin=subprocess.DEVNULL,
            close_fds=True,
        )
    except BaseException:
        sock.close()
        raise
    finally:
        theirs.close()
    got = None
    try:
        send_message(sock, ("init", init), timeout_s=timeout_s)
        sock.settimeout(timeout_s)
        got = recv_message(sock)
        sock.settimeout(None)
    except OSError:  # a timeout, or the child gone
        pass
    if got is not None and got[0] == ("ready",):
        return child, sock
    _stop_child(child, sock, os.getpid())
    rank = init["rank"]
    if got is not None and got[0][0] == "error":
        raise CheckpointError(f"rank {rank}: {got[0][1]}")
    raise CheckpointError(
        f"rank {rank}: the checkpoint writer process (pid {child.pid}) did not start in "
        f"{timeout_s:g} s; {_exit_note(child)}"
    )


def _stop_child(child: subprocess.Popen[bytes], sock: socket.socket, owner: int) -> None:
    """Close the socket: the child then writes the snapshots it holds and ends by itself (not
    killed: a rank leaving by an exception still gets them written), continued first if
    stopped, reaped if done. Only by ``owner``, the process that started it: in a process
    forked from that one, the socket is the owner's too."""
    if os.getpid() != owner:
        return
    try:
        child.send_signal(signal.SIGCONT)  # nothing if it is done: ``send_signal`` polls first
        # Shut down, not only closed: the child sees the end at once even while the receiver
        # thread is still blocked reading it, or a process forked from this one holds it.
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)
        sock.close()
    finally:
        try:
            child.wait(timeout=0.05)
        except subprocess.TimeoutExpired:
            # Still writing what it holds: reaped when it ends, by a thread of its own, or a
            # long-lived process (a notebook, a sweep) would keep a zombie per closed writer.
            reaper = threading.Thread(target=child.wait, name=f"gradsync-reap-{child.pid}")
            reaper.daemon = True
            # At interpreter shutdown no thread starts (Python 3.12 on): the exiting process's
            # child is then reparented and reaped by init, as before.
            with contextlib.suppress(RuntimeError):
                reaper.start()


def _exit_note(child: subprocess.Popen[bytes]) -> str:
    """How ``child`` ended, as its socket broke: its exit status follows at once."""
    with contextlib.suppress(subprocess.TimeoutExpired):
        child.wait(timeout=2.0)
    code = child.poll()
    if code is None:
        return "it is still running"
    if code < 0:
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return f"it exited with code {code} (killed by {name})"
    return f"it exited with code {code}"


#: what a process's state letter in /proc/PID/stat says of a writer that does not answer
_STATES = {
    "T": "it is stopped (SIGSTOP or SIGTSTP)",
    "t": "it is stopped by a debugger",
    "D": "it is waiting in the kernel, on a disk most likely",
    "Z": "it has exited",
}


def _state_note(pid: int) -> str:
    state = procfs.state(pid)
    if state is None:
        return "it has exited"
    return _STATES.get(state, f"it is running (state {state})")


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
        self._cond = threading.Condition()
        self._error: BaseException | None = None
        if files_every < 1:
            raise ValueError(f"files_every must be >= 1, got {files_every}")
        self.files_every = files_every
        self._send_lock = threading.Lock()
        #: submitted, not written yet: the step, its snapshot and the message sent (``None``,
        #: ``None``: a held snapshot the child was told to write)
        self._in_flight: deque[tuple[int, Packed | None, tuple[Any, ...] | None]] = deque()
        #: the newest snapshots left in the mailbox, not written: their buffers stay taken
        self._held: deque[tuple[int, Packed]] = deque()
        self._held_seq = 0
        #: encodings of the replicated share whose text the child has, by its number for them
        self._shares: dict[int, Any] = {}
        self._pinned = False  # a flush failed: held buffers stay taken (``_pin_on_error``)
        self._last_file: int | None = None  # newest step sent to be written as a file
        self._last = -1  # newest step submitted
        self._abandoned = -1  # newest step given up after an error (rank 0 commits no more)
        self._gone = False  # the child's socket closed (``_receive``)
        self._started = False  # until the child has its mailbox and the receiver runs
        #: why this writer failed for good (its child died): every later call raises it
        self._failure: CheckpointError | None = None
        self._init = {
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
        self._child, self._sock = _spawn(self._init, _START_TIMEOUT_S)
        # Run when this writer is collected, or as the process exits: at the interpreter's
        # exit, or at a multiprocessing child's (a rank under ``gradsync run``), which ends
        # with os._exit and runs atexit handlers (``weakref.finalize``'s) only where gradsync's
        # worker runs them for a script, after multiprocessing's finalizers.
        self._finalizer = multiprocessing.util.Finalize(
            self, _stop_child, args=(self._child, self._sock, os.getpid()), exitpriority=0
        )
        self._shared = _SharedBuffers(self._send)
        self._mailbox = self._share_mailbox()
        #: buffers for this rank's snapshots: one per job in flight, two held, one being
        #: filled, one spare
        self.pool = BufferPool(self.depth + 4, allocate=self._shared.allocate)
        self._receiver = threading.Thread(
            target=self._receive, name=f"gradsync-checkpoint-writer-{self.rank}", daemon=True
        )
        self._receiver.start()
        self._started = True

    def _share_mailbox(self, slot_bytes: int | None = None) -> HeldSlots:
        slot_bytes = slot_bytes or SLOT_BYTES
        fd = os.memfd_create("gradsync-checkpoint-mailbox", os.MFD_CLOEXEC)
        try:
            os.ftruncate(fd, 2 * slot_bytes)
            area = mmap.mmap(fd, 2 * slot_bytes)
            self._send(("mailbox", slot_bytes), [fd])
        finally:
            os.close(fd)
        return HeldSlots(area, slot_bytes)

    def _send(self, message: Any, fds: list[int] | None = None) -> None:
        """Send the child ``message``; waits ``timeout_s`` at most for room (a child that
        reads nothing, stopped, fills its socket), and a dead child fails the writer."""
        try:
            with self._send_lock:
                send_message(self._sock, message, fds or (), timeout_s=self.timeout_s)
            return
        except TimeoutError:
            raise CheckpointError(
                f"rank {self.rank}: {self._writer_name()} read no message in "
                f"{self.timeout_s:g} s; {self._writer_state()}"
            ) from None
        except OSError:  # its socket is closed: the child is gone
            self._gone = True
        if self._started and not self._closing:
            with self._cond:
                self._raise_error()  # hands over what it left, and raises why
        raise CheckpointError(
            f"rank {self.rank}: {self._writer_name()} is gone; {_exit_note(self._child)}"
        )

    def _writer_name(self) -> str:
        return f"the checkpoint writer process (pid {self._child.pid})"

    def _writer_state(self) -> str:
        return _state_note(self._child.pid)

    def _pending_steps(self) -> list[int]:
        """The steps handed to the child and not written yet (under ``_cond``)."""
        return sorted(entry[0] for entry in self._in_flight)

    def _room(self) -> bool:
        """Under ``_cond``: until fewer than ``depth`` snapshots are in flight, for
        ``timeout_s`` at most (False then): a stopped child or a stalled disk must fail the
        rank, not hang it."""
        deadline = time.monotonic() + self.timeout_s
        while len(self._in_flight) >= self.depth:
            self._raise_error()
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(left)
        return True

    def _no_room(self, step: int) -> str:
        return (
            f"rank {self.rank}: no room for the checkpoint snapshot of step {step}: "
            f"{self._writer_name()} wrote none of the {self.depth} before it (steps "
            f"{', '.join(map(str, self._pending_steps()))}) in {self.timeout_s:g} s; "
            f"{self._writer_state()}"
        )

    # -- the training thread ------------------------------------------------------------------
    def submit(self, step: int, packed: Packed, *, durable: bool = False) -> None:
        """Hand ``packed`` to the child as this rank's file of ``step``; blocks while
        ``depth`` are in flight, ``timeout_s`` at most (see ``InlineCheckpointWriter.submit``)."""
        with self._cond:
            self._raise_error()
            if len(self._in_flight) >= self.depth and not self._room():
                raise CheckpointError(self._no_room(step))
            self._raise_error()
            if self._closing:
                raise CheckpointError("the checkpoint writer is closed")
            previous, self._last = self._last, max(self._last, step)
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
        if not self._to_file(step, durable, previous):
            self._hold(step, packed, message)
            return
        with self._cond:
            # the message kept too: should the child die, another one is sent it
            self._in_flight.append((step, packed, message))
            self._last_file = step
        self._send(message)

    def _raise_error(self) -> None:
        """Under ``_cond``: the child's error, once, and its death: noticed at the first call
        after its socket closed, and raised by every call from then on."""
        if self._failure is None and self._gone and self._started and not self._closing:
            self._fail()
        if self._failure is not None:
            raise CheckpointError(str(self._failure))
        if self._error is not None:
            error, self._error = self._error, None
            raise error

    def _fail(self) -> None:
        """The child died: have another write what it had not (``_take_over``), and fail."""
        unwritten = self._unwritten()
        self._in_flight.clear()
        self._abandoned = self._last
        why = f"rank {self.rank}: {self._writer_name()} died: {_exit_note(self._child)}"
        self._failure = CheckpointError(f"{why}; {self._take_over(unwritten)}")
        if runtime.restarts_left():
            # The rank fails with this error, but an elastic restart shows none of a failed
            # attempt's errors (only "worker process N exited with code 1"), where a run that
            # ends with it names it: said here, as the writer dies (``gradsync run``'s worker
            # names the exception the rank then fails with, too: ``_said_before_restart``).
            logger.warning("%s; this rank fails, and the run restarts", self._failure)

    def _unwritten(self) -> list[tuple[Any, ...]]:
        """The ``write`` messages of the snapshots handed over and not written, oldest
        first: those sent to the child and those held in the mailbox, with the bytes of
        their shared buffers in them (a new child has not got those buffers)."""
        messages = {}
        for _seq, raw in self._mailbox.entries():
            message = pickle.loads(raw)
            messages[message[1]] = message
        for step, _packed, message in self._in_flight:
            if message is not None:
                messages[step] = message
        return [
            (*m[:5], [(offset, self._shared.copied(part)) for offset, part in m[5]])
            for step, m in sorted(messages.items())
            if step > self._written
        ]

    def _take_over(self, unwritten: list[tuple[Any, ...]]) -> str:
        """Start a child that writes ``unwritten`` (the held snapshots live only in this
        process) and, on rank 0, commits the newest step every rank wrote, then ends: what the
        dead child would have done as its rank died. Returns what became of them, for the
        error."""
        steps = [m[1] for m in unwritten]
        commit = self.commits and self._written > self._committed
        if not steps and not commit:
            return "it had written every snapshot handed to it"
        try:
            child, sock = _spawn(self._init, min(self.timeout_s, _START_TIMEOUT_S))
        except CheckpointError as exc:
            return f"the snapshots of steps {steps} it had not written are lost ({exc})"
        try:
            for ident, share in self._shares.items():
                send_message(sock, ("share", ident, share.json), timeout_s=self.timeout_s)
            for message in unwritten:
                send_message(sock, message, timeout_s=self.timeout_s)
            if commit:
                send_message(sock, ("commit", self._written), timeout_s=self.timeout_s)
        except OSError as exc:
            return f"another writer process (pid {child.pid}) could not be sent them ({exc})"
        finally:
            sock.close()
            # reaped when it ends, whenever that is: it outlives this rank if need be
            threading.Thread(target=child.wait, daemon=True).start()
        what = f"writes the snapshots of steps {steps} it had not written" if steps else ""
        if commit:
            what += f"{' and ' if what else ''}commits this run's newest complete step"
        return f"another writer process (pid {child.pid}) {what}"

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

    def _to_file(self, step: int, durable: bool, previous: int) -> bool:
        """Whether ``step``'s snapshot is written now rather than held: decided from the steps
        alone, so that every rank (saving after the same steps) writes the same ones. Held
        only where the last save was the step before (a checkpoint every step, what holding
        is for): a save every 5 steps was held too, so a run killed whole (its writers with
        it) kept only every 64th step's file, and ``keep`` counted files a step apart by 64."""
        last = self._last_file
        if durable or last is None or step != previous + 1:
            return True
        return step - last >= self.files_every or step < last

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
        """Write the newest held snapshot (the child reads it from the mailbox), then wait
        until every snapshot handed over is written and (rank 0) committed or given up."""
        if self._held:
            self._write_held(self._held[-1][0])
        self._pin_on_error(self._wait_settled, timeout_s)

    def _wait_settled(self, timeout_s: float | None) -> None:
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        with self._cond:
            while not self._settled():
                self._raise_error()
                left = deadline - time.monotonic()
                if left <= 0:
                    late = f"rank {self.rank}: checkpoints still being written to "
                    late += f"{self.store.directory} after {limit:g} s"
                    if pending := self._pending_steps():  # else rank 0 waits for its peers
                        late += f": steps {', '.join(map(str, pending))} not written by "
                        late += f"{self._writer_name()}; {self._writer_state()}"
                    raise CheckpointError(late)
                self._cond.wait(min(left, 0.05))
            self._raise_error()

    def write_newest(self) -> None:
        """Tell the child to write the newest held snapshot, without waiting."""
        if self._held:
            self._write_held(self._held[-1][0])

    def wait(self, step: int, timeout_s: float | None = None) -> None:
        """Until ``step``'s checkpoint is complete (``_done``), writing its snapshot first if
        it is held. ``CheckpointError`` after the timeout."""
        self._write_held(step)
        self._pin_on_error(self._wait_done, step, timeout_s)

    def _wait_done(self, step: int, timeout_s: float | None) -> None:
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        with self._cond:
            while not self._done(step):
                self._raise_error()
                left = deadline - time.monotonic()
                if left <= 0:
                    late = self._late(step, limit)
                    if self._written < step and self._pending_steps():  # did not answer
                        late += f" by {self._writer_name()}; {self._writer_state()}"
                    raise CheckpointError(late)
                self._cond.wait(min(left, POLL_S) if self._written >= step else left)
            self._raise_error()

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
            sent = any(e[0] == step for e in self._in_flight) or step <= self._written
            if not held or sent or self._closing:
                return
            # ``_last_file`` stays: which steps become files depends on the steps alone, the
            # same on every rank, whoever flushes
            self._in_flight.append((step, None, None))
        self._send(("flush", step))

    def _settled(self) -> bool:
        done = max(self._committed, self._abandoned)
        return not self._in_flight and (not self.commits or done >= self._last)

    def close(self, timeout_s: float | None = None) -> None:
        """Write what is in flight, then stop the child; raises what went wrong in it (once:
        a dead child's snapshots went to another, ``_take_over``)."""
        flushed = False
        try:
            if self._failure is None:
                self.flush(timeout_s)
                flushed = True
        finally:
            with self._cond:
                self._closing = True
            if flushed:
                # continued if stopped: it then writes what it holds and ends
                self._child.send_signal(signal.SIGCONT)
                with contextlib.suppress(CheckpointError):
                    self._send(("close",))
                try:
                    self._child.wait(timeout=5.0)  # it exits once its commits are done
                except subprocess.TimeoutExpired:  # everything was flushed: nothing to lose
                    self._child.kill()
                    self._child.wait()
            self._finalizer()  # continued if stopped, its socket shut (``_stop_child``)
            if not flushed:
                # Not killed, but let go as when the rank dies: it writes what it holds and,
                # on rank 0, commits the newest step every rank wrote once its peers' writers
                # have ended, which a peer whose writer was stopped does only after this rank
                # gave up on it (a commit past its deadline); then it ends by itself.
                threading.Thread(target=self._child.wait, daemon=True).start()
            self._receiver.join(timeout=5.0)

    # -- the receiver thread ------------------------------------------------------------------
    def _receive(self) -> None:
        while True:
            try:
                got = recv_message(self._sock)
            except OSError:
                got = None
            with self._cond:
                if got is None:
                    # The child is gone (or closing): the training thread's next call finds
                    # out how, and has another child write what it left (``_raise_error``).
                    self._gone = True
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
        waiting: deque[tuple[int, Packed | None, tuple[Any, ...] | None]] = deque()
        for entry in self._in_flight:  # in step order but for a held one written out of turn
            done, packed = entry[0] <= step, entry[1]
            if not done:
                waiting.append(entry)
            elif packed is not None and packed.release is not None:  # written: reusable
                packed.release()
        self._in_flight = waiting
