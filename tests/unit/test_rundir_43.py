"""Issue 43, items 2-4: every command that writes a run directory locks it and refuses what
``gradsync run`` refuses (compare too); the lock file is never opened through a symbolic link;
``--overwrite`` deletes only what gradsync wrote. The launcher is replaced by one that writes
each run's records, so no process starts (the command end to end: tests/e2e)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

import gradsync.processes.launch
from gradsync.errors import UsageError
from gradsync.runner.cli import main
from gradsync.runner.rundir import LOCK_FILE, claim
from gradsync.telemetry.records import METRICS_FILE, StepRecord, write_records

pytestmark = pytest.mark.unit

COMPARE = ["compare", "--strategies", "bsp", "--steps", "2", "--no-plots", "--no-progress"]
RUN = ["run", "--nproc", "1", "--workload", "mlp", "--steps", "2", "--no-progress"]


class FakeLaunch:
    """Writes the run's step records as its rank 0 would, and counts the launches."""

    def __init__(self) -> None:
        self.launched = 0

    def __call__(self, entry: Any, args: tuple[Any, ...], **kwargs: Any) -> dict[int, Any]:
        cfg = args[0]
        self.launched += 1
        records = [
            StepRecord(0, s, 100.0 + s, 0.5, 0.5, 0.0, 0.0, 4, 10, loss=1.0)
            for s in range(cfg["steps"])
        ]
        write_records(Path(cfg["out"]) / METRICS_FILE, records)
        return {0: None}


@pytest.fixture
def fake_launch(monkeypatch: pytest.MonkeyPatch) -> FakeLaunch:
    fake = FakeLaunch()
    monkeypatch.setattr(gradsync.processes.launch, "launch", fake)
    return fake


def _finished_run(out: Path) -> dict[str, str]:
    """A directory as a finished gradsync run leaves it; returns its files' contents."""
    files = {
        "config.json": json.dumps(
            {"workload": "mlp", "strategy": "bsp", "nproc": 2, "steps": 931, "out": str(out)}
        ),
        METRICS_FILE: StepRecord(0, 930, 1.0, 0.1, 0.1, 0.0, 0.0, 4, 10).to_json() + "\n",
        "final_model.pt": "the run's parameters",
        "checkpoints/step-000930/MANIFEST.json": "{}",
    }
    for name, text in files.items():
        (out / name).parent.mkdir(parents=True, exist_ok=True)
        (out / name).write_text(text)
    return files


def _contents(out: Path, names: dict[str, str]) -> dict[str, str]:
    return {name: (out / name).read_text() for name in names}


def test_compare_into_a_running_runs_directory_is_refused_and_deletes_nothing(
    tmp_path: Path, fake_launch: FakeLaunch, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _finished_run(tmp_path)
    holder = claim(tmp_path, resume=True, overwrite=False)  # the run, still going
    try:
        assert main([*COMPARE, "--out", str(tmp_path)]) == 2
    finally:
        holder.release()
    assert "is in use by another gradsync run (pid " in capsys.readouterr().err
    assert _contents(tmp_path, files) == files and fake_launch.launched == 0
    assert not (tmp_path / "bsp").exists()


def test_compare_into_a_finished_runs_directory_is_refused_and_deletes_nothing(
    tmp_path: Path, fake_launch: FakeLaunch, capsys: pytest.CaptureFixture[str]
) -> None:
    files = _finished_run(tmp_path)
    assert main([*COMPARE, "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "already holds a run" in error and "--overwrite" in error, error
    assert _contents(tmp_path, files) == files and fake_launch.launched == 0


def test_compare_locks_each_strategys_run_directory(
    tmp_path: Path, fake_launch: FakeLaunch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "cmp"
    assert main([*COMPARE, "--out", str(out)]) == 0
    # A gradsync run into the directory the comparison's bsp run is to use again
    holder = claim(out / "bsp", resume=True, overwrite=False)
    try:
        assert main([*COMPARE, "--out", str(out), "--overwrite"]) == 2
    finally:
        holder.release()
    assert "cmp/bsp is in use by another gradsync run" in capsys.readouterr().err
    assert fake_launch.launched == 1
    assert (out / "bsp" / METRICS_FILE).exists()


def test_compare_again_needs_overwrite_and_then_runs(
    tmp_path: Path, fake_launch: FakeLaunch, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "cmp")
    assert main([*COMPARE, "--out", out]) == 0
    assert main([*COMPARE, "--out", out]) == 2
    assert "already holds a run (bsp, compare.json)" in capsys.readouterr().err
    assert main([*COMPARE, "--out", out, "--overwrite"]) == 0
    assert fake_launch.launched == 2


def test_compare_out_naming_a_file_is_one_line(
    tmp_path: Path, fake_launch: FakeLaunch, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "file"
    target.write_text("mine")
    assert main([*COMPARE, "--out", str(target)]) == 2
    error = capsys.readouterr().err.splitlines()[-1]  # after the line naming the comparison
    assert (
        error == f"gradsync: error: --out {target} is a file, not a directory: pass another --out"
    )
    assert target.read_text() == "mine"


def test_a_lock_file_that_is_a_symlink_is_refused_and_its_target_untouched(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    outside = tmp_path / "precious.txt"
    outside.write_text("not gradsync's")
    out = tmp_path / "out"
    out.mkdir()
    (out / LOCK_FILE).symlink_to(outside)
    with pytest.raises(UsageError, match=r"lock file \.gradsync\.lock is a symbolic link"):
        claim(out, resume=False, overwrite=False)
    assert main([*RUN, "--out", str(out)]) == 2
    assert "is a symbolic link (to " in capsys.readouterr().err
    assert outside.read_text() == "not gradsync's"


def test_overwrite_of_a_plain_directory_is_refused_naming_what_it_would_delete(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    best = tmp_path / "checkpoints" / "best.pt"
    best.parent.mkdir()
    best.write_text("the user's model")
    assert main([*RUN, "--out", str(tmp_path), "--overwrite"]) == 2
    error = capsys.readouterr().err
    assert "holds checkpoints but no gradsync run" in error, error
    assert "--overwrite would have deleted checkpoints" in error, error
    assert best.read_text() == "the user's model"
    assert not (tmp_path / "config.json").exists()


def test_overwrite_of_a_run_deletes_its_state_and_keeps_the_users_files(tmp_path: Path) -> None:
    _finished_run(tmp_path)
    best = tmp_path / "checkpoints" / "best.pt"
    best.write_text("the user's model")
    claim(tmp_path, resume=False, overwrite=True).release()
    assert not (tmp_path / METRICS_FILE).exists()
    assert not (tmp_path / "checkpoints" / "step-000930").exists()
    assert best.read_text() == "the user's model"  # only what gradsync wrote goes
    # A run directory with only its own checkpoints loses the whole checkpoints/ directory
    other = tmp_path / "other"
    other.mkdir()
    _finished_run(other)
    claim(other, resume=False, overwrite=True).release()
    assert not (other / "checkpoints").exists()
    assert (other / "config.json").exists()  # rewritten by the run, not deleted


def test_a_run_state_that_cannot_be_written_is_refused_before_the_workers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A read-only checkpoints directory (a tester's read-only mount) failed the resumed run
    only after its workers loaded a checkpoint (OSError on log.jsonl). os.access stands in for
    the mount: as root, a mode alone would not make it unwritable."""
    (tmp_path / "checkpoints").mkdir()
    import os

    real = os.access
    monkeypatch.setattr(
        os, "access", lambda p, mode: False if Path(p).name == "checkpoints" else real(p, mode)
    )
    with pytest.raises(UsageError, match=r"checkpoints cannot be written \(read-only"):
        claim(tmp_path, resume=True, overwrite=False).release()
    monkeypatch.setattr(os, "access", real)
    claim(tmp_path, resume=True, overwrite=False).release()  # writable: claimed
