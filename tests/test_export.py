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
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

import gradsync as gs
from gradsync import cli
from gradsync.checkpoint import CheckpointError, CheckpointStore, CheckpointWarning
from gradsync.checkpoint.export import EXPORTABLE, TARGETS, export_checkpoint, single_process_state
from gradsync.errors import UsageError
from gradsync.testing import run_ranks
from tests import export_ranks as er
from tests.test_cli_run import gradsync

ONE_RANK_STRATEGIES = (*er.STRATEGIES, "hogwild")


# -- comparisons -----------------------------------------------------------------------------------


def _assert_same(actual: Any, expected: Any, where: str) -> None:
    """The same tree, every tensor bitwise equal (dtype and shape included)."""
    if isinstance(expected, torch.Tensor):
        assert isinstance(actual, torch.Tensor), f"{where}: {type(actual).__name__}"
        assert actual.dtype == expected.dtype and actual.shape == expected.shape, where
        assert torch.equal(actual, expected), f"{where}: values differ"
    elif isinstance(expected, dict):
        assert isinstance(actual, dict), f"{where}: {type(actual).__name__}"
        assert list(actual) == list(expected), f"{where}: keys {list(actual)} != {list(expected)}"
        for key in expected:
            _assert_same(actual[key], expected[key], f"{where}[{key!r}]")
    elif isinstance(expected, (list, tuple)):
        assert type(actual) is type(expected) and len(actual) == len(expected), where
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _assert_same(a, e, f"{where}[{i}]")
    else:
        assert actual == expected, f"{where}: {actual!r} != {expected!r}"


def _fresh_from(exported: dict[str, Any]) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A fresh model and optimizer, built as the training script built them, loaded from an
    export as a user's script would load it."""
    model, optimizer = er.build()
    model.load_state_dict(exported["model"], strict=True)
    optimizer.load_state_dict(exported["optimizer"])
    return model, optimizer


def _optimizer_state_sorted(state: dict[str, Any]) -> dict[str, Any]:
    """An optimizer state dict with its per-parameter state in parameter order (the order in
    which a single process creates it; a zero:N export takes it rank by rank)."""
    return {**state, "state": dict(sorted(state["state"].items()))}


def _check_export(
    exported: dict[str, Any],
    model: dict[str, torch.Tensor],
    optimizer: dict[str, Any],
    step: int,
) -> None:
    """The export loads into a fresh model (strict) and optimizer, and both then hold what
    the ranks held, bit for bit."""
    assert exported["step"] == step and exported["extra"] == {"data_position": step}
    fresh_model, fresh_optimizer = _fresh_from(exported)
    _assert_same(fresh_model.state_dict(), model, "model")
    _assert_same(
        _optimizer_state_sorted(fresh_optimizer.state_dict()),
        _optimizer_state_sorted(optimizer),
        "optimizer",
    )
    # AdamW's state for every parameter: no rank's part left out
    assert len(fresh_optimizer.state_dict()["state"]) == len(list(fresh_model.parameters()))


def _dcp_template(model: torch.nn.Module, optimizer_state: dict[str, Any]) -> dict[str, Any]:
    """A fresh state dict to ``dcp.load`` into: a fresh model's ``state_dict()`` (its own
    tensors are loaded in place) and zeros shaped as the optimizer state."""
    return {
        "model": model.state_dict(),
        "optimizer": {
            "state": {
                i: {
                    k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else v
                    for k, v in s.items()
                }
                for i, s in optimizer_state["state"].items()
            },
            "param_groups": [{k: None for k in group} for group in optimizer_state["param_groups"]],
        },
        "step": -1,
        "extra": {"data_position": -1},
    }


def _zeros_like(value: Any) -> Any:
    return torch.zeros_like(value) if isinstance(value, torch.Tensor) else value


def _dcp_load(path: Path, template: dict[str, Any]) -> dict[str, Any]:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(template, checkpoint_id=path, no_dist=True)
    return template


def _check_dcp(path: Path, expected: dict[str, Any], tmp: Path) -> None:
    """DCP: ``dcp.load`` into a fresh state dict gives the export's tensors and values; and
    the whole tree read back without a template (``dcp_to_torch_save``, whose optimizer
    state keys come back as strings) loads into a fresh model and optimizer."""
    fresh, _ = er.build()
    loaded = _dcp_load(path, _dcp_template(fresh, expected["optimizer"]))
    _assert_same(fresh.state_dict(), expected["model"], "dcp model, loaded in place")
    _assert_same(loaded, expected, "dcp")
    dcp_to_torch_save(path, tmp / "from-dcp.pt")
    whole = torch.load(tmp / "from-dcp.pt", weights_only=True)
    optimizer = whole["optimizer"]
    optimizer["state"] = {int(k): v for k, v in optimizer["state"].items()}
    model, fresh_optimizer = _fresh_from(whole)
    _assert_same(model.state_dict(), expected["model"], "dcp_to_torch_save model")
    _assert_same(fresh_optimizer.state_dict(), expected["optimizer"], "dcp_to_torch_save optimizer")


# -- in one process (a world of one rank) ----------------------------------------------------------


@pytest.fixture(scope="module")
def one_rank_runs(
    tmp_path_factory: pytest.TempPathFactory, one_rank: None
) -> Iterator[dict[str, tuple[Path, dict[str, Any], dict[str, Any]]]]:
    """Every exportable strategy trained on one rank in this process: its checkpoint
    directory, and the model's and the optimizer's state dicts after the last checkpoint."""
    root = tmp_path_factory.mktemp("one-rank")
    runs = {}
    for spec in ONE_RANK_STRATEGIES:
        directory = root / spec.replace(":", "-")
        model, optimizer = er.train(spec, directory, rank=0)
        runs[spec] = (directory, model.state_dict(), optimizer.state_dict())
    yield runs


@pytest.mark.unit
@pytest.mark.timeout(120)
@pytest.mark.parametrize("spec", ONE_RANK_STRATEGIES)
def test_an_export_loads_into_a_fresh_model_and_optimizer_bitwise(
    spec: str, one_rank_runs: dict[str, Any], tmp_path: Path
) -> None:
    directory, model, optimizer = one_rank_runs[spec]
    done = export_checkpoint(directory, tmp_path / "model.pt")
    assert (done.step, done.to, done.world_size) == (er.STEPS, "torch", 1)
    # as checkpoints record it: local:2 as "local", diloco:2 as "diloco"
    assert done.strategy == (spec.partition(":")[0] if spec[0] in "ld" else spec)
    exported = torch.load(done.path, weights_only=True)
    assert set(exported) == {"model", "optimizer", "step", "extra"}
    _check_export(exported, model, optimizer, er.STEPS)
    _assert_same(single_process_state(directory), exported, "single_process_state")

    dcp_done = export_checkpoint(directory, tmp_path / "model.dcp", to="dcp")
    assert dcp_done.path.is_dir() and (dcp_done.path / ".metadata").is_file()
    _check_dcp(dcp_done.path, exported, tmp_path)
    # nothing left beside the outputs (the staging copies are renamed into place)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["from-dcp.pt", "model.dcp", "model.pt"]


@pytest.mark.unit
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


@pytest.mark.unit
@pytest.mark.timeout(60)
def test_a_damaged_newest_checkpoint_is_skipped_with_a_warning(
    one_rank_runs: dict[str, Any], tmp_path: Path
) -> None:
    import shutil

    directory = tmp_path / "checkpoints"
    shutil.copytree(one_rank_runs["bsp"][0], directory)
    rank_file = directory / "step-000004" / "rank-0.pt"
    data = bytearray(rank_file.read_bytes())
    data[-5] ^= 0xFF
    rank_file.write_bytes(bytes(data))
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


@pytest.mark.unit
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
    assert "bsp, zero:1, zero:2, local:H, diloco:H, hogwild export" in message
    assert "nothing was written" in message
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoints"]


@pytest.mark.unit
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


@pytest.mark.unit
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
    with pytest.raises(UsageError, match="step must be an integer >= 0.*got -1"):
        export_checkpoint(directory, tmp_path / "x", step=-1)
    (tmp_path / "empty").mkdir()
    with pytest.raises(CheckpointError, match="no checkpoint in .*empty: nothing to export"):
        export_checkpoint(tmp_path / "empty", tmp_path / "x")
    assert set(EXPORTABLE) == {"bsp", "zero:1", "zero:2", "local", "diloco", "hogwild"}


# -- the command line, in this process -------------------------------------------------------------


@pytest.mark.unit
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
    assert "exported the checkpoint of step 4 (bsp, 1 ranks" in err
    assert "torch.load(path, weights_only=True)" in err
    argv = ["checkpoint", "export", str(run / "checkpoints"), str(tmp_path / "b"), "--to", "dcp"]
    assert cli.main([*argv, "--step", "2"]) == 0
    assert (tmp_path / "b" / ".metadata").is_file()
    a = torch.load(tmp_path / "a.pt", weights_only=True)
    _check_export(a, one_rank_runs["bsp"][1], one_rank_runs["bsp"][2], er.STEPS)


@pytest.mark.unit
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


# -- real ranks: every rank's share and shard ------------------------------------------------------


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[dict[str, Any]]]:
    """Every strategy of ``export_ranks.STRATEGIES`` trained on two gloo ranks (one spawn)."""
    root = tmp_path_factory.mktemp("two-ranks")
    return root, run_ranks(er.trained, 2, str(root), timeout_s=240)


def _expected_optimizer(spec: str, ranks: list[dict[str, Any]]) -> dict[str, Any]:
    """What the export must hold of the optimizer: the replicas' (bsp: the same on every
    rank), every rank's owned part (zero:N), or rank 0's (local SGD, DiLoCo)."""
    if not spec.startswith("zero"):
        return ranks[0][spec]["optimizer"]
    state: dict[int, Any] = {}
    for r in ranks:
        owned = r[spec]["optimizer"]["state"]
        assert not set(owned) & set(state), "a parameter's state on two ranks"
        state.update(owned)
    return {**ranks[0][spec]["optimizer"], "state": state}


@pytest.mark.ranks
@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", er.STRATEGIES)
def test_two_ranks_export_whole_model_and_optimizer(
    spec: str, two_ranks: tuple[Path, list[dict[str, Any]]], tmp_path: Path
) -> None:
    """bsp's shares, zero:N's shards of the optimizer state (each rank holds some, none all),
    local SGD's and DiLoCo's rank 0: the export loads strictly into a fresh model and
    optimizer, and both then hold bitwise what the ranks held after the last checkpoint."""
    root, ranks = two_ranks
    directory = root / spec.replace(":", "-")
    done = export_checkpoint(directory, tmp_path / "model.pt")
    assert done.world_size == 2
    exported = torch.load(done.path, weights_only=True)
    _check_export(exported, ranks[0][spec]["model"], _expected_optimizer(spec, ranks), er.STEPS)
    if spec in ("bsp", "zero:1", "zero:2"):
        _assert_same(exported["model"], ranks[1][spec]["model"], "rank 1's replica")
    if spec == "bsp":
        _assert_same(
            exported["optimizer"], ranks[1][spec]["optimizer"], "rank 1's optimizer replica"
        )
    if spec.startswith("zero"):  # a sharded optimizer state: each rank held only a part
        held = [len(r[spec]["optimizer"]["state"]) for r in ranks]
        assert all(0 < n < len(exported["optimizer"]["state"]) for n in held), held
    dcp_done = export_checkpoint(directory, tmp_path / "model.dcp", to="dcp")
    _check_dcp(dcp_done.path, exported, tmp_path)


def _parameter_names(model: torch.nn.Module) -> set[str]:
    return {name for name, _ in model.named_parameters()}


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_bsp_with_batch_norm_exports_the_parameters_and_each_buffer_from_one_rank(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    """BatchNorm's running statistics are each rank's own between steps under ``bsp`` (rank
    0's are broadcast at the start of the next step, as DDP's ``broadcast_buffers``): the
    parameters are every replica's, and each buffer is the one the rank that wrote its share
    held (docs/checkpoints.md, "Opening a checkpoint with torch alone")."""
    root, ranks = two_ranks
    exported = single_process_state(root / er.BATCH_NORM)
    model, _ = er.build(batch_norm=True)
    model.load_state_dict(exported["model"], strict=True)
    held = [r[er.BATCH_NORM]["model"] for r in ranks]
    for name, value in exported["model"].items():
        if name in _parameter_names(model):
            _assert_same(value, held[0][name], name)
            _assert_same(value, held[1][name], name)
        else:
            assert any(torch.equal(value, h[name]) for h in held), name
    differ = [n for n in held[0] if not torch.equal(held[0][n], held[1][n])]
    assert differ == ["1.running_mean", "1.running_var"]  # what the test is about


@pytest.mark.ranks
@pytest.mark.timeout(300)
def test_bsp_with_batch_norm_exports_rank_0s_buffers(
    two_ranks: tuple[Path, list[dict[str, Any]]],
) -> None:
    # BatchNorm's running statistics differ between ranks after a step (rank 0's are
    # broadcast at the next step's start): the checkpoint holds rank 0's, which the run goes on
    # with, so the export and ``sync.load`` do too.
    root, ranks = two_ranks
    exported = single_process_state(root / er.BATCH_NORM)
    _assert_same(exported["model"], ranks[0][er.BATCH_NORM]["model"], "rank 0's model")


# -- end to end: gradsync run, then gradsync checkpoint export -------------------------------------


@pytest.mark.e2e
@pytest.mark.timeout(300)
def test_a_run_exported_by_the_command_is_its_final_model(tmp_path: Path, one_rank: None) -> None:
    """``gradsync run --nproc 2 --workload charlm --steps 6 --checkpoint-every 3``, then
    ``gradsync checkpoint export``: the exported model loads strictly into a fresh charlm and
    is bitwise the run's final model; the optimizer state loads into a fresh optimizer and is
    what ``sync.load`` of the same checkpoint gives one rank (bsp resumes on another world
    size); DCP gives the same tensors."""
    from gradsync.workloads import make_workload

    run = tmp_path / "run"
    flags = ["--workload", "charlm", "--steps", "6", "--checkpoint-every", "3", "--no-plots"]
    proc = gradsync("run", "--nproc", "2", "--out", str(run), *flags, "--no-progress", timeout=200)
    assert proc.returncode == 0, proc.stderr[-3000:]
    out = tmp_path / "charlm.pt"
    proc = gradsync("checkpoint", "export", str(run), str(out), timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "exported the checkpoint of step 6 (bsp, 2 ranks" in proc.stderr
    proc = gradsync(
        "checkpoint", "export", str(run / "checkpoints"), str(tmp_path / "charlm.dcp"),
        "--to", "dcp", timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]

    exported = torch.load(out, weights_only=True)
    assert exported["step"] == 6 and exported["extra"] == {"data_position": 6}
    workload = make_workload("charlm", seed=0)
    model = workload.build_model()
    model.load_state_dict(exported["model"], strict=True)
    final = torch.load(run / "final_model.pt", weights_only=True)
    _assert_same(model.state_dict(), final, "the run's final model")
    optimizer = workload.make_optimizer(model, workload.default_lr)
    optimizer.load_state_dict(exported["optimizer"])

    # gradsync's own loader, on one rank, of the same checkpoint
    resumed_model = workload.build_model()
    resumed_optimizer = workload.make_optimizer(resumed_model, workload.default_lr)
    sync = gs.Synchronizer(resumed_model, resumed_optimizer, strategy="bsp", timeout_s=60)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", CheckpointWarning)
            assert sync.load(run / "checkpoints") is not None
    finally:
        sync.close()
    _assert_same(model.state_dict(), resumed_model.state_dict(), "sync.load's model")
    _assert_same(optimizer.state_dict(), resumed_optimizer.state_dict(), "sync.load's optimizer")

    fresh = workload.build_model()
    template = {"model": fresh.state_dict()}
    _dcp_load(tmp_path / "charlm.dcp", template)
    _assert_same(fresh.state_dict(), final, "DCP's model, loaded in place")
    dcp_to_torch_save(tmp_path / "charlm.dcp", tmp_path / "from-dcp.pt")
    whole = torch.load(tmp_path / "from-dcp.pt", weights_only=True)
    whole["optimizer"]["state"] = {int(k): v for k, v in whole["optimizer"]["state"].items()}
    _assert_same(whole, exported, "DCP, read back whole")
