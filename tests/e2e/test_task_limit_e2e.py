"""`gradsync run` in a cgroup whose pids.max leaves too little room (issue 43, item 6): refused
before it starts, naming the limit; and a run that passes that check but reaches the limit
later (a checkpoint writer per rank) fails naming it, where a rank used to fail with
"Resource temporarily unavailable" or "can't start new thread" or die by SIGABRT. Needs
root and the cgroup pids controller (v1), as on the project's CI machines; skipped elsewhere."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

pytestmark = pytest.mark.e2e

PIDS = Path("/sys/fs/cgroup/pids")


@contextlib.contextmanager
def _pids_group(limit: int) -> Iterator[Path]:
    if os.geteuid() != 0 or not os.access(PIDS, os.W_OK):
        pytest.skip("needs root and a writable cgroup v1 pids controller")
    group = PIDS / f"gradsync-test-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    try:
        (group / "pids.max").write_text(str(limit))
        yield group
    finally:
        deadline = time.monotonic() + 30
        while (group / "cgroup.procs").read_text().strip() and time.monotonic() < deadline:
            time.sleep(0.1)  # nothing of the run may be left in it
        leftover = (group / "cgroup.procs").read_text().split()
        with contextlib.suppress(OSError):
            group.rmdir()
        assert not leftover, f"processes of the run left in its cgroup: {leftover}"


def _run_in(group: Path, out: Path, *extra: str) -> subprocess.CompletedProcess[str]:
    def enter() -> None:  # in the child, before it runs anything: the run starts inside
        (group / "cgroup.procs").write_text(str(os.getpid()))

    command = [sys.executable, "-m", "gradsync", "run", "--nproc", "2", "--workload", "mlp"]
    command += ["--steps", "6", "--no-plots", "--no-progress", "--out", str(out), *extra]
    return subprocess.run(command, capture_output=True, text=True, timeout=150, preexec_fn=enter)


@pytest.mark.timeout(120)
def test_a_run_without_room_for_its_threads_is_refused_before_it_starts(tmp_path: Path) -> None:
    with _pids_group(10) as group:
        proc = _run_in(group, tmp_path / "run")
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert "this machine allows" in proc.stderr and "(pids.max): " in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr[-2000:]


@pytest.mark.timeout(180)
def test_a_run_that_reaches_the_limit_later_is_told_which(tmp_path: Path) -> None:
    # Room for the workers (about 19 tasks) but not for a checkpoint writer per rank (23).
    with _pids_group(20) as group:
        proc = _run_in(group, tmp_path / "run", "--checkpoint-every", "1")
    assert proc.returncode == 1, proc.stderr[-2000:]
    assert "the run reached this machine's limit on processes and threads" in proc.stderr, (
        proc.stderr[-2000:]
    )
    assert "refused during the run" in proc.stderr, proc.stderr[-2000:]
