"""Step directories that earlier attempts' writers left above the checkpoint a run resumes from
(the held snapshots a dying rank's writer writes where a peer held only the one before) are
warned about once, by the resume that skips them, and removed then: before, every later resume
skipped them with the same warning until the run committed a step past them. What a commit
could still complete, this attempt's files, a directory with anything else in it, and anything
while an earlier writer may still write are kept."""

from __future__ import annotations

import re
import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync import Synchronizer
from gradsync.checkpoint import CheckpointStore, CheckpointWarning
from gradsync.checkpoint.rng import rng_state
from gradsync.checkpoint.writer_locks import hold, release

pytestmark = pytest.mark.unit


def _sync(timeout_s: float = 300.0) -> Synchronizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    return Synchronizer(model, optimizer, timeout_s=timeout_s)


def _state(sync: Synchronizer, step: int) -> dict[str, Any]:
    return {
        "model": sync.model.state_dict(),
        "optimizer": sync.optimizer.state_dict(),
        "sync": {**sync.state_dict(), "step": step},
        "rng": rng_state(),
        "strategy": sync.strategy.name,
        "compression": sync.compressor.spec,
        "layout": {"workers": 2, "servers": 0},
        "extra": {},
    }


def _leftovers(directory: Path, sync: Synchronizer) -> None:
    """A two-rank bsp run's directory after a kill: step 3 committed; above it what the
    dying attempt's writers left, never committed."""
    store = CheckpointStore(directory, keep=5)
    for rank in (0, 1):
        store.write(3, rank, 2, _snapshot(sync, 3), save_id="dead")
    store.commit(3, 2, save_id="dead")
    # rank 0's writer wrote its newest held snapshot; rank 1 had held only the one before
    store.write(4, 0, 2, _snapshot(sync, 4), save_id="dead")
    # rank 1's file of step 5 from the dead attempt, rank 0's from an attempt before it
    store.write(5, 1, 2, _snapshot(sync, 5), save_id="dead")
    store.write(5, 0, 2, _snapshot(sync, 5), save_id="older")
    # every rank's file of one attempt, its commit never made: the newest state, kept
    for rank in (0, 1):
        store.write(6, rank, 2, _snapshot(sync, 6), save_id="dead")
    # a file the user put there: the directory is kept
    store.write(7, 1, 2, _snapshot(sync, 7), save_id="dead")
    (store.step_dir(7) / "notes.txt").write_text("mine")


def _snapshot(sync: Synchronizer, step: int) -> Any:
    from gradsync.checkpoint.store import snapshot

    return snapshot(_state(sync, step))


def _steps(directory: Path) -> list[int]:
    return sorted(int(p.name.removeprefix("step-")) for p in directory.glob("step-*"))


def _load(sync: Synchronizer, directory: Path) -> tuple[Any, list[str]]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        extra = sync.load(directory)
    return extra, [str(w.message) for w in caught if issubclass(w.category, CheckpointWarning)]


def _skipped(messages: list[str]) -> list[int]:
    """The steps the warnings say were skipped: one a line, or past the third, the span of a
    line that says the rest (``skipping 1 more checkpoint(s) in DIR (step-000004): ...``)."""
    return sorted(
        int(step)
        for m in messages
        if m.startswith("skipping ")
        for step in re.findall(r"step-(\d{6})", m.split(": ", 1)[0])
    )


def test_a_resume_warns_once_of_what_no_commit_can_complete_and_removes_it(
    tmp_path: Path, one_rank: None, inline_writer: None
) -> None:
    sync = _sync()
    try:
        _leftovers(tmp_path, sync)
        extra, said = _load(sync, tmp_path)
        assert extra == {"step": 3}
        assert _skipped(said) == [4, 5, 6, 7], said
        # 4 and 5 can never be committed: gone; 6 (complete) and 7 (the user's file) kept
        assert _steps(tmp_path) == [3, 6, 7]
        extra, said = _load(sync, tmp_path)  # the next resume: was warned of 4 and 5 again
        assert extra == {"step": 3}
        assert _skipped(said) == [6, 7], said
        assert _steps(tmp_path) == [3, 6, 7]
    finally:
        sync.close()


def test_nothing_is_removed_while_an_earlier_writer_may_still_write(
    tmp_path: Path, one_rank: None, inline_writer: None
) -> None:
    sync = _sync(timeout_s=0.4)
    fd = hold(tmp_path, "dead", 1, timeout_s=1.0)  # rank 1's writer of the dead attempt, alive
    try:
        _leftovers(tmp_path, sync)
        extra, said = _load(sync, tmp_path)
        assert extra == {"step": 3}
        assert any("still hold" in m for m in said), said
        assert _steps(tmp_path) == [3, 4, 5, 6, 7]
    finally:
        release(tmp_path, "dead", 1, fd)
        sync.close()


def test_this_attempts_own_files_are_kept(
    tmp_path: Path, one_rank: None, inline_writer: None
) -> None:
    sync = _sync()
    try:
        _leftovers(tmp_path, sync)
        store = CheckpointStore(tmp_path, keep=5)
        store.write(8, 0, 2, _snapshot(sync, 8), save_id=sync._checkpoints.save_id)
        _load(sync, tmp_path)
        assert _steps(tmp_path) == [3, 6, 7, 8]
    finally:
        sync.close()
