"""Recycled checkpoint files (``fault.recycle``): pruned checkpoints' files are overwritten by
later saves, and every checkpoint still reads back exactly what was saved."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
import torch

from gradsync.fault import CheckpointStore
from gradsync.fault.checkpoint import MANIFEST
from gradsync.fault.recycle import PER_NAME, SPARE_DIR, SpareFiles

pytestmark = pytest.mark.unit


def _state(rank: int, step: int, numel: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((numel,), float(step * 10 + rank)), "step": torch.tensor(step)}


def _save(store: CheckpointStore, step: int, world: int, numel: int) -> None:
    for rank in range(world):
        store.save(step, rank, world, _state(rank, step, numel))
    store.commit(step, world, durable=False)


def test_pruned_files_are_overwritten_and_every_checkpoint_reads_back(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=2, recycle=True)
    # Each step's state smaller than the last: a recycled file is longer than what is written
    # into it, and its old tail must go.
    inodes: dict[int, set[int]] = {0: set(), 1: set()}
    for step in range(1, 9):
        _save(store, step, world=2, numel=4000 - 300 * step)
        for rank in range(2):
            inodes[rank].add(os.stat(store.step_dir(step) / f"rank-{rank}.pt").st_ino)
        for kept in (step, step - 1):
            if kept < 1:
                continue
            info = store.at(kept)
            for rank in range(2):
                loaded = store.load(info, rank)
                expected = _state(rank, kept, 4000 - 300 * kept)
                assert torch.equal(loaded["w"], expected["w"]) and loaded["step"] == kept
    # Recycled, not created anew: a handful of files went round for 8 steps of 2 ranks.
    assert all(len(found) <= 2 + PER_NAME for found in inodes.values()), inodes
    latest = store.latest(2)
    assert latest is not None and latest.step == 8  # the spare directory is not a checkpoint
    spare = sorted(os.listdir(tmp_path / SPARE_DIR))
    assert 1 <= len(spare) <= PER_NAME and all(n.startswith("step-dir.") for n in spare), spare
    for name in spare:  # whole directories, their manifests gone
        assert sorted(os.listdir(tmp_path / SPARE_DIR / name)) == [
            "rank-0.pt",
            "rank-0.pt.sum",
            "rank-1.pt",
            "rank-1.pt.sum",
        ]
    assert sorted(p.name for p in tmp_path.iterdir()) == [SPARE_DIR, "step-000007", "step-000008"]


def test_a_sum_of_another_step_does_not_vouch_for_a_file(tmp_path: Path) -> None:
    store = CheckpointStore(tmp_path, keep=3, recycle=True)
    _save(store, 5, world=2, numel=100)
    store.save(6, 0, 2, _state(0, 6, 100))
    # Rank 1's files of step 5 where its step-6 files should be: same save, another step.
    for name in ("rank-1.pt", "rank-1.pt.sum"):
        shutil.copy(store.step_dir(5) / name, store.step_dir(6) / name)
    assert store.try_commit(6, 2, durable=False) == [1]
    store.save(6, 1, 2, _state(1, 6, 100))
    assert not isinstance(store.try_commit(6, 2, durable=False), list)


def test_a_spare_directory_is_claimed_once_and_never_complete(tmp_path: Path) -> None:
    spares = SpareFiles(tmp_path)
    (tmp_path / "step-000001").mkdir()
    (tmp_path / "step-000001" / "rank-0.pt").write_bytes(b"old")
    (tmp_path / "step-000001" / MANIFEST).write_text(json.dumps({}))
    spares.keep(tmp_path / "step-000001", MANIFEST)
    assert not (tmp_path / "step-000001").exists()
    assert spares.claim_dir(tmp_path / "step-000002")
    assert sorted(os.listdir(tmp_path / "step-000002")) == ["rank-0.pt"]  # no manifest
    assert not spares.claim_dir(tmp_path / "step-000003")  # the only spare is taken
    # A peer that claimed a directory for the same step first and wrote into it keeps it.
    (tmp_path / "step-000004").mkdir()
    spares.keep(tmp_path / "step-000004", MANIFEST)
    assert not spares.claim_dir(tmp_path / "step-000002")
    assert sorted(os.listdir(tmp_path / "step-000002")) == ["rank-0.pt"]
    assert SpareFiles.claim(tmp_path / "step-000002" / "rank-0.pt", tmp_path / "a.tmp")
    assert not SpareFiles.claim(tmp_path / "step-000002" / "rank-0.pt", tmp_path / "b.tmp")
    assert (tmp_path / "a.tmp").read_bytes() == b"old"


def test_a_summary_being_written_is_never_seen_through_an_old_one(tmp_path: Path) -> None:
    # Rank 0's commit opens a rank's .sum, then reads it. If that rank rewrites a recycled
    # .sum in place in between, the open file shows the new step's summary while it still has
    # a temporary name, and the commit deletes that "leftover": the rank's rename then fails
    # (seen once in a 2-rank run with a checkpoint every step).
    store = CheckpointStore(tmp_path, keep=1, recycle=True)
    _save(store, 1, world=1, numel=100)
    _save(store, 2, world=1, numel=100)  # step 1 pruned: its directory is a spare
    spare = tmp_path / SPARE_DIR / os.listdir(tmp_path / SPARE_DIR)[0]
    with open(spare / "rank-0.pt.sum", "rb") as old:  # a commit that opened it, then waited
        store.save(3, 0, 1, _state(0, 3, 100))  # claims the spare directory for step 3
        assert not spare.exists()
        assert json.loads(old.read())["step"] == 1
    assert json.loads((store.step_dir(3) / "rank-0.pt.sum").read_bytes())["step"] == 3
