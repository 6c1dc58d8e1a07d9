"""The checkpoint writers' contract, which the inline writer (``writer_inline``, tests/unit/
test_background_checkpoint.py) and the child process (``writer_process``, tests/ranks/
test_background_checkpoint_process.py) both keep: two ranks' writers sharing one directory in
this process, rank 0 committing; a durable checkpoint kept for a machine crash; a peer file of
a rolled-back attempt never committed; a missing peer or a failed write raised on the training
thread."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.checkpoint import CheckpointError, CheckpointStore, CheckpointWarning
from gradsync.checkpoint.store import MANIFEST, snapshot
from gradsync.checkpoint.writer_inline import InlineCheckpointWriter
from gradsync.checkpoint.writer_process import ProcessCheckpointWriter

WRITERS = {"inline": InlineCheckpointWriter, "process": ProcessCheckpointWriter}


def step_dirs(directory: Path) -> list[Path]:
    """The checkpoint's step directories (not the process writers' ``.writers`` locks)."""
    return [p for p in directory.iterdir() if p.name.startswith("step-")]


class WriterContract:
    """The tests every background writer passes; a test module's subclass names the writer in
    ``kind`` (a key of ``WRITERS``), and pytest collects them there."""

    kind: str
    #: whether a step given up at its deadline is reported again after ``wait`` said it was
    #: late: a background writer gives it up on its own, and says so at the next call; the
    #: inline writer gives it up inside that ``wait``, which says so once
    gives_up_apart = True

    def writers(self, tmp_path: Path, save_id: str = "run-a", **kw: Any) -> list[Any]:
        """Two ranks' writers of this kind on one directory (keep=2)."""
        return [
            WRITERS[self.kind](
                CheckpointStore(tmp_path, keep=2),
                rank=r,
                world_size=2,
                save_id=save_id,
                timeout_s=kw.get("timeout_s", 10.0),
                durable_every_s=kw.get("durable_every_s", 0.0),
            )
            for r in range(2)
        ]

    def test_two_ranks_write_in_the_background_and_rank_0_commits_keeping_two(
        self, tmp_path: Path
    ) -> None:
        writers = self.writers(tmp_path)
        try:
            for step in range(1, 6):
                for rank, w in enumerate(writers):
                    w.submit(step, snapshot({"w": torch.full((3,), float(step + rank)), "s": step}))
            for w in writers:
                w.wait(5)
            for w in writers:
                w.close()
        finally:
            for w in writers:
                w.close(timeout_s=1)
        store = CheckpointStore(tmp_path)
        info = store.latest(2)
        assert info is not None and info.step == 5
        assert sorted(p.name for p in step_dirs(tmp_path)) == ["step-000004", "step-000005"]
        assert torch.equal(store.load(info, 1)["w"], torch.full((3,), 6.0))
        assert json.loads((info.path / MANIFEST).read_text())["save_id"] == "run-a"

    def test_between_durable_commits_the_newest_durable_checkpoint_is_kept_for_a_machine_crash(
        self, tmp_path: Path
    ) -> None:
        writers = self.writers(tmp_path, durable_every_s=3600.0)
        try:
            for step in range(1, 6):
                for w in writers:
                    # step 4 is a blocking save's (sync.save(dir) with wait=True): always durable
                    w.submit(
                        step, snapshot({"w": torch.full((2,), float(step))}), durable=step == 4
                    )
                for w in writers:
                    w.wait(step)
        finally:
            for w in writers:
                w.close(timeout_s=5)
        manifests = {
            p.name: json.loads((p / MANIFEST).read_text())["durable"] for p in step_dirs(tmp_path)
        }
        # the first commit is durable, then only step 4's until an hour has passed
        assert manifests == {"step-000004": True, "step-000005": False}
        store = CheckpointStore(tmp_path)
        # A crash of the machine tore the files of the newest, unsynced checkpoint: the durable
        # one kept beside it is what the run resumes from.
        (tmp_path / "step-000005" / "rank-1.pt").write_bytes(b"")
        with pytest.warns(CheckpointWarning, match="step-000005"):
            info = store.latest(2)
        assert info is not None and info.step == 4 and info.durable

    def test_a_peer_file_left_by_a_rolled_back_attempt_is_never_committed(
        self, tmp_path: Path
    ) -> None:
        # Attempt A wrote rank 1's file of step 3, then the run was rolled back to an older step.
        old = self.writers(tmp_path, "attempt-a")
        old[1].submit(3, snapshot({"w": torch.zeros(1)}))
        old[1].close()
        old[0].close()
        # Attempt B: rank 0 writes step 3; rank 1's file there is attempt A's.
        new = self.writers(tmp_path, "attempt-b", timeout_s=0.5)
        new[0].submit(3, snapshot({"w": torch.ones(1)}))
        with pytest.raises(CheckpointError, match=r"step 3 .* no file from rank\(s\) 1"):
            new[0].wait(3)
        if self.gives_up_apart:
            with pytest.raises(CheckpointError, match=r"step 3 .* no file from rank\(s\) 1"):
                new[0].flush()  # the writer gives the step up at its deadline, and says so once
        new[0].flush()  # given up: nothing is left to commit
        assert not (tmp_path / "step-000003" / MANIFEST).exists()
        # Once attempt B's rank 1 writes its own, a later step commits.
        new[0].submit(4, snapshot({"w": torch.ones(1)}))
        new[1].submit(4, snapshot({"w": torch.ones(1)}))
        new[0].wait(4)
        for w in new:
            w.close()
        assert CheckpointStore(tmp_path).latest(2).step == 4  # type: ignore[union-attr]

    def test_a_rank_whose_peer_never_writes_fails_on_the_training_thread(
        self, tmp_path: Path
    ) -> None:
        rank0, rank1 = self.writers(tmp_path, timeout_s=0.3)
        rank1.close()
        rank0.submit(1, snapshot({"w": torch.ones(1)}))
        time.sleep(0.6)  # past the deadline: the thread gave up on step 1
        with pytest.raises(
            CheckpointError, match=r"incomplete after 0.3 s: no file from rank\(s\) 1"
        ):
            rank0.submit(2, snapshot({"w": torch.ones(1)}))
        rank0.close(timeout_s=0.1)

    def test_a_failed_write_is_raised_by_the_next_call(self, tmp_path: Path) -> None:
        (tmp_path / "blocked").write_text("a file where the directory should be")
        writer = WRITERS[self.kind](
            CheckpointStore(tmp_path / "blocked"), rank=1, world_size=2, save_id="x", timeout_s=5
        )
        with pytest.raises(CheckpointError, match="rank 1: writing a checkpoint .* failed"):
            writer.submit(1, snapshot({"w": torch.ones(1)}))  # inline: raised here
            writer.flush()  # in the background: raised by the next call
        writer.close()
