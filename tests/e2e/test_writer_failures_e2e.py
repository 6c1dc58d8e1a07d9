"""A checkpoint writer process killed or stopped under ``gradsync run``: a kill costs the run a
step or two; a stopped writer ends the run within its timeout and leaves nothing running."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from gradsync.progress import read_heartbeat
from tests.support.overlap import Overlapped, overlapped
from tests.support.proctree import PROC, Watched, descendants, start_run, watch_until_exit
from tests.support.writer_failures import needs_linux

pytestmark = pytest.mark.e2e


# -- end to end: gradsync run -----------------------------------------------------------------


def _writer_processes(root: int) -> dict[int, int]:
    """rank -> pid of each checkpoint writer process under ``root``, known by the lock it
    holds for its life (``DIR/.writers/<save_id>.rank-<R>.lock``)."""
    found = {}
    for pid in descendants(root):
        with contextlib.suppress(OSError):
            if (
                b"gradsync.checkpoint.writer_child"
                not in (PROC / str(pid) / "cmdline").read_bytes()
            ):
                continue
            for fd in os.listdir(PROC / str(pid) / "fd"):
                with contextlib.suppress(OSError):
                    lock = re.search(
                        r"\.rank-(\d+)\.lock$", os.readlink(PROC / str(pid) / "fd" / fd)
                    )
                    if lock:
                        found[int(lock.group(1))] = pid
    return found


def _heartbeat_step(out: Path) -> int:
    beat = read_heartbeat(out)
    return int(beat["step"]) if beat else -1


def _signal_writer_at(
    proc: subprocess.Popen[str], watched: Watched, out: Path, rank: int, step: int, sig: int
) -> int:
    """Send rank ``rank``'s writer process ``sig`` as soon as rank 0's heartbeat says
    ``step`` steps are done (it is rewritten every 10 steps: ``step`` is one of those);
    returns its pid."""
    deadline = time.monotonic() + 120
    writer = None
    while writer is None:  # the writers start with the first save
        assert proc.poll() is None and time.monotonic() < deadline, "no writer process found"
        watched.sample(proc.pid)
        if _heartbeat_step(out) >= 1:
            writer = _writer_processes(proc.pid).get(rank)
        time.sleep(0.05)
    while _heartbeat_step(out) < step:
        assert proc.poll() is None and time.monotonic() < deadline, f"step {step} never came"
        time.sleep(0.001)
    os.kill(writer, sig)
    return writer


def _finish(proc: subprocess.Popen[str], watched: Watched, wait_s: float) -> tuple[int | None, str]:
    """Until the run exits (its code, None past ``wait_s``), then what is left of it is killed
    (a failed test leaves nothing); its stderr."""
    rc = watch_until_exit(proc, watched, timeout_s=wait_s)
    left = watched.survivors()
    deadline = time.monotonic() + 10
    while left and time.monotonic() < deadline:  # a writer may still be ending
        time.sleep(0.05)
        left = watched.survivors()
    described = [_describe(pid) for pid in left]
    watched.kill_all()
    proc.kill()
    _, stderr = proc.communicate(timeout=30)
    assert left == [], f"processes of the run still alive after it exited: {described}"
    return rc, stderr


def _describe(pid: int) -> str:
    try:
        state = (PROC / str(pid) / "stat").read_bytes().rsplit(b")", 1)[1].split()[0].decode()
        cmd = (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return f"{pid} (gone)"
    return f"{pid} (state {state}): {cmd[:150]}"


#: rank 0's heartbeat step at which a writer is killed: it is rewritten every 10 steps and runs
#: behind the steps, so the kill lands some steps later (under 64, where steps 2..63 are all
#: held in memory: only step 1's is a file)
KILL_AT = 20


#: the killed writers' runs: (strategy, rank whose writer is killed); rank 1's writer (no
#: commits of its own) dies in tests/ranks/test_writer_failures.py; here rank 0's, which
#: commits every rank's files, and a parameter server's
KILLED = {"rank-0-s-writer": ("bsp", 0), "async-server-s-writer": ("async", 2)}
#: the stopped writer's run's --timeout
STOPPED_TIMEOUT_S = 6


@dataclass(frozen=True)
class Killed:
    """How a run whose writer was SIGKILLed ended: its exit code, stderr, the writer's pid."""

    rc: int | None
    stderr: str
    writer: int


@dataclass(frozen=True)
class Stopped:
    """How a run whose writer was SIGSTOPped ended: the exit code seen within the bound, the
    run's exit code, stderr, and the seconds from the stop to its exit."""

    exited: int | None
    rc: int | None
    stderr: str
    took: float


def _kill_a_writer(out: Path, strategy: str, rank: int) -> Killed:
    """A run with a checkpoint every step whose rank ``rank``'s writer is SIGKILLed at
    KILL_AT, the steps around the kill slowed; restarted once."""
    proc = start_run(
        *("--nproc", "2", "--workload", "mlp", "--steps", "70", "--checkpoint-every", "1"),
        *("--strategy", strategy),
        *("--max-restarts", "1", "--timeout", "30", "--slow", f"0:10@{KILL_AT - 10}-62"),
        *("--no-plots", "--no-progress", "--out", str(out)),
    )
    watched = Watched()
    writer = -1
    try:
        writer = _signal_writer_at(proc, watched, out, rank, KILL_AT, signal.SIGKILL)
    finally:
        rc, stderr = _finish(proc, watched, wait_s=200)
    return Killed(rc, stderr, writer)


def _stop_a_writer(out: Path) -> Stopped:
    """A long run with a checkpoint every step and no restarts whose rank 0's writer is
    SIGSTOPped early; rank 1 sleeps a little at each step from 120 on."""
    timeout_s = STOPPED_TIMEOUT_S
    proc = start_run(
        *("--nproc", "2", "--workload", "mlp", "--steps", "5000", "--checkpoint-every", "1"),
        *("--timeout", str(timeout_s), "--slow", "1:20@120", "--no-plots", "--no-progress"),
        *("--out", str(out)),
    )
    watched = Watched()
    try:
        _signal_writer_at(proc, watched, out, 0, 10, signal.SIGSTOP)
        stopped = time.monotonic()
        # steps 65 and 129 wait for it, the snapshot of 130 finds no room: a second or two
        # from the stop, then the --timeout
        exited = watch_until_exit(proc, watched, timeout_s=timeout_s + 60)
        took = time.monotonic() - stopped
    finally:
        rc, stderr = _finish(proc, watched, wait_s=0)
    return Stopped(exited, rc, stderr, took)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Overlapped]:
    """The file's three runs at once (tests/support/overlap.py): each mostly waits (the
    slowed steps around a kill, the restart; a stopped writer's --timeout), and the waits
    overlap. Each is its own ``gradsync run``, with its own ports and directory."""
    launches: dict[str, Callable[[], Any]] = {
        name: functools.partial(
            _kill_a_writer, tmp_path_factory.mktemp("killed-writer") / "run", *case
        )
        for name, case in KILLED.items()
    }
    launches["stopped"] = functools.partial(
        _stop_a_writer, tmp_path_factory.mktemp("stopped-writer") / "run"
    )
    with overlapped(launches) as out:
        yield out


@needs_linux
@pytest.mark.timeout(300)
@pytest.mark.parametrize(("strategy", "rank"), list(KILLED.values()), ids=list(KILLED))
def test_a_killed_writer_process_costs_the_run_a_step_or_two(
    runs: Overlapped, strategy: str, rank: int
) -> None:
    """``gradsync run`` with a checkpoint every step: SIGKILL a rank's writer process mid-run
    (under ``async``, the parameter server's, rank 2); the rank fails and the elastic restart
    resumes within 2 steps of the newest step any rank had saved when it failed, which is the
    kill's step or after (the run resumed at step 1 before: only step 1's file was ever
    committed), and the run completes. The steps around the kill are slowed (a sleep of 10
    times their compute) so that it lands before step 64. The restarted attempt's output names
    the writer's death, as a run without restarts does (it showed only "worker process N exited
    with code 1")."""
    name = next(name for name, case in KILLED.items() if case == (strategy, rank))
    run = runs.result(name)
    rc, stderr, writer = run.rc, run.stderr, run.writer
    assert rc == 0, stderr[-3000:]
    died = f"rank {rank}: the checkpoint writer process (pid {writer}) died: it exited with code -9"
    assert f"{died} (killed by SIGKILL)" in stderr, stderr[-3000:]
    resumed = [int(s) for s in re.findall(r"restart: resuming at step (\d+)", stderr)]
    assert len(resumed) == 1, stderr[-3000:]
    # steps some rank's writer wrote at the failure, not every rank's: newer than the resume
    skipped = [int(s) for s in re.findall(r"skipping checkpoint \S*step-(\d+): ", stderr)]
    newest = max([resumed[0], *skipped])
    assert KILL_AT <= newest < 64, stderr[-3000:]
    assert newest - resumed[0] <= 2, stderr[-3000:]


@needs_linux
@pytest.mark.timeout(300)
def test_a_stopped_writer_process_ends_the_run_within_its_timeout_and_leaves_nothing(
    runs: Overlapped,
) -> None:
    """SIGSTOP rank 0's writer process early in a long run with a checkpoint every step and
    no restarts: the run fails (it hung before, with no message) within its --timeout of the
    save that finds no room, naming the writer, and nothing of it is left, the stopped writer
    included. Rank 1 sleeps a little at each step from 120 on, so that it is still within its
    own --timeout, waiting for rank 0 in a collective, when rank 0's save fails."""
    run = runs.result("stopped")
    exited, rc, stderr, took = run.exited, run.rc, run.stderr, run.took
    assert exited == rc == 1, stderr[-3000:]
    assert took < STOPPED_TIMEOUT_S + 30, stderr[-3000:]
    assert re.search(
        r"rank 0 failed \(exit code 1\): CheckpointError: rank 0: no room for the checkpoint "
        r"snapshot of step \d+: the checkpoint writer process \(pid \d+\) wrote none .*; it is "
        r"stopped \(SIGSTOP or SIGTSTP\)",
        stderr,
    ), stderr[-3000:]
