"""A background checkpoint writer that dies or stops (``gradsync.checkpoint.writer_process``).

A writer process killed (SIGKILL) fails its rank at its next call, naming the process and the
signal, and what it had not written, the snapshots held in memory above all, is written by
another writer process: the restart resumes from about the step of the kill, not from the last
of the files written every ``FILES_EVERY`` steps (up to 64 steps back, or from the start when
it was rank 0's writer). A stopped writer (SIGSTOP), or a stalled disk, fails the rank within
``timeout_s`` naming it, rather than hanging it, and is continued as the rank lets it go, so
that nothing is left running."""

from __future__ import annotations

import contextlib
import functools
import os
import re
import signal
import socket
import subprocess
import time
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.checkpoint import CheckpointError, CheckpointStore
from gradsync.checkpoint.store import snapshot
from gradsync.checkpoint.writer_locks import wait_for_writers
from gradsync.checkpoint.writer_process import (
    FILES_EVERY,
    ProcessCheckpointWriter,
)
from tests.support.overlap import Overlapped, overlapped
from tests.support.proctree import reaped_within
from tests.support.writer_failures import BOUND_S, TIMEOUT_S, in_thread, needs_linux

pytestmark = pytest.mark.ranks


def _writers(tmp_path: Path, world: int, files_every: int) -> list[ProcessCheckpointWriter]:
    return [
        ProcessCheckpointWriter(
            CheckpointStore(tmp_path, keep=2),
            rank=r,
            world_size=world,
            save_id="run",
            timeout_s=TIMEOUT_S,
            files_every=files_every,
        )
        for r in range(world)
    ]


def _save(writer: ProcessCheckpointWriter, step: int) -> None:
    weights = torch.full((20_000,), float(step))  # 80 KB: a shared buffer, not message bytes
    writer.submit(step, snapshot({"w": weights, "rank": writer.rank}, pool=writer.pool))


def _latest(directory: Path, world: int) -> int | None:
    with warnings.catch_warnings():  # newer steps some rank did not write are skipped
        warnings.simplefilter("ignore")
        info = CheckpointStore(directory).latest(world)
    return None if info is None else info.step


@needs_linux
@pytest.mark.timeout(120)
@pytest.mark.parametrize("dead", [0, 1], ids=["rank-0-s-writer", "rank-1-s-writer"])
def test_a_killed_writer_fails_its_rank_at_once_and_loses_no_held_step(
    tmp_path: Path, dead: int
) -> None:
    """Two ranks' writers saving every step, holding all but every ``FILES_EVERY``-th: rank
    ``dead``'s writer is killed at step 40, its rank fails at a next save, and both ranks then
    die (their sockets close, as when the processes exit). The newest committed checkpoint is
    then within a step or two of the failure: today's code left only step 1's."""
    assert FILES_EVERY > 40  # steps 2..40 are held in memory, not files
    writers = _writers(tmp_path, 2, FILES_EVERY)
    children = [w._child.pid for w in writers]
    failed_at, message = None, ""
    try:
        for step in range(1, 41):
            for w in writers:
                _save(w, step)
        os.kill(children[dead], signal.SIGKILL)
        killed = time.monotonic()
        for step in range(41, 80):
            try:
                _save(writers[dead], step)
            except CheckpointError as exc:
                failed_at, message = step, str(exc)
                break
            _save(writers[1 - dead], step)
            time.sleep(0.02)  # a step's time: the death is seen by the next save
        took = time.monotonic() - killed
    finally:
        for w in writers:  # the ranks die, no close: their writers write what they hold
            with contextlib.suppress(OSError):  # their sockets end, as when a process exits
                w._sock.shutdown(socket.SHUT_RDWR)
            w._finalizer()
    assert failed_at is not None, "the dead writer was never reported"
    # Seen at a save soon after the kill: how many 20 ms steps that is depends on the load
    # (up to 47 seen under a second test run on the 2 cores), so the bound in steps only
    # keeps it short of the next file (step 65); what no step may lose is checked below.
    assert failed_at <= 60 and took < BOUND_S, (failed_at, took, message)
    assert wait_for_writers(tmp_path, timeout_s=BOUND_S) == []  # every writer has ended
    for w in writers:
        w._child.wait(timeout=BOUND_S)
    latest = _latest(tmp_path, 2)
    assert latest is not None and latest >= failed_at - 2, (latest, failed_at, message)
    state = CheckpointStore(tmp_path).load(CheckpointStore(tmp_path).at(latest), dead)
    assert torch.equal(state["w"], torch.full((20_000,), float(latest)))
    assert re.search(
        rf"rank {dead}: the checkpoint writer process \(pid {children[dead]}\) died: "
        r"it exited with code -9 \(killed by SIGKILL\)",
        message,
    ), message
    heir = re.search(r"another writer process \(pid (\d+)\) writes the snapshots of steps", message)
    assert heir is not None, message
    assert reaped_within(int(heir.group(1))), "the writer that took over is still running"


def _stop_a_writer(tmp_path: Path) -> dict[str, Any]:
    """SIGSTOP a rank's writer: its saves go on (held in memory) until ``depth`` files wait
    for it, then the next one fails after ``timeout_s``, as does a flush; as the rank exits
    the writer is continued. What was seen, which
    ``test_a_stopped_writer_fails_its_rank_within_the_timeout_and_is_continued_on_exit``
    checks."""
    (writer,) = _writers(tmp_path, 1, files_every=4)
    pid = writer._child.pid
    seen: dict[str, Any] = {"pid": pid, "flushed": None}
    _save(writer, 1)
    writer.wait(1)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:

        def save_until_it_fails() -> None:
            # 5 and 9 are files (every 4th), the others held: then 10 finds no room
            for step in range(2, 40):
                _save(writer, step)

        thread, raised = in_thread(save_until_it_fails)
        thread.join(BOUND_S)
        seen["took"] = time.monotonic() - stopped
        seen["saving"] = thread.is_alive()
        seen["raised"] = list(raised)
        if not seen["saving"]:
            started = time.monotonic()
            try:
                writer.flush()
            except CheckpointError as exc:
                seen["flushed"] = exc
            seen["flush_took"] = time.monotonic() - started
    finally:
        writer._finalizer()  # the rank exits: its stopped writer is continued, not left
    # Continued, it writes steps 5 and 9 before it ends, at SCHED_IDLE. The finalizer waits
    # 0.05 s to reap it, so on busy cores (twice in CI) it ends after that as a zombie of this
    # process, which nothing else reaps and ``reaped_within`` counts as running: wait for it.
    with contextlib.suppress(subprocess.TimeoutExpired):
        writer._child.wait(timeout=60)
    seen["returncode"] = writer._child.returncode
    seen["files"] = [int(p.name[5:]) for p in sorted(tmp_path.glob("step-*"))]
    return seen


def _stop_a_peer_s_writer(tmp_path: Path, rank_0: str) -> dict[str, Any]:
    """SIGSTOP rank 1's writer; rank 0's commit of step 5 passes its deadline; then rank 0
    dies or closes its writer, and rank 1 dies. What was seen, which
    ``test_a_peer_s_writer_stopped_past_the_commit_deadline_loses_only_the_steps_in_flight``
    checks."""
    writers = _writers(tmp_path, 2, files_every=4)
    stopped = writers[1]._child.pid
    seen: dict[str, Any] = {"closed": None}
    try:
        for w in writers:
            _save(w, 1)
        for w in writers:
            w.wait(1)
        os.kill(stopped, signal.SIGSTOP)
        for step in range(2, 10):  # 5 and 9 are files, the others held
            for w in writers:
                _save(w, step)
        deadline = time.monotonic() + BOUND_S
        while writers[0]._error is None and time.monotonic() < deadline:
            time.sleep(0.05)
        seen["error"] = writers[0]._error
        if rank_0 == "closes" and "checkpoint of step 5 " in str(seen["error"]):
            try:
                writers[0].close(TIMEOUT_S)
            except CheckpointError as exc:
                seen["closed"] = exc
            else:
                seen["closed"] = "close() raised nothing"
            time.sleep(1.0)  # rank 1 fails a moment later, as the run stops it
    finally:
        for w in writers:  # the ranks die, no close: rank 1's writer is continued
            with contextlib.suppress(OSError):
                w._sock.shutdown(socket.SHUT_RDWR)
            w._finalizer()
    seen["left"] = wait_for_writers(tmp_path, timeout_s=BOUND_S)
    seen["latest"] = _latest(tmp_path, 2)
    return seen


#: the stopped writers' cases (each waits out TIMEOUT_S, or more, and nothing in it works)
PEER_CASES = ["dies", "closes"]


@pytest.fixture(scope="module")
def stopped_writers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Overlapped]:
    """The three stopped-writer cases at once, each on a thread of its own
    (tests/support/overlap.py): each spends its seconds waiting out its writers' timeout_s,
    and the waits overlap; each has its own directory and writer processes, and what is timed
    in them is bounded by TIMEOUT_S from below and by BOUND_S (30 s) from above."""
    launches: dict[str, Callable[[], Any]] = {
        "own": functools.partial(_stop_a_writer, tmp_path_factory.mktemp("stopped-writer")),
    }
    for rank_0 in PEER_CASES:
        launches[f"peer, rank 0 {rank_0}"] = functools.partial(
            _stop_a_peer_s_writer, tmp_path_factory.mktemp(f"stopped-peer-{rank_0}"), rank_0
        )
    with overlapped(launches) as started:
        yield started


@needs_linux
@pytest.mark.timeout(120)
def test_a_stopped_writer_fails_its_rank_within_the_timeout_and_is_continued_on_exit(
    stopped_writers: Overlapped,
) -> None:
    """SIGSTOP a rank's writer: its saves go on (held in memory) until ``depth`` files wait for
    it, then the next one fails after ``timeout_s`` naming the process and its state, as does a
    flush; as the rank exits the writer is continued, writes what it was handed and ends."""
    seen = stopped_writers.result("own")
    pid, took, raised = seen["pid"], seen["took"], seen["raised"]
    assert not seen["saving"], f"a save still waits for the stopped writer after {took}"
    assert len(raised) == 1 and isinstance(raised[0], CheckpointError), raised
    assert TIMEOUT_S <= took < BOUND_S
    assert str(raised[0]) == (
        f"rank 0: no room for the checkpoint snapshot of step 10: the checkpoint writer "
        f"process (pid {pid}) wrote none of the 2 before it (steps 5, 9) in 3 s; it is "
        "stopped (SIGSTOP or SIGTSTP)"
    )
    assert isinstance(seen["flushed"], CheckpointError), seen["flushed"]  # the flush raised
    assert seen["flush_took"] < BOUND_S
    assert f"steps 5, 8, 9 not written by the checkpoint writer process (pid {pid}); it " in (
        str(seen["flushed"])
    )
    assert seen["returncode"] is not None, "the stopped writer was left behind"
    # 5 and 9 written once it went on (8 was older than 9: not written, as at a rank's death),
    # and 1 kept as the newest durable checkpoint
    assert seen["files"] == [1, 5, 9]


@needs_linux
@pytest.mark.timeout(120)
@pytest.mark.parametrize("rank_0", PEER_CASES)
def test_a_peer_s_writer_stopped_past_the_commit_deadline_loses_only_the_steps_in_flight(
    stopped_writers: Overlapped, rank_0: str
) -> None:
    """SIGSTOP rank 1's writer: rank 0's commit of step 5 passes its deadline (an error, which
    drops 9, the other step rank 0 wrote), then rank 0 dies or closes its writer (which raises
    that error), rank 1 dies, and rank 1's writer, continued, writes 5 and 9. Rank 0's writer
    commits 9, the newest step both ranks wrote: it once committed only steps it still had in
    hand, none, and a resume went back to step 1; closed, it ended at once."""
    seen = stopped_writers.result(f"peer, rank 0 {rank_0}")
    assert "checkpoint of step 5 " in str(seen["error"]), seen["error"]
    if rank_0 == "closes":  # close() raised that error
        assert isinstance(seen["closed"], CheckpointError), seen["closed"]
        assert "checkpoint of step 5 " in str(seen["closed"]), seen["closed"]
    assert seen["left"] == []  # every writer has ended
    assert seen["latest"] == 9
