"""--resume that cannot continue the run is refused before any worker starts: checkpoints that
are all unusable (not a silent start at step 0), another compressor than the checkpoint's
(not ``KeyError: 'inner'``), or streaming DiLoCo fragments cut otherwise (not a worker
failure); and ``sync.load`` refuses another compressor too, naming both."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch

import gradsync.processes.launch
from gradsync import Synchronizer
from gradsync.checkpoint import CheckpointError, CheckpointStore
from gradsync.checkpoint.checkpointer import check_resumable
from gradsync.checkpoint.rng import rng_state
from gradsync.errors import UsageError
from gradsync.runner.cli import main

pytestmark = pytest.mark.unit


def _checkpoint(directory: Path, step: int, **state: Any) -> Path:
    store = CheckpointStore(directory, keep=5)
    store.save(step, 0, 1, {"strategy": "bsp", "extra": {}, **state})
    store.commit(step, 1)
    return store.step_dir(step)


def _corrupt(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))


def test_no_checkpoint_at_all_starts_at_step_0(tmp_path: Path) -> None:
    check_resumable(tmp_path / "absent", "none")
    (tmp_path / "empty").mkdir()
    check_resumable(tmp_path / "empty", "none")


def test_checkpoints_none_of_them_usable_are_refused_with_each_reason(tmp_path: Path) -> None:
    _corrupt(_checkpoint(tmp_path, 10, compression="none") / "rank-0.pt")
    (_checkpoint(tmp_path, 20, compression="none") / "MANIFEST.json").unlink()
    with pytest.raises(UsageError) as refused:
        check_resumable(tmp_path, "none")
    message = str(refused.value)
    assert message.startswith(f"--resume: none of the 2 checkpoint(s) in {tmp_path} is usable")
    assert "step-000020: incomplete: no MANIFEST.json" in message
    assert "step-000010: rank-0.pt is corrupted" in message
    assert "--overwrite" in message and "\n" not in message


def test_an_older_usable_checkpoint_is_resumed_from(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 10, compression="none")
    _corrupt(_checkpoint(tmp_path, 20, compression="none") / "rank-0.pt")
    check_resumable(tmp_path, "none")  # step 10, with the workers' warning about step 20


@pytest.mark.parametrize(
    ("saved", "now", "hint"),
    [
        ("none", "topk:0.1", "(no --compress)"),
        ("powersgd:2", "none", "(--compress powersgd:2)"),
        ("int8", "fp16", "(--compress int8)"),
    ],
)
def test_another_compressor_is_refused_naming_both(
    tmp_path: Path, saved: str, now: str, hint: str
) -> None:
    _checkpoint(tmp_path, 10, compression=saved)
    check_resumable(tmp_path, saved)
    with pytest.raises(UsageError) as refused:
        check_resumable(tmp_path, now)
    message = str(refused.value)
    assert f"written with compression {saved}, this run uses {now}" in message
    assert hint in message


def test_a_checkpoint_from_before_compressors_were_recorded_is_not_judged(tmp_path: Path) -> None:
    _checkpoint(tmp_path, 10)
    check_resumable(tmp_path, "topk:0.1")


def _diloco_checkpoint(directory: Path, streaming: dict[str, Any] | None) -> None:
    """A checkpoint as streaming DiLoCo writes it (``streaming``: its strategy state's record,
    None for plain DiLoCo, which writes none)."""
    strategy: dict[str, Any] = {} if streaming is None else {"streaming": streaming}
    _checkpoint(directory, 10, strategy="diloco", compression="none", sync={"strategy": strategy})


@pytest.mark.parametrize(
    ("streaming", "now", "refusal"),
    [
        ({"fragments": 4, "split": "layers"}, "diloco:8:4:1", "split by layers; this run is"),
        ({"fragments": 4, "split": "rows"}, "diloco:8:4:1:layers", "split by rows; this run is"),
        ({"fragments": 4}, "diloco:8:4", "split by layers"),  # saved before splits were recorded
        ({"fragments": 4, "split": "rows"}, "diloco:8:2", "with 4 fragment(s)"),
        (None, "diloco:8:4", "with 1 fragment(s)"),
    ],
)
def test_streaming_fragments_another_run_would_misread_are_refused(
    tmp_path: Path, streaming: dict[str, Any] | None, now: str, refusal: str
) -> None:
    _diloco_checkpoint(tmp_path, streaming)
    with pytest.raises(UsageError) as refused:
        check_resumable(tmp_path, "none", now)
    message = str(refused.value)
    assert message.startswith("--resume: the checkpoint was saved by diloco") and refusal in message


@pytest.mark.parametrize(
    ("streaming", "now"),
    [
        ({"fragments": 4, "split": "layers"}, "diloco:8:4:1:layers"),
        ({"fragments": 4, "split": "rows"}, "diloco:8:4:1:0.5"),
        ({"fragments": 4}, "diloco:16:4:2:layers"),
        (None, "diloco:8"),
        (None, "diloco:16:1:0:0:layers"),  # one fragment: every split is the same layout
        ({"fragments": 4, "split": "rows"}, "local:8"),  # another strategy: the workers judge it
    ],
)
def test_streaming_fragments_the_run_reads_alike_pass(
    tmp_path: Path, streaming: dict[str, Any] | None, now: str
) -> None:
    _diloco_checkpoint(tmp_path, streaming)
    check_resumable(tmp_path, "none", now)


@pytest.mark.parametrize(
    ("saved", "flag", "refusal"),
    [
        (
            "compressor",
            "--compress=sign",
            "checkpoint at step 10 was written with compression none",
        ),
        (
            "layers",
            "--strategy=diloco:8:4",
            "the checkpoint was saved by diloco with its fragments split by layers; this run is "
            "diloco:8:4:1, split by rows: resume with the same split (diloco:H:F:TAU:ALPHA:layers)",
        ),
    ],
)
def test_cli_refuses_before_launching_or_rewriting_config(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    saved: str,
    flag: str,
    refusal: str,
) -> None:
    launched: list[object] = []
    monkeypatch.setattr(gradsync.processes.launch, "launch", lambda *a, **k: launched.append(a))
    run = tmp_path / "run"
    if saved == "compressor":
        _checkpoint(run / "checkpoints", 10, compression="none")
    else:
        _diloco_checkpoint(run / "checkpoints", {"fragments": 4, "split": saved})
    config = {"saved": saved}
    (run / "config.json").write_text(json.dumps(config))
    code = main(["run", "--workload=mlp", "--resume", flag, f"--out={run}"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and not launched
    assert len(err) == 1 and err[0].startswith(f"gradsync: error: --resume: {refusal}"), err
    assert json.loads((run / "config.json").read_text()) == config


def _sync(compression: str | None) -> Synchronizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), compression=compression)


def _rank_0_checkpoint(directory: Path, sync: Synchronizer, **change: Any) -> None:
    """What ``sync.save()`` writes for rank 0 after step 3 (written here without its background
    writer), with ``change`` in place of its entries."""
    _checkpoint(
        directory,
        3,
        **{
            "model": sync.model.state_dict(),
            "optimizer": sync.optimizer.state_dict(),
            "sync": {**sync.state_dict(), "step": 3},
            "rng": rng_state(),
            "strategy": sync.strategy.name,
            "compression": sync.compressor.spec,
            "layout": {"workers": 1, "servers": 0},
            **change,
        },
    )


def test_load_refuses_another_compressors_state(tmp_path: Path, one_rank: None) -> None:
    plain = _sync(None)
    _rank_0_checkpoint(tmp_path, plain)
    plain.close()
    compressed = _sync("topk:0.5")
    try:
        with pytest.raises(CheckpointError, match="compression none, this run uses topk:0.5"):
            compressed.load(tmp_path)  # was: KeyError: 'inner'
    finally:
        compressed.close()
    again = _sync(None)
    try:
        assert again.load(tmp_path) == {"step": 3}
    finally:
        again.close()


def test_resuming_on_another_world_size_restarts_error_feedback(
    tmp_path: Path, one_rank: None
) -> None:
    two = _sync("topk:0.5")
    store = CheckpointStore(tmp_path)
    for rank in range(2):  # a BSP checkpoint of two ranks, resumed here on one
        state = {
            "model": two.model.state_dict(),
            "optimizer": two.optimizer.state_dict(),
            "sync": {**two.state_dict(), "step": 3},
            "rng": rng_state(),
            "strategy": two.strategy.name,
            "compression": two.compressor.spec,
            "layout": {"workers": 2, "servers": 0},
            "extra": {},
        }
        store.save(3, rank, 2, state)
    store.commit(3, 2)
    try:
        with pytest.warns(UserWarning, match="restarts from zero"):
            assert two.load(tmp_path) == {"step": 3}  # was: KeyError: 'inner'
    finally:
        two.close()


def test_load_refuses_another_strategys_state_naming_the_fix(
    tmp_path: Path, one_rank: None
) -> None:
    plain = _sync(None)
    _rank_0_checkpoint(tmp_path, plain, strategy="local")  # as a local:H run writes it
    try:
        with pytest.raises(CheckpointError) as refused:
            plain.load(tmp_path)
    finally:
        plain.close()
    message = str(refused.value)
    assert "written by strategy 'local', this run uses 'bsp'" in message, message
    assert "Resume with a 'local' strategy" in message and "new directory" in message, message


@pytest.mark.parametrize("strategy", ["gossip:4", "diloco:8", "ssp:1"])
def test_another_nproc_for_a_strategy_that_does_not_resize_is_refused_before_launch(
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    strategy: str,
) -> None:
    """Found in a worker, the refusal came after this run's config.json had replaced the saved
    one: the plain --resume that followed failed the same way (a user tester's)."""
    launched: list[object] = []
    monkeypatch.setattr(gradsync.processes.launch, "launch", lambda *a, **k: launched.append(a))
    run = tmp_path / "run"
    _checkpoint(run / "checkpoints", 10, strategy=strategy.split(":")[0], compression="none")
    config = {"strategy": strategy, "nproc": 2, "workload": "mlp", "steps": 40}
    (run / "config.json").write_text(json.dumps(config))
    code = main(["run", "--resume", "--nproc", "3", f"--out={run}"])
    err = capsys.readouterr().err.splitlines()
    assert code == 2 and not launched, err
    assert err[-1].startswith(
        "gradsync: error: --resume with --nproc 3: the saved run has 2 ranks, and a "
        f"{strategy} checkpoint resumes only on as many"
    ), err
    assert json.loads((run / "config.json").read_text()) == config
