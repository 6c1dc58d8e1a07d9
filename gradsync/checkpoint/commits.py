"""Rank 0's commits of checkpoints written in the background: each step's manifest, once every
rank's file of it is on disk, oldest first.

Shared by the two writers (``gradsync.checkpoint.writer_inline``'s, on the caller's thread, and
``gradsync.checkpoint.writer_child``'s process), so both commit alike; torch-free, like
``gradsync.checkpoint.files``, for the process. No collective is involved: rank 0 looks for its
peers' files (each rank's ``.sum`` names the same ``save_id``) at doubling intervals, and gives
a step up, as a ``CheckpointError``, when its files are still missing at its deadline.

A step is committed durable (fsyncing every rank's file, the manifest and the directories)
when its save asked for it, or when the last durable commit is ``durable_every_s`` old; why
the others are not fsynced: docs/checkpoints.md, "Durability".
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from gradsync.checkpoint.files import CheckpointError, CheckpointFiles, FileEntry

__all__ = ["POLL_MAX_S", "POLL_S", "Commits", "late_message"]

#: how often rank 0 first looks for its peers' files of a step it has written itself, doubling
#: up to ``POLL_MAX_S`` while they are missing: each look reads files, and with a checkpoint
#: every step a fixed 2 ms poll took more CPU than the writing on a busy machine
POLL_S = 0.002
POLL_MAX_S = 0.016


@dataclass(slots=True)
class _Commit:
    step: int
    deadline: float
    durable: bool
    #: the ranks' files found by earlier looks, not read again
    found: dict[int, FileEntry] = field(default_factory=dict)
    poll_s: float = POLL_S


def late_message(
    files: CheckpointFiles,
    rank: int,
    step: int,
    limit: float,
    *,
    written: bool,
    world_size: int,
    save_id: str,
) -> str:
    """Why ``step``'s checkpoint is not complete after ``limit`` seconds, for an error."""
    if not written:
        return f"rank {rank}: its file of checkpoint step {step} was not written in {limit:g} s"
    missing = files.missing(step, world_size, save_id)
    who = f"no file from rank(s) {', '.join(map(str, missing))}" if missing else "not committed"
    return (
        f"checkpoint of step {step} in {files.directory} is incomplete after {limit:g} s: "
        f"{who}; sync.save() must be called on every rank after the same step"
    )


class Commits:
    """The steps rank 0 has written and not committed yet (not thread-safe: one owner)."""

    def __init__(
        self,
        files: CheckpointFiles,
        *,
        world_size: int,
        save_id: str,
        timeout_s: float,
        durable_every_s: float,
    ) -> None:
        self.files, self.world_size, self.save_id = files, world_size, save_id
        self.timeout_s, self.durable_every_s = timeout_s, durable_every_s
        self._pending: deque[_Commit] = deque()
        self._last_durable = -float("inf")

    def __len__(self) -> int:
        return len(self._pending)

    def add(self, step: int, durable: bool) -> None:
        """``step`` is written on rank 0: commit it once its peers' files are there."""
        self._pending.append(_Commit(step, time.monotonic() + self.timeout_s, durable))

    def clear(self) -> None:
        self._pending.clear()

    @property
    def poll_s(self) -> float | None:
        """How long to wait before the next look (``None``: nothing to commit)."""
        return self._pending[0].poll_s if self._pending else None

    def commit_ready(self) -> tuple[list[int], CheckpointError | None]:
        """Commit, oldest first, each step whose files are all written. Returns the steps
        committed, and the error for a step whose files are still missing at its deadline
        (it is dropped, and the later ones wait for the next call)."""
        done: list[int] = []
        while self._pending:
            head = self._pending[0]
            now = time.monotonic()
            durable = head.durable or now - self._last_durable >= self.durable_every_s
            info = self.files.try_commit(
                head.step, self.world_size, save_id=self.save_id, durable=durable, known=head.found
            )
            if not isinstance(info, list):
                if durable:
                    self._last_durable = now
                self._pending.popleft()
                done.append(head.step)
                continue
            if time.monotonic() > head.deadline:
                self._pending.popleft()
                return done, CheckpointError(
                    late_message(
                        self.files,
                        0,
                        head.step,
                        self.timeout_s,
                        written=True,
                        world_size=self.world_size,
                        save_id=self.save_id,
                    )
                )
            head.poll_s = min(2 * head.poll_s, POLL_MAX_S)
            break
        return done, None
