"""Checkpoint and resume with parameter servers (ssp:S, async): the servers save their shard,
optimizer state and clocks with the workers' checkpoint and start from them on resume."""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.checkpoint.store import CheckpointStore
from gradsync.checkpoint.writer_locks import wait_for_writers
from gradsync.checkpoint.writer_process import WRITER_ENV
from gradsync.testing import RankFailure, run_ranks
from tests.support import ps_checkpoint_ranks as ranks

pytestmark = pytest.mark.ranks

SERVER = 2  # 2 workers + 1 server: the server is the last rank


@pytest.fixture(scope="module")
def first_run(tmp_path_factory: pytest.TempPathFactory) -> tuple[list[Any], Path]:
    """The uninterrupted run that saves at ``SAVE_AT``, once for this file: each test resumes
    (or is refused) from its own copy of the checkpoints (``_copy``)."""
    root = tmp_path_factory.mktemp("ps-first-run")
    return run_ranks(ranks.first_run, 3, str(root), timeout_s=120), root


def _copy(first: tuple[list[Any], Path], to: Path) -> Path:
    shutil.copytree(first[1], to / "run")
    return to / "run"


@pytest.mark.timeout(150)
def test_resumed_servers_continue_from_the_checkpoint(
    first_run: tuple[list[Any], Path], tmp_path: Path
) -> None:
    first = first_run[0]
    second = run_ranks(ranks.second_run, 3, str(_copy(first_run, tmp_path)), timeout_s=120)
    for spec in ranks.SPECS:
        # the uninterrupted run: the checkpoint's collectives did not disturb it
        before = first[SERVER][spec]["server"]
        assert before.clocks == [ranks.STEPS] * 2 and before.checkpoints == [ranks.SAVE_AT]
        assert len(before.updates) == 2 * ranks.STEPS
        # telemetry of every step of both workers, whether gathered at the save or at the end
        want = sorted((r, s) for r in (0, 1) for s in range(ranks.STEPS))
        assert first[0][spec]["steps"] == want, spec
        # the resumed run starts at the checkpoint on every rank, servers included...
        assert [second[r][spec]["start"] for r in range(3)] == [ranks.SAVE_AT] * 3
        after = second[SERVER][spec]["server"]
        # ...and the server's clocks go on from there: it applied only the missing pushes
        assert after.resumed_at == ranks.SAVE_AT and after.clocks == [ranks.STEPS] * 2
        assert after.checkpoints == [ranks.SAVE_AT]
        assert sorted(u.clock for u in after.updates) == sorted(
            list(range(ranks.SAVE_AT, ranks.STEPS)) * 2
        )
        if spec == "ssp:1":
            assert max(u.staleness for u in after.updates) <= 1
        assert torch.equal(second[0][spec]["params"], second[1][spec]["params"])
    # ssp:0 on identical batches is deterministic: the resumed run lands where the uninterrupted
    # one did (the servers' momentum buffers included, or it would not).
    assert torch.allclose(
        second[0]["ssp:0"]["params"], first[0]["ssp:0"]["params"], rtol=1e-9, atol=1e-12
    )
    assert not torch.equal(first[0]["ssp:0"]["params"], first[0]["ssp:1"]["params"])
    # the same 3 ranks laid out as 1 worker + 2 servers: refused on every rank
    for r in range(3):
        message = second[r]["two servers"]
        assert "written by 3 ranks (2 workers + 1 server)" in message, message
        assert "this run has 3 ranks (1 worker + 2 servers)" in message, message


@pytest.mark.timeout(150)
def test_resuming_servers_on_more_ranks_is_refused(
    first_run: tuple[list[Any], Path], tmp_path: Path
) -> None:
    root = str(_copy(first_run, tmp_path))
    got = run_ranks(ranks.more_ranks, 4, root, timeout_s=120, allow_failures=True)
    assert not any(isinstance(g, RankFailure) for g in got), got
    for message in got:
        assert "written by 3 ranks (2 workers + 1 server)" in message, message
        assert "this run has 4 ranks (3 workers + 1 server)" in message, message
        assert "same numbers of workers and servers" in message


@pytest.mark.timeout(120)
def test_servers_hold_snapshots_and_write_them_when_a_worker_waits(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Saving every step, the server's writer holds its snapshots as the workers' do (only the
    first is a file before the flush); ``wait_for_checkpoints``, a save that waits, and a save
    into another directory each make the server write the snapshot rank 0 commits (each
    would time out otherwise)."""
    # Holding is the writer process's (the default on Linux); the thread writer, which a
    # user may ask for, writes every snapshot.
    monkeypatch.delenv(WRITER_ENV, raising=False)
    got = run_ranks(ranks.held_and_flushed, 3, str(tmp_path), timeout_s=100)[0]
    assert got["a after flush"] == 4, got
    every_rank = ["rank-0.pt", "rank-1.pt", "rank-2.pt"]
    assert got["a files"] == {1: every_rank, 4: every_rank}, got
    assert got["b after switch"] == 6, got
    assert got["a after durable save"] == 8, got
    assert got["a server pushes"] == {1: [1, 1], 4: [4, 4], 10: [10, 10]}, got
    assert got["c and d"] == [13, 13], got


@pytest.mark.timeout(60)
def test_a_close_without_report_commits_the_newest_checkpoint(tmp_path: Path) -> None:
    """After an exception, close() without report(): the servers are told to write theirs,
    so rank 0's close commits the newest step rather than failing after the timeout."""
    got = run_ranks(
        ranks.closed_without_report, 3, str(tmp_path), timeout_s=50, allow_failures=True
    )
    assert got[0] == 3, got  # the server fails as the workers leave: it is not asked here


@pytest.mark.timeout(60)
def test_a_worker_lost_right_after_its_save_loses_no_step(tmp_path: Path) -> None:
    """Saving every step, worker 1 dies after its save of step 3, before the push that would
    have asked the server for it: the server takes that checkpoint as it learns of the loss,
    and once every writer has ended, step 3 is committed."""
    run_ranks(ranks.lost_after_a_save, 3, str(tmp_path), timeout_s=50, allow_failures=True)
    directory = tmp_path / "ckpt"
    assert not wait_for_writers(directory, timeout_s=30)
    info = CheckpointStore(directory).latest()
    assert info is not None and info.step == 3, info
