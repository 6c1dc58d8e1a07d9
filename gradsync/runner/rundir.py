"""One run per run directory, and no run deletes another's checkpoints.

``gradsync run --out DIR`` (and ``gradsync compare --out DIR``, for the comparison's directory and
each strategy's run in it) takes an exclusive lock on ``DIR`` for as long as it runs: an
``fcntl.flock`` on ``DIR/.gradsync.lock``, which holds the owner's pid, host and start time so a
second run can be refused naming it. The kernel drops the lock when its process ends however
it ends, so a crashed run never leaves a stale lock behind. The lock file is opened without
following a symbolic link: a link planted there would otherwise have its target truncated and
rewritten. A directory that already holds a run is refused too, unless the new run continues
it (``--resume``) or the user asks to start over in it (``--overwrite``). ``--overwrite`` deletes
only what gradsync wrote (the checkpoints' step directories, fault markers and metrics) and only
in a directory gradsync recognises as a run's, also in any directory of the run's holding
gradsync's checkpoints (a script's ``{run_dir}/ckpt``): a plain directory is refused, naming
what would have been deleted.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import re
import shutil
import socket
import stat
import time
from pathlib import Path
from typing import IO

from gradsync.checkpoint.files import MANIFEST
from gradsync.checkpoint.writer_locks import LOCK_DIR
from gradsync.errors import UsageError
from gradsync.telemetry.membership import MEMBERSHIP_FILE

LOCK_FILE = ".gradsync.lock"
OVERWRITE_AND_RESUME = (
    "--resume continues the run in --out and --overwrite deletes it: pass one of them"
)
#: the built-in workloads' checkpoints (``--checkpoint-every``) and final parameters
CHECKPOINT_DIR = "checkpoints"
FINAL_MODEL = "final_model.pt"
#: the --tracker sinks' directories (``gradsync.telemetry.trackers``: TENSORBOARD_DIR,
#: MLFLOW_DIR, and W&B's own), spelled here: that module is not needed to delete them
TRACKER_DIRS = ("tensorboard", "mlruns", "wandb")
#: what a fresh run replaces in a directory it is told to --overwrite (the trackers' files too:
#: a new run's event files beside the old ones mixed two runs in one TensorBoard view)
RUN_STATE = (
    CHECKPOINT_DIR,
    "faults",
    "metrics.jsonl",
    "spans.jsonl",
    MEMBERSHIP_FILE,
    *TRACKER_DIRS,
)
#: keys every config.json that ``gradsync run`` (and each run of ``compare``) writes holds
RUN_CONFIG_KEYS = frozenset({"strategy", "nproc", "out"})
#: and what it ran: a built-in workload's, or a script's (its config.json records no
#: workload or steps, ``RunConfig.recorded``)
RAN_KEYS = (frozenset({"steps", "workload"}), frozenset({"script"}))
#: the comparison's own file, in the directory of ``gradsync compare --out``
COMPARE_FILE = "compare.json"
#: a checkpoint's step directory (``gradsync.checkpoint.files``), committed or not
_STEP_DIR = re.compile(r"^step-\d+$")
#: the step records' log kept beside the checkpoints (``gradsync.checkpoint.row_log.LOG_DIR``,
#: spelled here: that module imports torch, which this one never needs)
ROW_LOG_DIR = "telemetry"


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
    except OSError as exc:
        raise UsageError(f"--out {run_dir} cannot be written: {exc.strerror}") from None
    handle = _open_lock(run_dir)
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
        _check_writable(run_dir)
    except BaseException:
        claimed.release()
        raise
    handle.seek(0)
    handle.truncate()
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    handle.write(f"pid {os.getpid()} on {socket.gethostname()}, started {started}\n")
    handle.flush()
    return claimed


def _open_lock(run_dir: Path) -> IO[str]:
    """``run_dir/.gradsync.lock``, opened for reading and writing without following a link
    (O_NOFOLLOW) and without waiting on a FIFO (O_NONBLOCK): only a regular file is taken."""
    lock = run_dir / LOCK_FILE
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
    try:
        fd = os.open(lock, flags, 0o644)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UsageError(
                f"--out {run_dir}: its lock file {LOCK_FILE} is a symbolic link (to "
                f"{os.readlink(lock)}); gradsync writes its lock only into a regular file of "
                "its own: remove the link, or pass another --out"
            ) from None
        raise UsageError(f"--out {run_dir} cannot be written: {exc.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise UsageError(
            f"--out {run_dir}: its lock file {LOCK_FILE} is not a regular file; remove it, or "
            "pass another --out"
        )
    return os.fdopen(fd, "r+")


def _check_writable(run_dir: Path) -> None:
    """The run writes into its directory's state (checkpoints, faults): one that cannot be
    written (a read-only mount, another owner) is refused here, not after the workers started
    and loaded a checkpoint."""
    for name in RUN_STATE:
        path = run_dir / name
        if path.exists() and not os.access(path, os.W_OK | (os.X_OK if path.is_dir() else 0)):
            raise UsageError(
                f"--out {run_dir}: {path} cannot be written (read-only, or another user's): "
                "the run writes its checkpoints and records there; make it writable or pass "
                "another --out"
            )


def _check_contents(run_dir: Path, *, resume: bool, overwrite: bool) -> None:
    if resume and overwrite:
        raise UsageError(OVERWRITE_AND_RESUME)
    held = sorted(p.name for p in run_dir.iterdir() if p.name != LOCK_FILE)
    if not held or resume:
        return
    if not overwrite:
        raise UsageError(
            f"--out {run_dir} already holds a run ({_listed(held)}): pass --resume to continue "
            "it from its newest checkpoint, --overwrite to start over in it (deleting its "
            "checkpoints), or another --out"
        )
    if not is_gradsync_run(run_dir):
        doomed = [name for name in RUN_STATE if (run_dir / name).exists()]
        would = f"would have deleted {_listed(doomed)}" if doomed else "would have written over it"
        raise UsageError(
            f"--out {run_dir} holds {_listed(held)} but no gradsync run (no config.json of "
            f"gradsync run, no {CHECKPOINT_DIR}/step-*/{MANIFEST}): --overwrite {would}, and "
            "deletes only what gradsync wrote; move those files away, or pass another --out"
        )
    _delete_run_state(run_dir)


def _listed(names: list[str]) -> str:
    return ", ".join(names[:5]) + (", ..." if len(names) > 5 else "")


def is_gradsync_run(run_dir: Path) -> bool:
    """Whether ``run_dir`` holds what gradsync wrote: the config.json of ``gradsync run``, a
    comparison's compare.json or its runs, or a committed checkpoint (a step directory with its
    manifest)."""
    if _has_run_config(run_dir) or (run_dir / COMPARE_FILE).is_file():
        return True
    checkpoints = run_dir / CHECKPOINT_DIR
    if checkpoints.is_dir() and any(
        _STEP_DIR.match(p.name) and (p / MANIFEST).is_file() for p in checkpoints.iterdir()
    ):
        return True
    # A comparison stopped before its compare.json: its strategies' runs, one per directory
    return any(_has_run_config(p) for p in run_dir.iterdir() if p.is_dir())


def _has_run_config(run_dir: Path) -> bool:
    try:
        data = json.loads((run_dir / "config.json").read_bytes())
    except (OSError, ValueError):
        return False  # absent, unreadable or not JSON: not gradsync's
    if not isinstance(data, dict) or not data.keys() >= RUN_CONFIG_KEYS:
        return False
    return any(data.keys() >= ran for ran in RAN_KEYS)


def _delete_run_state(run_dir: Path) -> None:
    """What a fresh run replaces: the metrics and fault markers, and in ``checkpoints/`` the
    step directories and logs gradsync writes there; anything else the user put in
    ``checkpoints/`` stays (and so does the directory, then). The same in any directory of
    the run's that holds gradsync's checkpoints: a script's ``sync.save("{run_dir}/ckpt")``
    (docs/your-script.md) resumed from them after ``--overwrite``, repeating the old run's
    results without a step trained (a tester's finding)."""
    for name in RUN_STATE:
        target = run_dir / name
        if name == CHECKPOINT_DIR and target.is_dir() and not target.is_symlink():
            _delete_checkpoints(target)
        elif target.exists() or target.is_symlink():
            _remove(target)
    for entry in run_dir.iterdir():
        if entry.is_dir() and not entry.is_symlink() and _holds_checkpoints(entry):
            _delete_checkpoints(entry)


def _holds_checkpoints(directory: Path) -> bool:
    """Whether ``directory`` holds a checkpoint gradsync wrote (a step directory with its
    manifest)."""
    return any(_STEP_DIR.match(p.name) and (p / MANIFEST).is_file() for p in directory.iterdir())


def _delete_checkpoints(directory: Path) -> None:
    """The step directories and logs gradsync writes in a checkpoint directory; the directory
    too, once nothing else is in it."""
    for entry in directory.iterdir():
        if _STEP_DIR.match(entry.name) or entry.name in (ROW_LOG_DIR, LOCK_DIR):
            _remove(entry)
    if not any(directory.iterdir()):
        directory.rmdir()


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path)
    else:
        path.unlink(missing_ok=True)


__all__ = [
    "COMPARE_FILE",
    "LOCK_FILE",
    "OVERWRITE_AND_RESUME",
    "RunDirectory",
    "claim",
    "is_gradsync_run",
]
