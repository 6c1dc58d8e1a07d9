"""Exporting a checkpoint to files torch opens alone (``gradsync.checkpoint.export``, ``gradsync
checkpoint export``): a ``torch.save`` state dict and DCP, both loading into a fresh model (with
``strict=True``) and a fresh optimizer built as the training script built them, bitwise equal to
what the ranks held; strategies that cannot export are refused, nothing written."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync.checkpoint import CheckpointError, CheckpointStore, CheckpointWarning
from gradsync.checkpoint.export import EXPORTABLE, TARGETS, export_checkpoint, single_process_state
from gradsync.errors import UsageError
from gradsync.runner import cli
from tests.support import export_ranks as er
from tests.support.export import (
    assert_same,
    check_dcp,
    check_export,
)

pytestmark = pytest.mark.unit

ONE_RANK_STRATEGIES = (*er.STRATEGIES, "hogwild")


# -- in one process (a world of one rank) ----------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_runs(
    tmp_path_factory: pytest.TempPathFactory, one_rank: None, inline_writer: None
) -> Iterator[dict[str, tuple[Path, dict[str, Any], dict[str, Any]]]]:
    """Every exportable strategy trained on one rank in this process: its checkpoint
    directory, and the model's and the optimizer's state dicts after the last checkpoint
    (written by the writer thread: the export does not care which writer wrote them)."""
    root = tmp_path_factory.mktemp("one-rank")
    runs = {}
    for spec in ONE_RANK_STRATEGIES:
        directory = root / spec.replace(":", "-")
        model, optimizer = er.train(spec, directory, rank=0)
        runs[spec] = (directory, model.state_dict(), optimizer.state_dict())
    yield runs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", ONE_RANK_STRATEGIES)
def test_an_export_loads_into_a_fresh_model_and_optimizer_bitwise(
    spec: str, one_rank_runs: dict[str, Any], tmp_path: Path
) -> None:
    directory, model, optimizer = one_rank_runs[spec]
    done = export_checkpoint(directory, tmp_path / "model.pt")
    assert (done.step, done.to, done.world_size) == (er.STEPS, "torch", 1)
    # the whole spec (local:2, not local: a tester's), as the checkpoint holds it
    assert done.strategy == spec
    exported = torch.load(done.path, weights_only=True)
    assert set(exported) == {"model", "optimizer", "step", "extra"}
    check_export(exported, model, optimizer, er.STEPS)
    assert_same(single_process_state(directory), exported, "single_process_state")

    dcp_done = export_checkpoint(directory, tmp_path / "model.dcp", to="dcp")
    assert dcp_done.path.is_dir() and (dcp_done.path / ".metadata").is_file()
    check_dcp(dcp_done.path, exported, tmp_path)
    # nothing left beside the outputs (the staging copies are renamed into place)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from-dcp.pt", "model.dcp", "model.pt"]


@pytest.mark.timeout(60)
def test_step_picks_an_older_checkpoint_and_a_missing_one_is_named(
    one_rank_runs: dict[str, Any], tmp_path: Path
) -> None:
    directory, _, _ = one_rank_runs["bsp"]
    older = torch.load(
        export_checkpoint(directory, tmp_path / "2.pt", step=2).path, weights_only=True
    )
    newest = torch.load(export_checkpoint(directory, tmp_path / "4.pt").path, weights_only=True)
    assert older["step"] == 2 and older["extra"] == {"data_position": 2}
    assert not torch.equal(older["model"]["0.weight"], newest["model"]["0.weight"])
    with pytest.raises(
        CheckpointError, match=r"no checkpoint of step 3 .*step-000002, step-000004"
    ):
        export_checkpoint(directory, tmp_path / "3.pt", step=3)
    assert not (tmp_path / "3.pt").exists()


def _newest_corrupted(one_rank_runs: dict[str, Any], tmp_path: Path) -> Path:
    """A copy of the bsp run's checkpoints with a byte of the newest one's rank file flipped."""
    import shutil

    directory = tmp_path / "checkpoints"
    shutil.copytree(one_rank_runs["bsp"][0], directory)
    rank_file = directory / "step-000004" / "rank-0.pt"
    data = bytearray(rank_file.read_bytes())
    data[-5] ^= 0xFF
    rank_file.write_bytes(bytes(data))
    return directory


@pytest.mark.timeout(60)
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(
    one_rank_runs: dict[str, Any], tmp_path: Path
) -> None:
    directory = _newest_corrupted(one_rank_runs, tmp_path)
    with pytest.warns(CheckpointWarning, match="step-000004.*corrupted"):
        done = export_checkpoint(directory, tmp_path / "out.pt")
    assert done.step == 2
    # every checkpoint damaged: refused, each one's reason named
    rank_file = directory / "step-000002" / "rank-0.pt"
    rank_file.write_bytes(rank_file.read_bytes()[:-3])
    with (
        pytest.warns(CheckpointWarning),
        pytest.raises(CheckpointError, match=r"none of the 2 .*step-000004.*step-000002.*trunc"),
    ):
        export_checkpoint(directory, tmp_path / "never.pt")
    assert not (tmp_path / "never.pt").exists()


@pytest.mark.timeout(60)
def test_the_command_says_a_skipped_checkpoint_in_one_gradsync_line(
    one_rank_runs: dict[str, Any],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Python's warning format (the file, line and source of gradsync's warnings.warn call)
    told a user of ``gradsync checkpoint export`` nothing (a tester's): the warning goes to
    gradsync's logger, which prints ``gradsync: ...`` (here pytest's handler takes it)."""
    directory = _newest_corrupted(one_rank_runs, tmp_path)
    with warnings.catch_warnings(), caplog.at_level("WARNING", logger="gradsync.warnings"):
        warnings.simplefilter("always")
        assert cli.main(["checkpoint", "export", str(directory), str(tmp_path / "o.pt")]) == 0
    said = [r.getMessage() for r in caplog.records if r.name == "gradsync.warnings"]
    assert len(said) == 1 and said[0].startswith("skipping checkpoint "), said
    assert "step-000004" in said[0] and "CheckpointWarning" not in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_a_newest_checkpoint_pruned_while_read_gives_way_to_the_newest_then(
    one_rank_runs: dict[str, Any], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A run still saving into the directory prunes the checkpoint being exported: the export
    takes the newest one again, rather than failing with "rank-0.pt is missing" (1 call in
    300 of an export loop beside a live run, the checkpoint tester's)."""
    import shutil

    directory = tmp_path / "checkpoints"
    shutil.copytree(one_rank_runs["bsp"][0], directory)
    real_load = CheckpointStore.load

    def pruned_first(store: CheckpointStore, info: Any, rank: int) -> dict[str, Any]:
        if info.step == 4:
            shutil.rmtree(directory / "step-000004")  # the run's keep pruned it meanwhile
        return real_load(store, info, rank)

    monkeypatch.setattr(CheckpointStore, "load", pruned_first)
    assert single_process_state(directory)["step"] == 2
    # one the caller named is not swapped for another
    shutil.copytree(one_rank_runs["bsp"][0] / "step-000004", directory / "step-000004")
    with pytest.raises((CheckpointError, OSError)):
        single_process_state(directory, step=4)


def _crafted(directory: Path, strategy: str, layout: dict[str, int] | None = None) -> Path:
    """A committed checkpoint of ``strategy`` with a model and optimizer part, written through
    the store: what the export sees of a strategy it must refuse."""
    store = CheckpointStore(directory)
    state = {
        "model": {"w": torch.ones(2)},
        "optimizer": {"state": {}, "param_groups": []},
        "strategy": strategy,
        "layout": layout or {"workers": 1, "servers": 0},
        "extra": {},
    }
    store.save(3, 0, 1, state)
    store.commit(3, 1)
    return directory


@pytest.mark.parametrize(
    ("strategy", "why"),
    [
        ("zero:3", "shards of the parameters"),
        ("async", "server ranks"),
        ("ssp:2", "server ranks"),
        ("mine", "does not know"),
    ],
)
@pytest.mark.parametrize("to", TARGETS)
def test_a_strategy_that_cannot_export_is_refused_and_nothing_written(
    strategy: str, why: str, to: str, tmp_path: Path
) -> None:
    directory = _crafted(tmp_path / "checkpoints", strategy)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError) as refused:
        export_checkpoint(directory, out, to=to)
    message = str(refused.value)
    assert f"strategy {strategy}," in message and why in message
    assert "bsp, zero:1, zero:2, local:H, diloco:H, gossip:H, noloco:H, hogwild export" in message
    assert "nothing was written" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


def test_zero_ranks_that_disagree_about_a_parameters_optimizer_state_are_refused(
    tmp_path: Path,
) -> None:
    """zero:N: each parameter's optimizer state is on the one rank that owns it; two ranks
    holding different state for one parameter cannot both be the run's."""
    store = CheckpointStore(tmp_path / "checkpoints")
    for rank, value in enumerate((1.0, 2.0)):
        optimizer = {
            "state": {0: {"momentum_buffer": torch.full((2,), value)}},
            "param_groups": [{"lr": 0.1, "params": [0]}],
        }
        state = {"model": {"w": torch.ones(2)}, "optimizer": optimizer, "strategy": "zero:1"}
        store.save(3, rank, 2, state)
    store.commit(3, 2)
    with pytest.raises(CheckpointError, match="ranks 0 and 1 .* both hold optimizer state of"):
        export_checkpoint(store.directory, tmp_path / "out.pt")
    assert not (tmp_path / "out.pt").exists()


def test_bad_arguments_are_refused_naming_what_is_valid(tmp_path: Path) -> None:
    directory = _crafted(tmp_path / "checkpoints", "bsp")
    with pytest.raises(UsageError, match="cannot export to 'onnx': choose one of torch, dcp"):
        export_checkpoint(directory, tmp_path / "x", to="onnx")
    with pytest.raises(UsageError, match="does not exist"):
        export_checkpoint(tmp_path / "nowhere", tmp_path / "x")
    existing = tmp_path / "kept.pt"
    existing.write_bytes(b"mine")
    with pytest.raises(UsageError, match="already exists.*nothing was overwritten"):
        export_checkpoint(directory, existing)
    assert existing.read_bytes() == b"mine"
    # a mistyped folder is not made: the user is told, and nothing appears
    with pytest.raises(UsageError, match=r"typo, the folder of .*model\.pt, does not exist"):
        export_checkpoint(directory, tmp_path / "typo" / "model.pt")
    assert not (tmp_path / "typo").exists()
    with pytest.raises(UsageError, match="the folder of .* is not a directory"):
        export_checkpoint(directory, existing / "model.pt")
    with pytest.raises(UsageError, match="step must be an integer >= 0.*got -1"):
        export_checkpoint(directory, tmp_path / "x", step=-1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in .*empty: nothing to export"):
        export_checkpoint(tmp_path / "empty", tmp_path / "x")
    assert set(EXPORTABLE) == {
        *("bsp", "zero:1", "zero:2", "local", "diloco", "gossip", "noloco", "hogwild")
    }


# -- the command line, in this process -------------------------------------------------------------


@pytest.mark.timeout(60)
def test_the_command_takes_a_run_directory_or_its_checkpoints(
    one_rank_runs: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import shutil

    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    shutil.copytree(one_rank_runs["bsp"][0], run / "checkpoints")
    assert cli.main(["checkpoint", "export", str(run), str(tmp_path / "a.pt")]) == 0
    err = capsys.readouterr().err
    assert "exported the checkpoint of step 4 (bsp, 1 rank," in err
    assert "torch.load(path, weights_only=True)" in err
    argv = ["checkpoint", "export", str(run / "checkpoints"), str(tmp_path / "b"), "--to", "dcp"]
    assert cli.main([*argv, "--step", "2"]) == 0
    assert (tmp_path / "b" / ".metadata").is_file()
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    check_export(a, one_rank_runs["bsp"][1], one_rank_runs["bsp"][2], er.STEPS)
    # a step's own directory, as export's messages name a checkpoint (was: "no checkpoint in
    # .../step-000002: nothing to export", a user tester's)
    step_2 = next((run / "checkpoints").glob("step-*2"))
    assert cli.main(["checkpoint", "export", str(step_2), str(tmp_path / "c.pt")]) == 0
    assert "exported the checkpoint of step 2 " in capsys.readouterr().err
    argv = ["checkpoint", "export", str(step_2), str(tmp_path / "d.pt"), "--step", "4"]
    assert cli.main(argv) == 2
    assert "is step 2's checkpoint, and --step 4 names another" in capsys.readouterr().err


def test_the_command_refuses_with_one_line_and_exit_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.EXPORT_TARGETS == TARGETS
    out = str(tmp_path / "out.pt")
    assert cli.main(["checkpoint", "export", str(tmp_path / "nowhere"), out]) == 2
    assert "nowhere does not exist: pass a run directory" in capsys.readouterr().err
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.json").write_text("{}")
    assert cli.main(["checkpoint", "export", str(run), out]) == 2
    assert "has no checkpoints/: the run took none" in capsys.readouterr().err
    (run / "group-1" / "checkpoints").mkdir(parents=True)  # a --replica-groups run
    assert cli.main(["checkpoint", "export", str(run), out]) == 2
    err = capsys.readouterr().err
    assert "is a run of replica groups, each with its own checkpoints (group-1)" in err, err
    assert f"gradsync checkpoint export {run / 'group-1'} OUT" in err, err
    (tmp_path / "empty").mkdir()
    assert cli.main(["checkpoint", "export", str(tmp_path / "empty"), out]) == 2
    err = capsys.readouterr().err
    assert err.startswith("gradsync: error: checkpoint export: no checkpoint in ")
    assert "Traceback" not in err
    _crafted(tmp_path / "ps", "async", {"workers": 1, "servers": 1})
    assert cli.main(["checkpoint", "export", str(tmp_path / "ps"), out]) == 2
    assert "written by strategy async" in capsys.readouterr().err
    with pytest.raises(SystemExit) as bad:
        cli.main(["checkpoint", "export", str(tmp_path / "ps"), out, "--to", "onnx"])
    assert bad.value.code == 2
    err = capsys.readouterr().err
    assert "argument --to: invalid choice: 'onnx' (choose from" in err
    assert "torch" in err.rpartition("choose from")[2] and "dcp" in err.rpartition("choose from")[2]
    assert not (tmp_path / "out.pt").exists()
