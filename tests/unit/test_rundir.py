"""gradsync run never deletes a run's checkpoints unasked, and one run holds a directory."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from gradsync.errors import UsageError
from gradsync.runner.cli import main
from gradsync.runner.rundir import LOCK_FILE, claim

pytestmark = pytest.mark.unit

RUN = ["run", "--nproc", "1", "--workload", "mlp", "--steps", "2", "--no-progress"]


def _previous_run(out: Path) -> Path:
    """A directory as gradsync run leaves it: its config.json, a checkpoint, its report."""
    kept = out / "checkpoints" / "step-000010" / "rank-0.pt"
    kept.parent.mkdir(parents=True)
    kept.write_text("a checkpoint")
    (out / "report.json").write_text("{}")
    config = {"workload": "mlp", "strategy": "bsp", "nproc": 1, "steps": 2, "out": str(out)}
    (out / "config.json").write_text(json.dumps(config))
    return kept


def test_a_fresh_run_into_a_used_directory_is_refused_and_deletes_nothing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kept = _previous_run(tmp_path)
    assert main([*RUN, "--out", str(tmp_path)]) == 2
    error = capsys.readouterr().err
    assert "already holds a run (checkpoints, config.json, report.json)" in error
    assert "--resume" in error and "--overwrite" in error
    assert kept.read_text() == "a checkpoint"


def test_overwrite_starts_over_and_resume_keeps_the_checkpoints(tmp_path: Path) -> None:
    kept = _previous_run(tmp_path)
    claim(tmp_path, resume=True, overwrite=False).release()
    assert kept.exists()
    claim(tmp_path, resume=False, overwrite=True).release()
    assert not (tmp_path / "checkpoints").exists()
    assert (tmp_path / "report.json").exists()  # only the run's own state goes
    with pytest.raises(UsageError, match="pass one"):
        claim(tmp_path, resume=True, overwrite=True)


def test_a_second_run_into_a_directory_in_use_is_refused_naming_the_holder(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    holder = claim(tmp_path / "out", resume=False, overwrite=False)
    try:
        assert main([*RUN, "--out", str(tmp_path / "out"), "--resume"]) == 2
        error = capsys.readouterr().err
        assert "is in use by another gradsync run (pid " in error, error
    finally:
        holder.release()
    # Released (as when its process ends): the directory can be claimed again.
    claim(tmp_path / "out", resume=True, overwrite=False).release()
    assert (tmp_path / "out" / LOCK_FILE).exists()


def test_an_out_that_is_a_file_is_refused(tmp_path: Path) -> None:
    target = tmp_path / "file"
    target.write_text("x")
    with pytest.raises(UsageError, match="is a file, not a directory"):
        claim(target, resume=False, overwrite=False)


def test_overwrite_also_replaces_the_trackers_and_the_spans(tmp_path: Path) -> None:
    """A new run's TensorBoard event files beside the old run's mixed both in one view (a user
    tester's: 32 points of loss/mean for a 12-step run, two run/steps values)."""
    _previous_run(tmp_path)
    old = [tmp_path / "tensorboard" / "events.out", tmp_path / "mlruns" / "0" / "meta.yaml"]
    old += [tmp_path / "wandb" / "offline-run" / "run.wandb", tmp_path / "spans.jsonl"]
    for path in old:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("the previous run's")
    claim(tmp_path, resume=False, overwrite=True).release()
    assert not any(path.exists() for path in old)


def test_overwrite_deletes_a_scripts_checkpoints_in_the_run_directory_and_nothing_else(
    tmp_path: Path,
) -> None:
    """A script's ``sync.save("{run_dir}/ckpt")`` (docs/your-script.md): after --overwrite the
    script resumed from them, repeating the old run without a step trained (a tester's
    finding). gradsync's step directories go; what else the user keeps there stays."""
    _previous_run(tmp_path)
    store = tmp_path / "ckpt"
    (store / "step-000012").mkdir(parents=True)
    (store / "step-000012" / "MANIFEST.json").write_text("{}")
    (store / "notes.txt").write_text("mine")
    plain = tmp_path / "data" / "step-000001"  # a step-like name without a manifest
    plain.mkdir(parents=True)
    claim(tmp_path, resume=False, overwrite=True).release()
    assert not (store / "step-000012").exists() and (store / "notes.txt").exists()
    assert plain.exists()
    only = tmp_path / "only"
    (only / "ckpt" / "step-000003").mkdir(parents=True)
    (only / "ckpt" / "step-000003" / "MANIFEST.json").write_text("{}")
    (only / "config.json").write_text((tmp_path / "config.json").read_text())
    claim(only, resume=False, overwrite=True).release()
    assert not (only / "ckpt").exists()  # emptied, then removed
