"""How many more processes and threads ("tasks") this machine lets a run start, and what to say
when a run reaches that limit (issue 43, item 6).

Why a module of our own: every rank is a process with several threads (autograd's, gloo's,
gradsync's heartbeat and gate threads; with checkpoints, a writer process), and Linux counts
each task against two limits: the pids controller of the process's cgroup (``pids.max``, which
containers, CI sandboxes and systemd services set) and, for a user other than root,
``ulimit -u`` (``RLIMIT_NPROC``: every thread of every process of that user). At the limit a
thread or a process cannot be created, and the failure surfaces far from its cause: a rank
fails with ``RuntimeError: Resource temporarily unavailable`` (a C++ thread), ``RuntimeError:
can't start new thread`` (a Python one), or dies by SIGABRT where C++ cannot report it. Those
are the signatures of the runs the issue saw fail "under load"; all three came back here with a
2-rank run in a pids cgroup at ``pids.max`` 10, 14 and 17 (the run peaks at 19 tasks, 23 with a
checkpoint writer per rank). There is nothing to retry: the run needs those tasks. So a launch
checks the headroom first and refuses a run that cannot fit, naming the limit, and a run that
hits it anyway (another program took the headroom) is told which limit it hit. Neither torch
nor the standard library reads these limits for us.
"""

from __future__ import annotations

import os
import resource
import threading
from dataclasses import dataclass
from pathlib import Path

from gradsync.errors import UsageError

__all__ = [
    "LAUNCHER_TASKS",
    "TaskLimit",
    "check_room",
    "explain_failure",
    "limits",
    "needed",
]

#: Tasks a local launch takes besides its workers: the agent (5 threads), multiprocessing's
#: resource tracker and the workers' forkserver (1 each). Measured on a 2-rank mlp run.
LAUNCHER_TASKS = 7
#: Tasks of one training process with one intra-op thread, measured at its peak (6 threads).
#: A checkpoint writer adds a thread and a process; not counted, so that a run without
#: checkpoints is never refused for them.
RANK_TASKS = 6

#: What a rank's failure says when it could not create a thread or process.
SIGNATURES = ("resource temporarily unavailable", "can't start new thread", "sigabrt")


@dataclass(frozen=True)
class TaskLimit:
    """One limit on tasks: ``limit`` of them, ``in_use`` now, ``refused`` the times the kernel
    already refused a task for it (``pids.events``; None where it keeps no count)."""

    where: str
    limit: int
    in_use: int
    refused: int | None = None

    @property
    def room(self) -> int:
        return max(0, self.limit - self.in_use)

    def describe(self) -> str:
        return f"{self.where}: {self.in_use} of {self.limit} in use"


def needed(processes: int, threads: int = 1) -> int:
    """Tasks a launch of ``processes`` workers with ``threads`` intra-op threads each needs."""
    return LAUNCHER_TASKS + processes * (RANK_TASKS + threads - 1)


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    try:
        return int(text)
    except ValueError:
        return None  # "max": no limit here


def _refused(directory: Path) -> int | None:
    try:
        for line in (directory / "pids.events").read_text().splitlines():
            key, _, value = line.partition(" ")
            if key == "max":
                return int(value)
    except (OSError, ValueError):
        return None
    return None


def _pids_directory(proc: Path, cgroup_root: Path) -> tuple[Path, Path] | None:
    """This process's directory in the pids controller and that controller's root: cgroup v1
    (``N:pids:/path``, under ``pids/``) or v2 (``0::/path``, ``pids.max`` in the group's own
    directory)."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if "pids" in controllers.split(","):
            return cgroup_root / "pids" / path.lstrip("/"), cgroup_root / "pids"
    for line in lines:
        hierarchy, controllers, path = line.split(":", 2)
        if hierarchy == "0" and controllers == "":
            return cgroup_root / path.lstrip("/"), cgroup_root
    return None


def cgroup_limits(
    proc: Path = Path("/proc"), cgroup_root: Path = Path("/sys/fs/cgroup")
) -> list[TaskLimit]:
    """The ``pids.max`` of this process's cgroup and of every group above it that sets one
    (the kernel enforces each)."""
    found_at = _pids_directory(proc, cgroup_root)
    if found_at is None:
        return []
    directory, root = found_at
    found: list[TaskLimit] = []
    while True:
        limit = _read_int(directory / "pids.max")
        current = _read_int(directory / "pids.current")
        if limit is not None and current is not None:
            name = "/" + directory.relative_to(root).as_posix().strip(".")
            found.append(
                TaskLimit(f"cgroup {name} (pids.max)", limit, current, _refused(directory))
            )
        if directory == root or root not in directory.parents:
            return found
        directory = directory.parent


def _user_tasks(uid: int, proc: Path) -> int:
    """Threads of every process whose real user is ``uid`` (what RLIMIT_NPROC counts)."""
    total = 0
    for entry in proc.iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        try:
            if int(fields["Uid"].split()[0]) == uid:
                total += int(fields["Threads"].strip())
        except (KeyError, ValueError, IndexError):
            continue
    return total


def user_limit(proc: Path = Path("/proc")) -> TaskLimit | None:
    """``ulimit -u`` for this user, where it binds: not for root, not where unlimited."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NPROC)
    if soft == resource.RLIM_INFINITY or os.geteuid() == 0:
        return None
    uid = os.getuid()
    return TaskLimit(f"ulimit -u (RLIMIT_NPROC) of user {uid}", soft, _user_tasks(uid, proc))


def limits() -> list[TaskLimit]:
    """Every limit on this process's tasks that this machine sets (none on most desktops)."""
    found = cgroup_limits()
    user = user_limit()
    if user is not None:
        found.append(user)
    return found


_refused_at_start: dict[str, int | None] = {}


def check_room(processes: int, threads: int = 1) -> None:
    """Refuse (``UsageError``) a launch that the tightest limit leaves no room for, naming it;
    remember how often each limit had refused a task, for ``explain_failure``."""
    found = limits()
    _refused_at_start.clear()
    _refused_at_start.update({limit.where: limit.refused for limit in found})
    # this process's own threads are in use already, and it becomes the launcher's agent
    want = needed(processes, threads) - threading.active_count()
    short = [limit for limit in found if limit.room < want]
    if short:
        tightest = min(short, key=lambda limit: limit.room)
        raise UsageError(
            f"{processes} worker process(es) with {threads} thread(s) each need about {want} "
            f"more processes and threads, and this machine allows {tightest.room} more "
            f"({tightest.describe()}): a rank would fail to start a thread. Raise the limit, "
            "or run fewer processes (--nproc) or threads (--threads)"
        )


def explain_failure(messages: list[str]) -> str | None:
    """A line naming the limit a failed run reached, when it reached one: a limit that refused
    tasks since ``check_room``, or a rank's failure with the signature of a task it could not
    create while a limit has little room left. None otherwise."""
    found = limits()
    for limit in found:
        before = _refused_at_start.get(limit.where)
        if limit.refused is not None and before is not None and limit.refused > before:
            return (
                f"the run reached this machine's limit on processes and threads "
                f"({limit.describe()}; {limit.refused - before} refused during the run): a "
                "rank could not start a thread or a process. Raise the limit, or run fewer "
                "processes or threads"
            )
    if not any(sign in message.lower() for message in messages for sign in SIGNATURES):
        return None
    tight = [limit for limit in found if limit.room < needed(1)]
    if tight:
        return (
            f"a rank could not start a thread: this machine's limit on processes and threads "
            f"is nearly reached ({tight[0].describe()}). Raise the limit, or run fewer "
            "processes or threads"
        )
    return None
