"""The background checkpoint writer as a child process (``gradsync.checkpoint.writer_process`` and
``writer_child``): shared snapshot buffers, the depth bound, a child or a parent that dies,
and nothing left running. The contract it shares with the thread is
tests/support/background_writers.py's (tests/ranks/test_background_checkpoint_process.py)."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from gradsync.checkpoint import CheckpointError, CheckpointStore
from gradsync.checkpoint.store import CheckpointWarning, snapshot
from gradsync.checkpoint.writer_inline import InlineCheckpointWriter
from gradsync.checkpoint.writer_process import (
    WRITER_ENV,
    ProcessCheckpointWriter,
    make_writer,
    process_writer_available,
)
from tests.support.proctree import reaped_within

pytestmark = [
    pytest.mark.ranks,
    pytest.mark.timeout(60),
    pytest.mark.skipif(not process_writer_available(), reason="needs Linux memfd"),
]


def _writer(tmp_path: Path, rank: int = 0, world: int = 1, **kw: object) -> ProcessCheckpointWriter:
    return ProcessCheckpointWriter(
        CheckpointStore(tmp_path, keep=2),
        rank=rank,
        world_size=world,
        save_id="run",
        timeout_s=10.0,
        **kw,  # type: ignore[arg-type]
    )


def test_pooled_snapshots_in_shared_memory_are_written_as_taken(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    weights = torch.zeros(50_000)  # 200 KB: a shared buffer, not bytes in the message
    try:
        for step in range(1, 9):
            weights.fill_(float(step))
            writer.submit(step, snapshot({"w": weights, "step": step}, pool=writer.pool))
            weights.fill_(-1.0)  # training goes on: the snapshot was taken before this
            writer.wait(step)
            state = CheckpointStore(tmp_path).load(CheckpointStore(tmp_path).at(step), 0)
            assert torch.equal(state["w"], torch.full((50_000,), float(step)))
        # written buffers go back to the pool: a handful of shared buffers for 8 snapshots
        assert 1 <= len(writer._shared.by_address) <= writer.depth + 4
    finally:
        writer.close()
    assert writer._child.poll() is not None  # reaped: nothing left running


def test_the_child_process_never_loads_torch(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    try:
        writer.submit(1, snapshot({"w": torch.ones(3)}, pool=writer.pool))
        writer.wait(1)
        maps = Path(f"/proc/{writer._child.pid}/maps").read_text()
    finally:
        writer.close()
    assert "libtorch" not in maps and "libc10" not in maps


@pytest.mark.skipif(not hasattr(os, "SCHED_IDLE"), reason="needs Linux SCHED_IDLE")
def test_the_child_runs_only_on_a_core_nothing_else_wants(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    plain = _writer(tmp_path / "plain", idle=False)
    try:
        assert os.sched_getscheduler(writer._child.pid) == os.SCHED_IDLE
        # without SCHED_IDLE it keeps the lower nice value alone
        assert os.sched_getscheduler(plain._child.pid) == os.SCHED_OTHER
        assert os.getpriority(os.PRIO_PROCESS, plain._child.pid) >= 10
    finally:
        writer.close()
        plain.close()


def test_submit_blocks_while_depth_snapshots_are_in_flight(tmp_path: Path) -> None:
    writer = _writer(tmp_path, rank=1, world=2, depth=2)
    os.kill(writer._child.pid, signal.SIGSTOP)  # a writer that cannot keep up
    try:
        for step in (1, 2):
            writer.submit(step, snapshot({"w": torch.ones(1)}, pool=writer.pool))
        third = threading.Thread(
            target=writer.submit, args=(3, snapshot({"w": torch.ones(1)}, pool=writer.pool))
        )
        third.start()
        third.join(0.3)
        assert third.is_alive()  # waits for room: step time, not dropped checkpoints
        os.kill(writer._child.pid, signal.SIGCONT)
        third.join(10)
        assert not third.is_alive()
        writer.flush()
    finally:
        os.kill(writer._child.pid, signal.SIGCONT)
        writer.close()
    steps = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert steps == [f"step-00000{s}" for s in (1, 2, 3)]


def test_a_child_that_dies_is_reported_on_the_training_thread(tmp_path: Path) -> None:
    writer = _writer(tmp_path)
    writer.submit(1, snapshot({"w": torch.ones(1)}, pool=writer.pool))
    writer.wait(1)
    os.kill(writer._child.pid, signal.SIGKILL)
    with pytest.raises(CheckpointError, match="writer process .*exited with code -9"):
        for step in range(2, 50):  # the next call that sees it raises
            writer.submit(step, snapshot({"w": torch.ones(1)}, pool=writer.pool))
            time.sleep(0.05)
    writer.close(timeout_s=1)


_TRAINING = """
import sys, time, torch
from gradsync.checkpoint import CheckpointStore
from gradsync.checkpoint.store import snapshot
from gradsync.checkpoint.writer_process import ProcessCheckpointWriter
rank, last = int(sys.argv[2]), int(sys.argv[3])
w = ProcessCheckpointWriter(CheckpointStore(sys.argv[1]), rank=rank, world_size=2,
                            save_id="attempt-1", timeout_s=10, files_every=16)
weights = torch.zeros(50_000)
for step in range(1, last + 1):
    weights.fill_(float(step))
    w.submit(step, snapshot({"w": weights}, pool=w.pool))
print(w._child.pid, flush=True)
time.sleep(60)
"""


def _training(tmp_path: Path, rank: int, last: int) -> subprocess.Popen[str]:
    """A rank that saves steps 1..``last`` and prints its writer process's pid once it has
    submitted them all."""
    return subprocess.Popen(
        [sys.executable, "-c", _TRAINING, str(tmp_path), str(rank), str(last)],
        stdout=subprocess.PIPE,
        text=True,
    )


def test_a_killed_rank_s_writer_writes_what_it_held_and_ends(tmp_path: Path) -> None:
    # Files every 16th snapshot: step 1 is a file, steps 2..5 only held. Rank 1 saved one step
    # less than rank 0 before both died (SIGKILL: no close, no finalizer): each writer writes
    # the two snapshots it held, and rank 0's commits the newest step both ranks have. Both
    # ranks start at once (each imports torch, seconds) and are killed once both have saved.
    procs = [_training(tmp_path, 0, 5), _training(tmp_path, 1, 4)]
    try:
        children = []
        for proc in procs:
            assert proc.stdout is not None
            children.append(int(proc.stdout.readline()))
        for proc in procs:
            proc.kill()
            proc.wait(10)
        for child in children:
            assert reaped_within(child, within_s=10), f"writer process {child} did not end"
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
            assert proc.stdout is not None
            proc.stdout.close()
    store = CheckpointStore(tmp_path)
    with pytest.warns(CheckpointWarning, match="step-000005: incomplete"):  # rank 1 never saved 5
        info = store.latest()
    assert info is not None and info.step == 4
    assert torch.equal(store.load(info, 1)["w"], torch.full((50_000,), 4.0))
    steps = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith("step-"))
    assert "step-000002" not in steps  # held, never written: only the newest two were


def test_a_load_waits_for_the_writers_of_an_earlier_attempt(tmp_path: Path) -> None:
    from gradsync.checkpoint.writer_locks import hold, wait_for_writers

    pid = os.fork()
    if pid == 0:  # an earlier attempt's writer, still writing for 0.5 s
        hold(tmp_path, "earlier", 1, timeout_s=5)
        time.sleep(0.5)
        os._exit(0)
    try:
        time.sleep(0.2)
        mine = hold(tmp_path, "mine", 0, timeout_s=5)  # this attempt's own, never waited for
        started = time.monotonic()
        assert wait_for_writers(tmp_path, except_save_id="mine", timeout_s=10) == []
        assert time.monotonic() - started >= 0.2
        assert sorted(os.listdir(tmp_path / ".writers")) == ["mine.rank-0.lock"]
        os.close(mine)
    finally:
        os.waitpid(pid, 0)


def test_make_writer_takes_the_process_unless_told_otherwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def make(**kw: object) -> object:
        return make_writer(
            CheckpointStore(tmp_path), rank=1, world_size=2, save_id="x", timeout_s=1, **kw
        )

    monkeypatch.delenv(WRITER_ENV, raising=False)
    writer = make()
    assert type(writer) is ProcessCheckpointWriter
    writer.close()  # type: ignore[attr-defined]
    for name in ("inline", "thread"):  # ``thread``: the name of the writer before ``inline``
        monkeypatch.setenv(WRITER_ENV, name)
        writer = make()
        assert type(writer) is InlineCheckpointWriter
        writer.close()  # type: ignore[attr-defined]
    monkeypatch.setenv(WRITER_ENV, "fork")
    with pytest.raises(CheckpointError, match="'fork' is not a checkpoint writer; choose one of"):
        make()


def _files(directory: Path) -> list[int]:
    return sorted(int(p.name[5:]) for p in directory.iterdir() if p.name.startswith("step-"))


def test_which_steps_become_files_depends_on_the_steps_alone(tmp_path: Path) -> None:
    # A flush (on this rank alone, say) writes a held snapshot but must not move the cadence:
    # the peers, which did not flush, write steps 5 and 9 as files, and so must this rank.
    writer = _writer(tmp_path, files_every=4)
    try:
        for step in range(1, 10):
            writer.submit(step, snapshot({"w": torch.full((3,), float(step))}, pool=writer.pool))
            if step == 3:
                writer.flush()
        writer.flush()
    finally:
        writer.close()
    # 3 was written too, and pruned (keep=2, and 1 stays as the newest durable one)
    assert _files(tmp_path) == [1, 5, 9]


def test_only_a_checkpoint_every_step_is_held(tmp_path: Path) -> None:
    """A save every 5 steps is written as it comes, as its user asked: held, a run killed
    whole (its writers with it) kept every 64th step's file alone. Saves a step apart are
    held as before, whatever came first."""
    store = CheckpointStore(tmp_path, keep=10)
    writer = ProcessCheckpointWriter(
        store, rank=0, world_size=1, save_id="run", timeout_s=10.0, files_every=64
    )
    try:
        for step in (5, 10, 15, 16, 17):
            writer.submit(step, snapshot({"w": torch.full((2,), float(step))}, pool=writer.pool))
        writer.wait(15)  # what was sent to be written: 16 and 17 are held
        assert _files(tmp_path) == [5, 10, 15]
    finally:
        writer.close()
    assert _files(tmp_path) == [5, 10, 15, 17]  # the newest held one, written at close


def test_a_held_snapshot_larger_than_the_mailbox_is_held_all_the_same(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from gradsync.checkpoint import writer_process

    monkeypatch.setattr(writer_process, "SLOT_BYTES", 4096)
    writer = _writer(tmp_path, files_every=16)
    many = {f"layer{i}.weight": torch.full((2,), float(i)) for i in range(300)}  # a long header
    try:
        writer.submit(1, snapshot({"w": torch.ones(2)}, pool=writer.pool))
        writer.submit(2, snapshot({"w": torch.ones(2) * 2}, pool=writer.pool))
        writer.submit(3, snapshot(many, pool=writer.pool))  # grows the mailbox
        assert writer._mailbox.capacity > 4096
        assert _files(tmp_path) in ([], [1])  # only step 1 is a file (written by now or soon)
        writer.flush()
    finally:
        writer.close()
    assert _files(tmp_path) == [1, 3]
    store = CheckpointStore(tmp_path)
    assert torch.equal(store.load(store.at(3), 0)["layer299.weight"], torch.full((2,), 299.0))


def test_after_a_failed_flush_held_buffers_are_never_reused(tmp_path: Path) -> None:
    # The child may still be reading a held snapshot it was told to write: reusing its
    # buffers for a later snapshot could make a file of two steps' bytes with a valid sum.
    writer = _writer(tmp_path, files_every=16)
    weights = torch.zeros(50_000)  # shared buffers, not bytes in the message
    try:
        writer.submit(1, snapshot({"w": weights}, pool=writer.pool))
        writer.wait(1)
        os.kill(writer._child.pid, signal.SIGSTOP)  # a writer that cannot answer
        for step in (2, 3):
            writer.submit(step, snapshot({"w": weights}, pool=writer.pool))
        with pytest.raises(CheckpointError, match="still being written"):
            writer.flush(timeout_s=0.3)
        free_before = sum(len(v) for v in writer.pool._free.values())
        for step in (4, 5):  # would give 2 and 3 back to the pool
            writer.submit(step, snapshot({"w": weights}, pool=writer.pool))
        assert sum(len(v) for v in writer.pool._free.values()) <= free_before
    finally:
        os.kill(writer._child.pid, signal.SIGCONT)
        with contextlib.suppress(CheckpointError):
            writer.close(timeout_s=5)


def test_the_child_writes_the_header_the_training_process_would_have_made(
    tmp_path: Path,
) -> None:
    # The child makes each file's header from the pickled tree and the share texts it was
    # sent once per layout: byte for byte the header ``Packed.header`` makes in-process, for
    # a snapshot written at once, a held one flushed, and one of a new layout.
    from gradsync.checkpoint import replicas

    def state(step: int, width: int) -> dict[str, object]:
        model = {"a": torch.full((width,), float(step)), "b": torch.ones(2, dtype=torch.int64)}
        return {
            "replicated": replicas.share_of({"model": model}, 0, 1),
            "step": step,
            "lr": 0.5 / step,
        }

    writer = _writer(tmp_path, files_every=2)
    expected = {}
    try:
        for step, width in [(1, 3), (2, 3), (3, 3), (4, 5)]:
            packed = snapshot(state(step, width), pool=writer.pool)
            expected[step] = packed.header()[0]
            writer.submit(step, packed)  # 1 and 3 written at once, 2 held, 4 held
            if step == 2:
                writer.flush()
        writer.flush()
        assert sorted(writer._shares) == [0, 1]  # two layouts, each text sent once
    finally:
        writer.close()
    for step in (3, 4):  # the newest kept (keep=2)
        raw = (tmp_path / f"step-{step:06d}" / "rank-0.pt").read_bytes()
        assert raw[: len(expected[step])] == expected[step]
    store = CheckpointStore(tmp_path)
    loaded = store.load(store.at(4), 0)
    assert torch.equal(loaded["replicated"]["model"]["a"], torch.full((5,), 4.0))
    assert loaded["lr"] == 0.5 / 4
