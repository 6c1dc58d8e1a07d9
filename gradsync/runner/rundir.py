"""One run per run directory, and no run deletes another's checkpoints.

``gradsync run --out DIR`` takes an exclusive lock on ``DIR`` for as long as it runs: an
``fcntl.flock`` on ``DIR/.gradsync.lock``, which holds the owner's pid, host and start time so a
second run can be refused naming it. The kernel drops the lock when its process ends however
it ends, so a crashed run never leaves a stale lock behind. A directory that already holds a
run is refused too, unless the new run continues it (``--resume``) or the user asks to start
over in it (``--overwrite``, which alone deletes its checkpoints, fault markers and metrics).
"""

from __future__ import annotations

import fcntl
import os
import shutil
import socket
import time
from pathlib import Path
from typing import IO

from gradsync.errors import UsageError

LOCK_FILE = ".gradsync.lock"
OVERWRITE_AND_RESUME = (
    "--resume continues the run in --out and --overwrite deletes it: pass one of them"
)
#: the built-in workloads' checkpoints (``--checkpoint-every``) and final parameters
CHECKPOINT_DIR = "checkpoints"
FINAL_MODEL = "final_model.pt"
#: what a fresh run replaces in a directory it is told to --overwrite
RUN_STATE = (CHECKPOINT_DIR, "faults", "metrics.jsonl")


class RunDirectory:
    """The lock on one run directory; ``release()`` (or the process's end) gives it back."""

    def __init__(self, path: Path, handle: IO[str]) -> None:
        self.path = path
        self._handle: IO[str] | None = handle

    def release(self) -> None:
        if self._handle is not None:
            self._handle.close()  # closing the file drops the flock
            self._handle = None


def claim(path: str | Path, *, resume: bool, overwrite: bool) -> RunDirectory:
    """Lock ``path`` for this run (creating it) and make sure the run may use it: empty, or
    continued with ``resume``, or started over with ``overwrite``. ``UsageError`` otherwise."""
    run_dir = Path(path)
    if run_dir.exists() and not run_dir.is_dir():
        raise UsageError(f"--out {run_dir} is a file, not a directory: pass another --out")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
        handle = open(run_dir / LOCK_FILE, "a+")  # noqa: SIM115 - held for the whole run
    except OSError as exc:
        raise UsageError(f"--out {run_dir} cannot be written: {exc.strerror}") from None
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        handle.close()
        raise UsageError(
            f"--out {run_dir} is in use by another gradsync run ({holder}): wait for it to "
            "end, or pass another --out"
        ) from None
    claimed = RunDirectory(run_dir, handle)
    try:
        _check_contents(run_dir, resume=resume, overwrite=overwrite)
    except BaseException:
        claimed.release()
        raise
    handle.seek(0)
    handle.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
    handle.flush()
    return claimed


def _check_contents(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise UsageError(OVERWRITE_AND_RESUME)
    held = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)
    if not held or resume:
        return
    if not overwrite:
        shown = ", ".join(held[:5]) + (", ..." if len(held) > 5 else "")
        raise UsageError(
            f"--out {run_dir} already holds a run ({shown}): pass --resume to continue it from "
            "its newest checkpoint, --overwrite to start over in it (deleting its checkpoints), "
            "or another --out"
        )
    for name in RUN_STATE:
        target = run_dir / name
        if target.is_dir():
            shutil.rmtree(target)
        else:
            target.unlink(missing_ok=True)


__all__ = ["LOCK_FILE", "OVERWRITE_AND_RESUME", "RunDirectory", "claim"]
