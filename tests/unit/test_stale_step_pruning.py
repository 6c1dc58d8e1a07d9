"""A step directory that writers of an earlier attempt left between kept checkpoints (rank files,
no manifest: stopped writers that wrote on after a resume) is pruned by the next commit once no
writer of another attempt is alive. Before, pruning removed only committed steps and anything
below the oldest kept one, so such a directory stayed while it sat between kept checkpoints (the
newest durable one is kept too), and for good where the run ended then. A directory newer than
the commit (a save in flight), one holding anything else, and any while an earlier writer lives
are kept."""

from __future__ import annotations

from pathlib import Path

import pytest

from gradsync.checkpoint.store import CheckpointStore, snapshot
from gradsync.checkpoint.writer_locks import hold, release

pytestmark = pytest.mark.unit


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in directory.glob("step-*"))


def _commit(store: CheckpointStore, step: int, *, durable: bool = False) -> None:
    for rank in (0, 1):
        store.write(step, rank, 2, snapshot({"step": step}), save_id="live", durable=durable)
    store.commit(step, 2, save_id="live", durable=durable)


def _leftovers(directory: Path) -> CheckpointStore:
    """Step 10 committed durable (kept by every prune), then what the dead attempt's stopped
    writers wrote on: rank 1's file of step 12, every rank's file of step 13; a user's file in
    step 14's directory; rank 0's file of step 20, a save of this attempt still in flight."""
    store = CheckpointStore(directory, keep=2)
    _commit(store, 10, durable=True)
    store.write(12, 1, 2, snapshot({"step": 12}), save_id="dead")
    for rank in (0, 1):
        store.write(13, rank, 2, snapshot({"step": 13}), save_id="dead")
    store.write(14, 1, 2, snapshot({"step": 14}), save_id="dead")
    (store.step_dir(14) / "notes.txt").write_text("mine")
    store.write(20, 0, 2, snapshot({"step": 20}), save_id="live")
    return store


def test_a_commit_prunes_the_stale_directories_below_it(tmp_path: Path) -> None:
    store = _leftovers(tmp_path)
    _commit(store, 15)
    assert _steps(tmp_path) == [10, 14, 15, 20]
    _commit(store, 16)
    _commit(store, 17)  # keep=2 and the durable 10: 15 is pruned, as before
    assert _steps(tmp_path) == [10, 14, 16, 17, 20]


def test_nothing_stale_is_pruned_while_a_writer_of_another_attempt_lives(tmp_path: Path) -> None:
    store = _leftovers(tmp_path)
    fd = hold(tmp_path, "dead", 1, timeout_s=1.0)  # rank 1's writer of the dead attempt
    try:
        _commit(store, 15)
        assert _steps(tmp_path) == [10, 12, 13, 14, 15, 20]
    finally:
        release(tmp_path, "dead", 1, fd)
    _commit(store, 16)  # it has ended: the next commit prunes them
    assert _steps(tmp_path) == [10, 14, 15, 16, 20]


def test_this_attempts_own_writers_do_not_keep_stale_directories(tmp_path: Path) -> None:
    store = _leftovers(tmp_path)
    fd = hold(tmp_path, "live", 0, timeout_s=1.0)  # this attempt's rank 0 writer
    try:
        _commit(store, 15)
        assert _steps(tmp_path) == [10, 14, 15, 20]
    finally:
        release(tmp_path, "live", 0, fd)
