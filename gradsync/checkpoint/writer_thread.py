"""Checkpoints written off the training thread: snapshot at the step boundary, write behind.

This is the writer as a thread; ``gradsync.checkpoint.writer_process`` runs the same work in a child
process with the same contract, and ``make_writer`` there picks one (the process on Linux).

``sync.save(directory, wait=False)`` copies the state (``checkpoint.snapshot``) and hands it to
this rank's ``CheckpointWriter``, whose thread serializes, checksums and writes the file while
training goes on. Rank 0's writer also commits: once every rank's file of a step is on disk
(``CheckpointStore.missing`` is empty: each rank's ``.sum`` names the same ``save_id``), it
writes the manifest and prunes to ``keep``, exactly as a blocking save's commit does. No
collective is involved, so a checkpoint costs the training thread only the copy; the files are
atomic and checksummed as before, and a step is restorable only once its manifest exists.

Durability: a file written in the background is not fsynced, and neither is the manifest of
its step, except every ``durable_every_s`` (30 s) on rank 0, whose commit then fsyncs every
rank's file of that step, the manifest and the directories. A checkpoint every step that
fsynced everything made each step wait for the disk (the files outlive the step by only
``keep`` steps: unsynced, most never reach the disk at all). The files are as atomic and
checksummed either way, so a killed process (what gradsync recovers from) loses nothing; a
crash of the machine may tear the checkpoints written since the newest durable one, whose
checksums then fail, and ``latest`` falls back to it: ``prune`` keeps the newest durable
checkpoint besides the newest ``keep``. ``save(wait=True)`` is always durable.

At most ``depth`` snapshots wait for the thread; a further ``submit`` blocks until one is
written (the memory bound, and a disk slower than the steps shows up as step time rather than
as checkpoints silently dropped), for ``timeout_s`` at most: a stalled disk, or a stopped
writer process, then fails the rank naming the writer, rather than hanging it. Errors of the
thread (a full disk, a rank whose file never came) are raised by the next ``submit``, ``wait``
or ``close`` on the training thread.

Why not ``torch.distributed.checkpoint.async_save``: it plans every save with collectives over
the group (its cost per call was not measured here), writes DCP's own layout without our
manifest and checksums, and is meant for checkpoints minutes apart. DCP remains the candidate
for sharded strategies whose state must be re-sharded on load (not used yet: ``zero:N``
checkpoints are per-rank files and refuse another world size).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Any

from gradsync.checkpoint.commits import POLL_S, Commits, late_message
from gradsync.checkpoint.files import write_failure
from gradsync.checkpoint.packing import BufferPool, Packed
from gradsync.checkpoint.store import CheckpointError, CheckpointStore

__all__ = ["CheckpointWriter"]

#: at most this long between durable checkpoints (fsynced) among those written in the
#: background; the kernel writes dirty pages back after about as long (30 s on Linux) anyway
DURABLE_EVERY_S = 30.0


class WriterBase:
    """What both background writers share (this module's thread, ``writer_process``'s child
    process): the arguments, the waiting for a step or for everything handed over, and the
    errors of the writer raised on the training thread. A subclass sets ``_written`` and
    ``_committed`` under ``_cond`` and says when nothing is left in flight (``_settled``).

    ``save_id`` must be the same string on every rank of this run (and differ from any earlier
    run's or attempt's): it keeps rank 0 from committing a step with a peer's file left by an
    attempt that was rolled back. ``timeout_s`` bounds how long rank 0 waits for a peer's file
    after writing its own, and how long ``wait`` waits.
    """

    def __init__(
        self,
        store: CheckpointStore,
        *,
        rank: int,
        world_size: int,
        save_id: str,
        timeout_s: float,
        depth: int = 2,
        durable_every_s: float = DURABLE_EVERY_S,
    ) -> None:
        if depth < 1:
            raise ValueError(f"depth must be >= 1, got {depth}")
        if not durable_every_s >= 0:
            raise ValueError(f"durable_every_s must be >= 0, got {durable_every_s}")
        self.store = store
        self.rank, self.world_size, self.save_id = rank, world_size, save_id
        self.timeout_s, self.depth = timeout_s, depth
        self.durable_every_s = durable_every_s
        self._cond = threading.Condition()
        self._written = -1  # newest step this rank's file is on disk for
        self._committed = -1  # rank 0: newest step whose manifest it wrote
        self._error: BaseException | None = None
        self._closing = False

    @property
    def commits(self) -> bool:
        return self.rank == 0

    def _settled(self) -> bool:
        """Whether every snapshot handed over is written and (rank 0) committed or given up
        (called under ``_cond``)."""
        raise NotImplementedError

    def _writer_name(self) -> str:
        """Who writes, for an error (a subclass names its process)."""
        return "the checkpoint writer thread"

    def _writer_state(self) -> str:
        """What the writer is doing, for an error saying it did not answer in time."""
        return "it is still busy (a stalled disk?)"

    def _pending_steps(self) -> list[int]:
        """The steps handed to the writer and not written yet (under ``_cond``)."""
        raise NotImplementedError

    def _room(self, pending: Callable[[], list[int]]) -> bool:
        """Under ``_cond``: until fewer than ``depth`` snapshots are ``pending``, for
        ``timeout_s`` at most (False then): a stopped writer or a stalled disk must fail the
        rank, not hang it."""
        deadline = time.monotonic() + self.timeout_s
        while len(pending()) >= self.depth:
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

    def wait(self, step: int, timeout_s: float | None = None) -> None:
        """Until ``step``'s checkpoint is complete: committed (rank 0) or its manifest seen
        (other ranks, once their own file is written). ``CheckpointError`` after the timeout."""
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

    def _done(self, step: int) -> bool:
        if self.commits:
            return self._committed >= step
        return self._written >= step and self.store.committed(step, self.save_id)

    def _late(self, step: int, limit: float) -> str:
        return late_message(
            self.store,
            self.rank,
            step,
            limit,
            written=self._written >= step,
            world_size=self.world_size,
            save_id=self.save_id,
        )

    def write_newest(self) -> None:
        """Start writing the newest snapshot if it is held in memory, without waiting (a
        writer that holds none has nothing to do)."""
        return None

    def flush(self, timeout_s: float | None = None) -> None:
        """Until every snapshot handed over is written and (rank 0) committed or given up."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + limit
        with self._cond:
            while not self._settled():
                self._raise_error()
                left = deadline - time.monotonic()
                if left <= 0:
                    raise CheckpointError(self._flush_late(limit))
                self._cond.wait(min(left, 0.05))
            self._raise_error()

    def _flush_late(self, limit: float) -> str:
        pending = self._pending_steps()
        late = f"rank {self.rank}: checkpoints still being written to {self.store.directory} "
        if not pending:  # rank 0 waits for its peers' files, or a write is under way
            return late + f"after {limit:g} s"
        return (
            late + f"after {limit:g} s: steps {', '.join(map(str, pending))} not written by "
            f"{self._writer_name()}; {self._writer_state()}"
        )

    def _raise_error(self) -> None:
        if self._error is not None:
            error, self._error = self._error, None
            raise error


class CheckpointWriter(WriterBase):
    """One rank's background writer for one checkpoint directory, a thread (see the module
    docstring and ``WriterBase`` for the arguments)."""

    def __init__(self, store: CheckpointStore, **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        #: buffers for this rank's snapshots: one per queued job, one being written, one spare
        self.pool = BufferPool(self.depth + 2)
        self._jobs: deque[tuple[int, Packed, bool]] = deque()
        self._commits = Commits(
            store,
            world_size=self.world_size,
            save_id=self.save_id,
            timeout_s=self.timeout_s,
            durable_every_s=self.durable_every_s,
        )
        self._busy = False
        self._thread = threading.Thread(
            target=self._run, name=f"gradsync-checkpoint-writer-{self.rank}", daemon=True
        )
        self._thread.start()

    def submit(self, step: int, packed: Packed, *, durable: bool = False) -> None:
        """Queue ``packed`` as this rank's file of ``step``; blocks while ``depth`` wait.

        ``durable`` fsyncs the file (and makes rank 0's commit of the step durable); without
        it, rank 0 makes a commit durable only every ``durable_every_s`` (see the module
        docstring)."""
        with self._cond:
            self._raise_error()
            if len(self._jobs) >= self.depth and not self._room(self._pending_steps):
                raise CheckpointError(self._no_room(step))
            self._raise_error()
            if self._closing:
                raise CheckpointError("the checkpoint writer is closed")
            self._jobs.append((step, packed, durable))
            self._cond.notify_all()

    def _settled(self) -> bool:
        return not (self._jobs or self._busy or self._commits)

    def _pending_steps(self) -> list[int]:
        return [job[0] for job in self._jobs]

    def close(self, timeout_s: float | None = None) -> None:
        """Write what is queued, then stop the thread; raises what went wrong in it."""
        try:
            self.flush(timeout_s)
        finally:
            with self._cond:
                self._closing = True
                self._cond.notify_all()
            self._thread.join(timeout=5.0)

    # -- the thread ---------------------------------------------------------------------------
    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._jobs and not self._closing:
                    if self._commits:
                        self._cond.wait(self._commits.poll_s)
                        break
                    self._cond.wait()
                if self._closing and not self._jobs:
                    return
                job = self._jobs.popleft() if self._jobs else None
                self._busy = job is not None
                self._cond.notify_all()
            try:
                if job is not None:
                    self._write(*job)
                if self.commits:
                    self._try_commits()
            except BaseException as exc:  # noqa: BLE001 - handed to the training thread
                with self._cond:
                    self._error = write_failure(self.rank, self.store.directory, exc)
                    self._commits.clear()
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write(self, step: int, packed: Packed, durable: bool) -> None:
        self.store.write(
            step, self.rank, self.world_size, packed, save_id=self.save_id, durable=durable
        )
        if packed.release is not None:  # written: its buffers may take the next snapshot
            packed.release()
        with self._cond:
            self._written = step
            if self.commits:
                self._commits.add(step, durable)
            self._cond.notify_all()

    def _try_commits(self) -> None:
        """Commit each step whose files are all written (``Commits``); an error (a step whose
        files are still missing at its deadline) is raised on the training thread."""
        done, error = self._commits.commit_ready()
        if done:
            with self._cond:
                self._committed = done[-1]
                self._cond.notify_all()
        if error is not None:
            raise error
