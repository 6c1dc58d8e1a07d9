"""What every checkpoint writer shares (``WriterBase``), and the simplest one: writing on the
caller's thread (``InlineCheckpointWriter``).

``sync.save(directory, wait=False)`` copies the state (``checkpoint.snapshot``) and hands it to
this rank's writer: on Linux ``gradsync.checkpoint.writer_process``'s child process, which
writes while training goes on (``make_writer`` there picks it). The inline writer is what runs
where a child cannot (no ``memfd``: macOS, Windows) and what unit tests use, which start no
process: it writes the file in ``submit`` itself, so a save costs the step the write as well as
the copy. There is no writer thread any more: it took the GIL from training for its Python
work, so the process replaced it (docs/checkpoints.md, "The writer process").

Rank 0's writer also commits (``commits``, which says when a commit is durable); the inline
writer looks for its peers' files at each ``submit``, ``wait`` and ``flush``.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from gradsync.checkpoint.commits import POLL_S, Commits, late_message
from gradsync.checkpoint.files import write_failure
from gradsync.checkpoint.packing import BufferPool, Packed
from gradsync.checkpoint.store import CheckpointError, CheckpointStore

__all__ = ["InlineCheckpointWriter", "WriterBase"]

#: at most this long between durable checkpoints (fsynced) among those written in the
#: background; the kernel writes dirty pages back after about as long (30 s on Linux) anyway
DURABLE_EVERY_S = 30.0


class WriterBase:
    """What both writers share (this module's inline one, ``writer_process``'s child process):
    the arguments, and when a step's checkpoint is complete (a subclass sets ``_written`` and
    ``_committed``). ``save_id``: the same on every rank of this run, new for every attempt, so
    rank 0 never commits a step with a peer's file of an attempt rolled back. ``timeout_s``
    bounds how long rank 0 waits for a peer's file after writing its own, and ``wait``."""

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
        self._written = -1  # newest step this rank's file is on disk for
        self._committed = -1  # rank 0: newest step whose manifest it wrote
        self._closing = False

    @property
    def commits(self) -> bool:
        return self.rank == 0

    def _done(self, step: int) -> bool:
        """Whether ``step``'s checkpoint is complete: committed (rank 0) or its manifest seen
        (other ranks, once their own file is written)."""
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


class InlineCheckpointWriter(WriterBase):
    """One rank's writer for one checkpoint directory, on the caller's thread: a ``submit``
    returns once the file is written; rank 0 then commits each step whose peers' files are
    there, now or at a later call."""

    def __init__(self, store: CheckpointStore, **kwargs: Any) -> None:
        super().__init__(store, **kwargs)
        #: one buffer being filled and written, one spare
        self.pool = BufferPool(2)
        self._commits = Commits(
            store,
            world_size=self.world_size,
            save_id=self.save_id,
            timeout_s=self.timeout_s,
            durable_every_s=self.durable_every_s,
        )

    def submit(self, step: int, packed: Packed, *, durable: bool = False) -> None:
        """Write ``packed`` as this rank's file of ``step`` (fsynced, and rank 0's commit of
        the step durable, with ``durable``)."""
        if self._closing:
            raise CheckpointError("the checkpoint writer is closed")
        try:
            self.store.write(
                step, self.rank, self.world_size, packed, save_id=self.save_id, durable=durable
            )
        except BaseException as exc:
            self._commits.clear()
            raise write_failure(self.rank, self.store.directory, exc) from exc
        finally:
            if packed.release is not None:  # written or failed: its buffers are free again
                packed.release()
        self._written = max(self._written, step)
        if self.commits:
            self._commits.add(step, durable)
            self._commit_ready()

    def _commit_ready(self) -> None:
        done, error = self._commits.commit_ready()
        if done:
            self._committed = done[-1]
        if error is not None:
            # The steps after the one given up are given up too, as a background writer's
            # error does: a later save starts the commits afresh.
            self._commits.clear()
            raise error

    def wait(self, step: int, timeout_s: float | None = None) -> None:
        """Until ``step``'s checkpoint is complete (``_done``). ``CheckpointError`` after the
        timeout."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        self._poll_until(lambda: self._done(step), limit, lambda: self._late(step, limit))

    def flush(self, timeout_s: float | None = None) -> None:
        """Until rank 0 has committed (or given up) every step it wrote."""
        limit = self.timeout_s if timeout_s is None else timeout_s
        late = f"rank {self.rank}: checkpoints still being written to {self.store.directory} "
        self._poll_until(lambda: not self._commits, limit, lambda: late + f"after {limit:g} s")

    def _poll_until(self, done: Callable[[], bool], limit: float, late: Callable[[], str]) -> None:
        deadline = time.monotonic() + limit
        while True:
            if self.commits and self._commits:
                self._commit_ready()
            if done():
                return
            left = deadline - time.monotonic()
            if left <= 0:
                raise CheckpointError(late())
            time.sleep(min(left, self._commits.poll_s or POLL_S))

    def close(self, timeout_s: float | None = None) -> None:
        """Commit what is written (rank 0), then refuse further snapshots."""
        try:
            self.flush(timeout_s)
        finally:
            self._closing = True
