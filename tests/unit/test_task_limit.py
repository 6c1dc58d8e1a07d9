"""The limits on a run's processes and threads (gradsync.processes.task_limit): read from a
cgroup tree laid out as the kernel's (v1 and v2) and from RLIMIT_NPROC; a launch without room is
refused naming the limit; a failed run that reached one is told so."""

from __future__ import annotations

import resource
from pathlib import Path

import pytest

from gradsync.errors import UsageError
from gradsync.processes import task_limit
from gradsync.processes.task_limit import TaskLimit

pytestmark = pytest.mark.unit


def _group(directory: Path, limit: str, current: int, refused: int = 0) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "pids.max").write_text(f"{limit}\n")
    (directory / "pids.current").write_text(f"{current}\n")
    (directory / "pids.events").write_text(f"max {refused}\n")


def _proc(tmp_path: Path, cgroup_line: str) -> Path:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text(f"3:cpu:/\n{cgroup_line}\n1:memory:/x\n")
    return proc


def test_a_v1_pids_group_and_every_limit_above_it_are_read(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _group(root / "pids" / "ci", "40", 30, refused=2)
    _group(root / "pids" / "ci" / "job", "max", 12)  # no limit of its own: not listed
    proc = _proc(tmp_path, "8:pids:/ci/job")
    found = task_limit.cgroup_limits(proc, root)
    assert found == [TaskLimit("cgroup /ci (pids.max)", 40, 30, 2)]
    assert found[0].room == 10


def test_a_v2_group_is_read_where_the_unified_hierarchy_puts_it(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    _group(root / "user.slice" / "run", "25", 3)
    proc = _proc(tmp_path, "0::/user.slice/run")
    (proc / "self" / "cgroup").write_text("0::/user.slice/run\n")
    assert task_limit.cgroup_limits(proc, root) == [
        TaskLimit("cgroup /user.slice/run (pids.max)", 25, 3, 0)
    ]


def test_no_pids_controller_means_no_limit(tmp_path: Path) -> None:
    proc = _proc(tmp_path, "5:devices:/")
    assert task_limit.cgroup_limits(proc, tmp_path / "cgroup") == []
    assert task_limit.cgroup_limits(tmp_path / "nowhere", tmp_path / "cgroup") == []


def test_rlimit_nproc_counts_the_users_threads_and_spares_root(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    proc = tmp_path / "proc"
    for pid, uid, threads in ((11, 1000, 4), (12, 1000, 7), (13, 0, 50)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "status").write_text(
            f"Name:\tx\nUid:\t{uid}\t{uid}\nThreads:\t{threads}\n"
        )
    monkeypatch.setattr(resource, "getrlimit", lambda which: (64, 128))
    monkeypatch.setattr(task_limit.os, "getuid", lambda: 1000)
    monkeypatch.setattr(task_limit.os, "geteuid", lambda: 1000)
    assert task_limit.user_limit(proc) == TaskLimit("ulimit -u (RLIMIT_NPROC) of user 1000", 64, 11)
    monkeypatch.setattr(task_limit.os, "geteuid", lambda: 0)
    assert task_limit.user_limit(proc) is None  # root is not held to it
    monkeypatch.setattr(task_limit.os, "geteuid", lambda: 1000)
    monkeypatch.setattr(resource, "getrlimit", lambda which: (resource.RLIM_INFINITY,) * 2)
    assert task_limit.user_limit(proc) is None


def test_a_launch_without_room_is_refused_naming_the_tightest_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limits = [
        TaskLimit("cgroup /a (pids.max)", 100, 95),
        TaskLimit("cgroup /b (pids.max)", 100, 90),
    ]
    monkeypatch.setattr(task_limit, "limits", lambda: limits)
    # the launcher's own threads count as in use: this process's are whatever earlier tests left
    monkeypatch.setattr(task_limit.threading, "active_count", lambda: 1)
    with pytest.raises(UsageError, match=r"allows 5 more \(cgroup /a \(pids\.max\): 95 of 100"):
        task_limit.check_room(2)
    monkeypatch.setattr(task_limit, "limits", lambda: [TaskLimit("cgroup /a", 100, 60)])
    task_limit.check_room(2)  # 40 of room for about 19
    with pytest.raises(UsageError, match="--nproc"):
        task_limit.check_room(8)


def test_needed_grows_with_processes_and_their_threads() -> None:
    assert task_limit.needed(2) == task_limit.LAUNCHER_TASKS + 2 * task_limit.RANK_TASKS
    assert task_limit.needed(2, threads=4) == task_limit.needed(2) + 2 * 3


def test_a_failure_is_put_down_to_a_limit_that_refused_tasks_during_the_run(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(task_limit, "limits", lambda: [TaskLimit("cgroup /a", 40, 10, 3)])
    task_limit.check_room(1)
    monkeypatch.setattr(task_limit, "limits", lambda: [TaskLimit("cgroup /a", 40, 12, 5)])
    line = task_limit.explain_failure(["rank 0 failed (exit code 1): ValueError: x"])
    assert line is not None and "2 refused during the run" in line and "cgroup /a" in line


def test_a_failure_with_the_signature_is_put_down_to_a_nearly_full_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(task_limit, "limits", lambda: [TaskLimit("ulimit -u", 64, 60)])
    monkeypatch.setattr(task_limit, "_refused_at_start", {})
    why = "rank 1 failed (exit code 1): RuntimeError: Resource temporarily unavailable"
    line = task_limit.explain_failure([why])
    assert line is not None and "ulimit -u: 60 of 64 in use" in line
    assert task_limit.explain_failure(["rank 1 failed (exit code 1): ValueError: bad"]) is None
    monkeypatch.setattr(task_limit, "limits", lambda: [TaskLimit("ulimit -u", 640, 60)])
    assert task_limit.explain_failure([why]) is None  # room enough: not the cause
