"""A stopped worker (SIGSTOP: a hang from outside the process) ends `gradsync run` within its
--timeout plus a few seconds, with the stopped rank named and no process of the run left, where
torch's elastic agent alone waits 30 more seconds for the stopped worker to act on SIGTERM. And
a Ctrl-C ends it in one line, leaving nothing either; that run, a local one without restarts, is
also where tests/e2e/test_listen.py's check that such a run listens on loopback only is made."""

from __future__ import annotations

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

from gradsync.processes.reaper import workers
from tests.support.overlap import Overlapped, overlapped
from tests.support.proctree import (
    PROC,
    Watched,
    assert_listens_on_loopback_only,
    listeners_of,
    start_run,
    watch_until_exit,
)

pytestmark = pytest.mark.e2e

TIMEOUT_S = 4  # short: what is tested is the bound beyond it, not its length
GRACE_S = 5  # what the run may take beyond its --timeout to fail, report and exit


def _workers(root: int) -> list[int]:
    """The run's worker processes: forked from its forkserver, or spawned by it."""
    found = []
    for pid, parent in workers(root):
        try:
            cmd = (PROC / str(pid) / "cmdline").read_bytes()
        except OSError:
            continue
        if parent != root or b"spawn_main" in cmd:
            found.append(pid)
    return found


def _wait_for_training(proc: subprocess.Popen[str], watched: Watched, metrics: Path) -> None:
    """Until steps are being recorded (every rank is past its start-up)."""
    deadline = time.monotonic() + 120
    while not (metrics.exists() and metrics.stat().st_size > 0):
        assert proc.poll() is None, "the run ended before training started"
        assert time.monotonic() < deadline, "no step recorded in 120 s"
        watched.sample(proc.pid)
        time.sleep(0.1)
    watched.sample(proc.pid)


#: the strategies a worker is stopped under: bsp, and zero:3, where the survivor waits inside
#: FSDP2's gathers, in the user's forward
STRATEGIES = ["bsp", "zero:3"]


@dataclass(frozen=True)
class Stopped:
    """How a run with a stopped worker ended: its exit code and stderr, the seconds from the
    stop to its exit, and its processes left alive after the bound."""

    rc: int | None
    stderr: str
    took: float
    left: list[tuple[int, str]]


#: ``_stopped_run``'s worker: the one that serves the attempt's store (rank 0 under
#: --max-restarts)
STORE_SERVER = -2


def _store_server(ranks: list[int]) -> int:
    """Which of the 2 workers serves the attempt's store: the one listening on a socket more
    than the other (both listen for gloo). Not the first by pid, which wraps."""
    listening = {pid: len(listeners_of(pid)) for pid in ranks}
    assert len(set(listening.values())) == 2, listening
    return max(listening, key=lambda pid: listening[pid])


def _stop_a_worker(out: Path, strategy: str) -> Stopped:
    """A run under ``strategy`` whose last worker is SIGSTOPped once it trains."""
    return _stopped_run(
        out, ["--steps", "100000", "--strategy", strategy], -1, TIMEOUT_S + 60, TIMEOUT_S + GRACE_S
    )


def _stopped_run(
    out: Path, args: list[str], which: int, exit_within_s: float, left_within_s: float | None
) -> Stopped:
    """``gradsync run ARGS`` of the mlp on 2 workers whose worker ``which`` (in the order
    ``_workers`` finds them; :data:`STORE_SERVER`: the one serving the attempt's store) is
    SIGSTOPped once it trains; its processes left alive ``left_within_s`` after the stop (none
    looked for where None)."""
    proc = start_run(
        *("--nproc", "2", "--workload", "mlp", *args, "--timeout", str(TIMEOUT_S)),
        *("--no-plots", "--no-progress", "--out", str(out)),
    )
    watched = Watched()
    left: list[tuple[int, str]] = []
    try:
        _wait_for_training(proc, watched, out / "metrics.jsonl")
        ranks = _workers(proc.pid)
        assert len(ranks) == 2, ranks
        os.kill(_store_server(ranks) if which == STORE_SERVER else ranks[which], signal.SIGSTOP)
        stopped_at = time.monotonic()
        rc = watch_until_exit(proc, watched, timeout_s=exit_within_s)
        took = time.monotonic() - stopped_at
        if left_within_s is not None:
            left = _left_after(watched, stopped_at, left_within_s)
    finally:
        stderr = _end(proc, watched)
    return Stopped(rc, stderr, took, left)


@pytest.fixture(scope="module")
def stopped(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Overlapped]:
    """Both strategies' runs and the Ctrl-C'd one at once (tests/support/overlap.py): each
    stopped run waits out its --timeout after the stop, and the waits overlap; the Ctrl-C'd
    run is its own ``gradsync run`` with its own ports and directory, and is interrupted as
    soon as it trains."""
    runs: dict[str, Callable[[], Any]] = {
        strategy: functools.partial(
            _stop_a_worker, tmp_path_factory.mktemp("stopped") / "run", strategy
        )
        for strategy in STRATEGIES
    }
    runs["ctrl-c"] = functools.partial(_interrupt, tmp_path_factory.mktemp("ctrl-c") / "run")
    runs["rank 0, restarted"] = functools.partial(
        _stop_rank_0_serving_the_store, tmp_path_factory.mktemp("stopped-0") / "run"
    )
    with overlapped(runs) as out:
        yield out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_a_stopped_worker_ends_the_run_within_its_timeout_and_leaves_nothing(
    stopped: Overlapped, strategy: str
) -> None:
    run = stopped.result(strategy)
    rc, stderr, took, left = run.rc, run.stderr, run.took, run.left
    assert rc == 1, f"exit code {rc}: {stderr[-3000:]}"
    assert "never arrived: ranks [" in stderr, stderr[-3000:]
    assert took <= TIMEOUT_S + GRACE_S, f"exited {took:.1f}s after the stop: {stderr[-3000:]}"
    assert left == [], f"processes of the run still alive after it exited: {left}"


#: steps of the run whose rank 0 is stopped: enough that the stop lands in the first attempt
#: (it follows the first recorded step), few enough that the restarted one ends soon
RESTARTED_STEPS = 1500


def _stop_rank_0_serving_the_store(out: Path) -> Stopped:
    """A run with ``--max-restarts 1`` (each attempt's store served by its rank 0: no store
    shared by the agent) whose rank 0 is SIGSTOPped once it trains, to its end."""
    args = ["--steps", str(RESTARTED_STEPS), "--max-restarts", "1"]
    return _stopped_run(out, args, STORE_SERVER, 150, None)


@pytest.mark.timeout(240)
def test_a_stopped_rank_0_serving_the_store_fails_its_attempt_and_the_run_restarts(
    stopped: Overlapped,
) -> None:
    """Rank 0's process serves each attempt's store under ``--max-restarts``, and torch's store
    client never gives up on a stopped server: the survivor used to block in a store call for
    ever, and the run with it. Now it fails within about the timeout, naming the silent store
    and rank 0 (said before the restart, which shows no failed attempt's error by itself), and
    the restarted attempt completes the run."""
    run = stopped.result("rank 0, restarted")
    rc, stderr = run.rc, run.stderr
    assert rc == 0, f"exit code {rc}: {stderr[-3000:]}"
    said = re.search(r"gradsync: rank 1 failed, and the run restarts: SyncTimeoutError: .*", stderr)
    assert said is not None, stderr[-3000:]
    assert "has not answered a request" in said.group(0), said.group(0)
    assert "Rank 0's process is not running" in said.group(0), said.group(0)
    assert "restart: starting over" in stderr, stderr[-3000:]


def _left_after(watched: Watched, since: float, bound_s: float) -> list[tuple[int, str]]:
    """The run's processes still alive ``bound_s`` after ``since``, or none sooner. One may
    still be on its way out as the run's own process exits (a helper such as
    multiprocessing's resource tracker ends when its pipe closes): what matters is that
    nothing is left within the bound."""
    while watched.survivors() and time.monotonic() - since < bound_s:
        time.sleep(0.05)
    return [(pid, _command(pid)) for pid in watched.survivors()]


def _end(proc: subprocess.Popen[str], watched: Watched) -> str:
    """Kill whatever of the run is left (a failed test leaves nothing); the run's stderr."""
    watched.kill_all()
    proc.kill()
    _, stderr = proc.communicate(timeout=30)
    return stderr


def _command(pid: int) -> str:
    try:
        return (PROC / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
    except OSError:
        return "?"


@dataclass(frozen=True)
class Interrupted:
    """How a Ctrl-C'd run ended: its exit code and stderr, its processes left alive after the
    bound, and what was seen of its tree."""

    rc: int | None
    stderr: str
    left: list[tuple[int, str]]
    watched: Watched


def _interrupt(out: Path) -> Interrupted:
    """A terminal's Ctrl-C, once the run trains: SIGINT to the run's whole process group."""
    proc = start_run(
        *("--nproc", "2", "--workload", "mlp", "--steps", "100000", "--no-plots", "--no-progress"),
        *("--out", str(out)),
    )
    watched = Watched()
    try:
        _wait_for_training(proc, watched, out / "metrics.jsonl")
        os.killpg(proc.pid, signal.SIGINT)
        sent = time.monotonic()
        rc = watch_until_exit(proc, watched, timeout_s=60)
        left = _left_after(watched, sent, GRACE_S + 10)
    finally:
        stderr = _end(proc, watched)
    return Interrupted(rc, stderr, left, watched)


@pytest.mark.timeout(180)
def test_ctrl_c_ends_the_run_in_one_line_and_leaves_nothing(stopped: Overlapped) -> None:
    """And the run (local, no restarts) listened on loopback only (tests/e2e/test_listen.py):
    its stores and gloo's sockets open before its first step, which is seen before the Ctrl-C."""
    # A terminal's Ctrl-C: SIGINT to the run's whole process group. torch's agent turns it
    # into an exception of its own, which used to end the run with a traceback and exit 1.
    run = stopped.result("ctrl-c")
    rc, stderr, left = run.rc, run.stderr, run.left
    assert rc == 130, f"exit code {rc}: {stderr[-3000:]}"
    assert "gradsync: interrupted by SIGINT: the workers were stopped" in stderr, stderr[-3000:]
    assert "Traceback" not in stderr, stderr[-3000:]
    assert "death signal" not in stderr, stderr[-3000:]  # the agent's own line, said again
    assert left == [], f"processes of the run still alive after it exited: {left}"
    assert_listens_on_loopback_only(run.watched)
