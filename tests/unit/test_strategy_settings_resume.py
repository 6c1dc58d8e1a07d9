"""A checkpoint saved under one strategy's settings is not loaded under others: ``sync.load``
of a ``local:2`` checkpoint by a ``local:4`` Synchronizer is refused naming both, as ``gradsync
run --resume`` refuses ``--strategy local:4`` for a ``local:2`` run (before: it loaded without
a word, and the run went on averaging every 4 steps from a state saved for every 2). The check
is one (``gradsync.checkpoint.settings``): the CLI's comparison of config.json and the
checkpoint's own record go through it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from gradsync import Synchronizer
from gradsync.checkpoint import CheckpointError, CheckpointStore
from gradsync.checkpoint.checkpointer import check_resumable
from gradsync.checkpoint.settings import STRATEGY_SPEC, same_strategy
from gradsync.errors import UsageError
from gradsync.strategies import parse_strategy

pytestmark = pytest.mark.unit


def _sync(strategy: str) -> Synchronizer:
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 4)
    return Synchronizer(model, torch.optim.SGD(model.parameters(), lr=0.1), strategy=strategy)


def _train_and_save(directory: Path, strategy: str, steps: int = 3) -> None:
    sync = _sync(strategy)
    try:
        for _ in range(steps):
            with sync.step():
                sync.model(torch.randn(2, 8)).sum().backward()
        sync.save(directory)
    finally:
        sync.close()


@pytest.mark.parametrize(
    ("saved", "now"),
    [
        ("local:2", "local:4"),
        ("diloco:4", "diloco:8"),
        ("diloco:4", "diloco:4:outer_lr=0.5"),
        ("noloco:2", "noloco:2:outer_momentum=0.5"),
    ],
)
def test_load_refuses_other_settings_of_the_same_strategy_naming_both(
    tmp_path: Path, one_rank: None, inline_writer: None, saved: str, now: str
) -> None:
    _train_and_save(tmp_path, saved)
    other = _sync(now)
    try:
        with pytest.raises(CheckpointError) as refused:
            other.load(tmp_path)  # was: loaded, {"step": 3}
    finally:
        other.close()
    message = str(refused.value)
    assert f"saved under strategy {saved}, this run uses {now}" in message, message
    assert f"Resume with strategy='{saved}'" in message, message
    assert f"--strategy {saved}" in message and "\n" not in message, message
    same = _sync(saved)
    try:
        assert same.load(tmp_path) == {"step": 3}
    finally:
        same.close()


def test_a_checkpoint_written_before_specs_were_recorded_still_loads(
    tmp_path: Path, one_rank: None, inline_writer: None
) -> None:
    _train_and_save(tmp_path, "local:2")
    # what gradsync wrote before: the name only (``local``)
    store = CheckpointStore(tmp_path)
    info = store.latest()
    assert info is not None
    state = store.load(info, 0)
    assert state.pop(STRATEGY_SPEC) == "local:2"
    store.save(info.step + 1, 0, 1, state)
    store.commit(info.step + 1, 1)
    other = _sync("local:4")
    try:
        assert other.load(tmp_path) == {"step": 3}  # not judged, as before
    finally:
        other.close()


@pytest.mark.parametrize(
    "spec",
    [
        "local:4",
        "diloco:8",
        "diloco:8:2",
        "diloco:8:4:1:0.5:layers",
        "diloco:4:outer_lr=0.5:outer_momentum=0.0",
        "gossip:3",
        "noloco:2:outer_lr=1.5",
    ],
)
def test_the_recorded_spec_is_the_canonical_one_of_the_strategy_built(spec: str) -> None:
    recorded = parse_strategy(spec).settings_spec()
    assert recorded is not None and same_strategy(recorded, spec), recorded


@pytest.mark.parametrize("spec", ["bsp", "zero:1", "zero:2", "hogwild", "ssp:2", "async"])
def test_strategies_whose_name_is_their_spec_record_none(spec: str) -> None:
    assert parse_strategy(spec).settings_spec() is None


def _checkpoint(directory: Path, **state: Any) -> None:
    store = CheckpointStore(directory)
    store.save(10, 0, 1, {"extra": {}, "compression": "none", **state})
    store.commit(10, 1)


def test_resume_refuses_the_checkpoints_own_settings_before_any_worker(tmp_path: Path) -> None:
    """``gradsync run --resume`` reads the spec the checkpoint holds too (a run whose
    config.json is torn or gone is not compared otherwise), with the same words."""
    _checkpoint(tmp_path, strategy="local", **{STRATEGY_SPEC: "local:2"})
    check_resumable(tmp_path, "none", "local:2")
    check_resumable(tmp_path, "none", "local:02")  # the same spec
    check_resumable(tmp_path, "none", "diloco:2")  # another strategy: the workers refuse it
    with pytest.raises(UsageError) as refused:
        check_resumable(tmp_path, "none", "local:4")
    message = str(refused.value)
    assert message.startswith(
        "--resume: checkpoint at step 10 was saved under strategy local:2, this run uses local:4"
    ), message
