"""Which writer processes may still be writing into a checkpoint directory.

Each writer process holds an exclusive ``flock`` on ``DIR/.writers/<save_id>.rank-<R>.lock`` for
its whole life (the kernel releases it however the process ends), so that a restarted attempt
reads the directory only once the writers that outlived their ranks are done: rank 0's writer
waits for its peers' locks before its last commit, and a loading rank 0 for every lock of
other attempts, then removes them (docs/checkpoints.md, "The writer process"). Torch-free.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import time
from pathlib import Path

from gradsync import procfs

__all__ = [
    "LOCK_DIR",
    "hold",
    "others_alive",
    "release",
    "released",
    "wait_for_session_writers",
    "wait_for_writers",
    "writers_in_session",
]

LOCK_DIR = ".writers"
_POLL_S = 0.005


def _path(directory: str | Path, save_id: str, rank: int) -> Path:
    return Path(directory) / LOCK_DIR / f"{save_id}.rank-{rank}.lock"


def hold(directory: str | Path, save_id: str, rank: int, timeout_s: float) -> int:
    """Take this writer's lock (waiting up to ``timeout_s`` if a process still holds it);
    returns the descriptor, which must stay open while the process may write."""
    path = _path(directory, save_id, rank)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() > deadline:
                os.close(fd)
                raise TimeoutError(f"{path} is still held after {timeout_s:g} s") from None
            time.sleep(_POLL_S)


def release(directory: str | Path, save_id: str, rank: int, fd: int) -> None:
    """A writer that ended normally removes its lock file, then lets the lock go."""
    with contextlib.suppress(OSError):
        _path(directory, save_id, rank).unlink()
    os.close(fd)


def _free(path: Path) -> bool:
    """Whether no process holds ``path``'s lock (a missing file holds none)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except FileNotFoundError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    except OSError:  # a filesystem without flock: nothing to wait for (none was taken)
        return True
    finally:
        os.close(fd)  # releases the lock if this took it


def released(directory: str | Path, save_id: str, rank: int) -> bool:
    """Whether rank ``rank``'s writer of attempt ``save_id`` has ended (or never started)."""
    return _free(_path(directory, save_id, rank))


def _locks(directory: str | Path, except_save_id: str | None) -> list[Path]:
    """The lock files in ``directory`` but those of attempt ``except_save_id``."""
    root = Path(directory) / LOCK_DIR
    try:
        names = sorted(os.listdir(root))
    except (FileNotFoundError, NotADirectoryError):
        return []
    own = None if except_save_id is None else f"{except_save_id}.rank-"
    return [root / n for n in names if n.endswith(".lock") and not (own and n.startswith(own))]


def others_alive(directory: str | Path, save_id: str) -> bool:
    """Whether a writer process of another attempt than ``save_id`` still holds its lock in
    ``directory`` (it may still write into any step directory)."""
    return any(not _free(path) for path in _locks(directory, save_id))


def wait_for_writers(
    directory: str | Path, *, except_save_id: str | None = None, timeout_s: float = 60.0
) -> list[str]:
    """Until every writer process of ``directory`` has ended but those of ``except_save_id``
    (this attempt's own), then remove their lock files. Returns the locks still held at the
    timeout (their writers may still write: the caller warns)."""
    deadline = time.monotonic() + timeout_s
    held = []
    for path in _locks(directory, except_save_id):
        while not _free(path):
            if time.monotonic() >= deadline:
                held.append(path.name)
                break
            time.sleep(_POLL_S)
        else:
            with contextlib.suppress(FileNotFoundError):
                path.unlink()
    return held


#: how a writer process's command line names its module (``writer_process._spawn``)
_WRITER_MODULE = b"gradsync.checkpoint.writer_child"


def writers_in_session(session: int) -> list[int]:
    """The pids of the checkpoint writer processes still running in session ``session``
    (Linux's ``/proc``; none elsewhere, where no writer process runs). A writer outlives its
    rank until it has written what the rank held, wherever the rank saved."""
    found = []
    try:
        entries = os.listdir("/proc")
    except OSError:
        return []
    for entry in entries:
        if not entry.isdigit():
            continue
        fields = procfs.stat_fields(entry)
        if fields is None or fields[0] == "Z" or fields[3] != str(session):  # state, session
            continue
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                if _WRITER_MODULE in f.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:  # gone meanwhile, or unreadable
            continue
    return found


def wait_for_session_writers(timeout_s: float) -> list[int]:
    """Until no checkpoint writer process is left in this process's session, or
    ``timeout_s``; returns the pids still running then. For ``gradsync run --replica-groups``'s
    group process, whose whole session the run kills once it has ended."""
    session = os.getsid(0)
    deadline = time.monotonic() + timeout_s
    while (left := writers_in_session(session)) and time.monotonic() < deadline:
        time.sleep(0.02)
    return left
