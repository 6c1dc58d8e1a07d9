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
import os
import re
import signal
import socket
import subprocess
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.checkpoint import CheckpointError, CheckpointStore
from gradsync.checkpoint.store import snapshot
from gradsync.checkpoint.writer_child import send_message
from gradsync.checkpoint.writer_locks import wait_for_writers
from gradsync.checkpoint.writer_process import (
    FILES_EVERY,
    ProcessCheckpointWriter,
    process_writer_available,
)
from gradsync.checkpoint.writer_thread import CheckpointWriter
from gradsync.progress import read_heartbeat
from tests.proctree import PROC, Watched, descendants, start_run, watch_until_exit

needs_linux = pytest.mark.skipif(not process_writer_available(), reason="needs Linux memfd")
TIMEOUT_S = 3.0  # the writers' timeout_s: short, what is tested is that it bounds the wait
BOUND_S = 30.0  # generous: what a failure may take on a loaded 2-core machine


def _gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.02)
    return False


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
@pytest.mark.ranks
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
    assert failed_at <= 45 and took < BOUND_S, (failed_at, took, message)
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
    assert _gone(int(heir.group(1))), "the writer that took over is still running"


def _in_thread(call: Any) -> tuple[threading.Thread, list[BaseException]]:
    """``call()`` in a thread (a hang must fail the test, not hang it); what it raised."""
    raised: list[BaseException] = []

    def run() -> None:
        try:
            call()
        except BaseException as exc:  # noqa: BLE001 - looked at by the test
            raised.append(exc)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, raised


@needs_linux
@pytest.mark.ranks
@pytest.mark.timeout(120)
def test_a_stopped_writer_fails_its_rank_within_the_timeout_and_is_continued_on_exit(
    tmp_path: Path,
) -> None:
    """SIGSTOP a rank's writer: its saves go on (held in memory) until ``depth`` files wait for
    it, then the next one fails after ``timeout_s`` naming the process and its state, as does a
    flush; as the rank exits the writer is continued, writes what it was handed and ends."""
    (writer,) = _writers(tmp_path, 1, files_every=4)
    pid = writer._child.pid
    _save(writer, 1)
    writer.wait(1)
    os.kill(pid, signal.SIGSTOP)
    stopped = time.monotonic()
    try:

        def save_until_it_fails() -> None:
            # 5 and 9 are files (every 4th), the others held: then 10 finds no room
            for step in range(2, 40):
                _save(writer, step)

        thread, raised = _in_thread(save_until_it_fails)
        thread.join(BOUND_S)
        took = time.monotonic() - stopped
        assert not thread.is_alive(), f"a save still waits for the stopped writer after {took}"
        assert len(raised) == 1 and isinstance(raised[0], CheckpointError), raised
        assert TIMEOUT_S <= took < BOUND_S
        assert str(raised[0]) == (
            f"rank 0: no room for the checkpoint snapshot of step 10: the checkpoint writer "
            f"process (pid {pid}) wrote none of the 2 before it (steps 5, 9) in 3 s; it is "
            "stopped (SIGSTOP or SIGTSTP)"
        )
        started = time.monotonic()
        with pytest.raises(CheckpointError) as flushed:
            writer.flush()
        assert time.monotonic() - started < BOUND_S
        assert f"steps 5, 8, 9 not written by the checkpoint writer process (pid {pid}); it " in (
            str(flushed.value)
        )
    finally:
        writer._finalizer()  # the rank exits: its stopped writer is continued, not left
    assert _gone(pid), "the stopped writer was left behind"
    # 5 and 9 written once it went on (8 was older than 9: not written, as at a rank's death),
    # and 1 kept as the newest durable checkpoint
    assert [int(p.name[5:]) for p in sorted(tmp_path.glob("step-*"))] == [1, 5, 9]


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_stalled_disk_fails_the_thread_writer_s_save_within_the_timeout(
    tmp_path: Path,
) -> None:
    store = CheckpointStore(tmp_path)
    disk = threading.Event()
    real_write = store.write

    def stalled_write(*args: Any, **kwargs: Any) -> Path:
        disk.wait(60)
        return real_write(*args, **kwargs)

    store.write = stalled_write  # type: ignore[method-assign]
    writer = CheckpointWriter(store, rank=1, world_size=2, save_id="x", timeout_s=TIMEOUT_S)
    try:
        for step in (1, 2, 3):  # one being written, two queued
            writer.submit(step, snapshot({"w": torch.ones(1)}))
        started = time.monotonic()
        thread, raised = _in_thread(lambda: writer.submit(4, snapshot({"w": torch.ones(1)})))
        thread.join(BOUND_S)
        assert not thread.is_alive(), "the save still waits for the stalled disk"
        assert TIMEOUT_S <= time.monotonic() - started < BOUND_S
        assert len(raised) == 1 and str(raised[0]) == (
            "rank 1: no room for the checkpoint snapshot of step 4: the checkpoint writer "
            "thread wrote none of the 2 before it (steps 2, 3) in 3 s; it is still busy (a "
            "stalled disk?)"
        ), raised
    finally:
        disk.set()
        writer.close()


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_message_to_a_process_that_reads_nothing_times_out() -> None:
    """A stopped writer reads nothing: its socket fills after a few packets, and a send must
    fail within its timeout rather than wait for ever."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    try:
        started = time.monotonic()
        with pytest.raises(TimeoutError, match="no room to send in 0.2 s"):
            for _ in range(10_000):
                send_message(ours, ("flush", 1), timeout_s=0.2)
        assert time.monotonic() - started < BOUND_S
    finally:
        ours.close()
        theirs.close()


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
) -> None:
    """Send rank ``rank``'s writer process ``sig`` as soon as rank 0's heartbeat says
    ``step`` steps are done (it is rewritten every 10 steps: ``step`` is one of those)."""
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


@needs_linux
@pytest.mark.e2e
@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("strategy", "rank"),
    [("bsp", 0), ("bsp", 1), ("async", 2)],
    ids=["rank-0-s-writer", "rank-1-s-writer", "async-server-s-writer"],
)
def test_a_killed_writer_process_costs_the_run_a_step_or_two(
    tmp_path: Path, strategy: str, rank: int
) -> None:
    """``gradsync run`` with a checkpoint every step: SIGKILL a rank's writer process mid-run
    (under ``async``, the parameter server's, rank 2); the rank fails and the elastic restart
    resumes within 2 steps of the newest step any rank had saved when it failed, which is the
    kill's step or after (the run resumed at step 1 before: only step 1's file was ever
    committed), and the run completes. The steps around the kill are slowed (a sleep of 10
    times their compute) so that it lands before step 64."""
    out = tmp_path / "run"
    proc = start_run(
        *("--nproc", "2", "--workload", "mlp", "--steps", "70", "--checkpoint-every", "1"),
        *("--strategy", strategy),
        *("--max-restarts", "1", "--timeout", "30", "--slow", f"0:10@{KILL_AT - 10}-62"),
        *("--no-plots", "--no-progress", "--out", str(out)),
    )
    watched = Watched()
    try:
        _signal_writer_at(proc, watched, out, rank, KILL_AT, signal.SIGKILL)
    finally:
        rc, stderr = _finish(proc, watched, wait_s=200)
    assert rc == 0, stderr[-3000:]
    resumed = [int(s) for s in re.findall(r"restart: resuming at step (\d+)", stderr)]
    assert len(resumed) == 1, stderr[-3000:]
    # steps some rank's writer wrote at the failure, not every rank's: newer than the resume
    skipped = [int(s) for s in re.findall(r"skipping checkpoint \S*step-(\d+): ", stderr)]
    newest = max([resumed[0], *skipped])
    assert KILL_AT <= newest < 64, stderr[-3000:]
    assert newest - resumed[0] <= 2, stderr[-3000:]


@needs_linux
@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_stopped_writer_process_ends_the_run_within_its_timeout_and_leaves_nothing(
    tmp_path: Path,
) -> None:
    """SIGSTOP rank 0's writer process early in a long run with a checkpoint every step and
    no restarts: the run fails (it hung before, with no message) within its --timeout of the
    save that finds no room, naming the writer, and nothing of it is left, the stopped writer
    included. Rank 1 sleeps a little at each step from 120 on, so that it is still within its
    own --timeout, waiting for rank 0 in a collective, when rank 0's save fails."""
    out, timeout_s = tmp_path / "run", 6
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
    assert exited == rc == 1, stderr[-3000:]
    assert took < timeout_s + 30, stderr[-3000:]
    assert re.search(
        r"rank 0 failed \(exit code 1\): CheckpointError: rank 0: no room for the checkpoint "
        r"snapshot of step \d+: the checkpoint writer process \(pid \d+\) wrote none .*; it is "
        r"stopped \(SIGSTOP or SIGTSTP\)",
        stderr,
    ), stderr[-3000:]
