"""A checkpoint every step under a learning-rate schedule: ``bsp`` keeps the optimizer's
``param_groups`` beside the replicated share, so a new learning rate does not make every
snapshot walk and encode the whole model and optimizer state again, and a resume still gets
the saved step's learning rate back."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch

import gradsync as gs
from gradsync.checkpoint import CheckpointStore
from gradsync.checkpoint.checkpointer import PARAM_GROUPS

pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(60),
    pytest.mark.usefixtures("one_rank", "inline_writer"),
]


def _trained(lr: float) -> tuple[torch.nn.Module, torch.optim.Optimizer, gs.Synchronizer]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)
    return model, opt, gs.Synchronizer(model, opt, strategy="bsp", timeout_s=30)


def _step(model: torch.nn.Module, sync: gs.Synchronizer) -> None:
    with sync.step():
        model(torch.randn(4, 6)).sum().backward()


def test_a_new_learning_rate_reuses_the_shares_encoding_and_resumes_with_its_value(
    tmp_path: Path,
) -> None:
    model, opt, sync = _trained(0.1)
    kept = []
    try:
        for step in range(4):
            _step(model, sync)
            opt.param_groups[0]["lr"] = 0.1 / (step + 2)  # what a scheduler does every step
            sync.save(tmp_path, wait=False)
            writer = sync._checkpoints.writer
            assert writer is not None
            # the replicated share's encoding (the one at the start of the state)
            kept.extend(e for e in writer.pool.shares.values() if e.at == ())
        sync.wait_for_checkpoints()
    finally:
        sync.close()
    # One encoding, made at the first save and reused by the three after it.
    assert len(kept) == 4 and all(k is kept[0] for k in kept)

    model2, opt2, sync2 = _trained(0.5)
    try:
        loaded = sync2.load(tmp_path)
    finally:
        sync2.close()
    assert loaded is not None and loaded["step"] == 4
    assert opt2.param_groups[0]["lr"] == 0.1 / 5
    assert opt2.state_dict()["param_groups"] == opt.state_dict()["param_groups"]
    for a, b in zip(model.state_dict().values(), model2.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    # In the file: the groups beside the share, none inside it.
    store = CheckpointStore(tmp_path)
    info = store.latest()
    assert info is not None
    raw = store.load(info, 0)
    assert raw[PARAM_GROUPS][0]["lr"] == 0.1 / 5
    assert "param_groups" not in raw["replicated"]["optimizer"]


def _kept_per_save(
    sync: gs.Synchronizer,
    model: torch.nn.Module,
    directory: Path,
    monkeypatch: pytest.MonkeyPatch,
    between: Callable[[int], None] = lambda step: None,
    saves: int = 4,
) -> list[dict[str, Any]]:
    """Each save's kept encodings by the state's key (``Packed.header_parts``), from the
    second save on (the first makes the writer)."""
    kept_parts: list[dict[str, Any]] = []
    try:
        for step in range(saves):
            _step(model, sync)
            between(step)
            writer = sync._checkpoints.writer
            if writer is not None and "submit" not in vars(writer):
                submit = writer.submit

                def seen(step: int, packed: Any, submit: Any = submit, **kw: Any) -> None:
                    tree, kept, _ = packed.header_parts()
                    names = [tree["root"]["d"][i][0] for i, _ in kept]
                    kept_parts.append(dict(zip(names, (e for _, e in kept), strict=True)))
                    submit(step, packed, **kw)

                monkeypatch.setattr(writer, "submit", seen)
            sync.save(directory, wait=False)
        sync.wait_for_checkpoints()
    finally:
        sync.close()
    assert len(kept_parts) == saves - 1
    return kept_parts


def test_the_owners_are_a_kept_encoding_and_the_groups_are_made_at_each_save(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``replicated_owners`` (one number per tensor) travels as a kept encoding, like the
    share's: its text goes to the writer once, not in every held snapshot. The groups are a
    few numbers, encoded at each save."""
    model, opt, sync = _trained(0.1)
    kept = _kept_per_save(sync, model, tmp_path, monkeypatch)
    for parts in kept:
        assert set(parts) == {"replicated", "replicated_owners"}
    assert kept[0]["replicated_owners"] is kept[-1]["replicated_owners"]
    store = CheckpointStore(tmp_path)
    info = store.latest()
    assert info is not None
    raw = store.load(info, 0)
    # a world of one: rank 0 owns every tensor, 4 parameters and 3 AdamW tensors for each
    assert raw["replicated_owners"] == [0] * (4 + 3 * 4)
    assert raw[PARAM_GROUPS] == opt.state_dict()["param_groups"]


def test_groups_changed_at_every_step_are_never_kept(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt, sync = _trained(0.1)

    def schedule(step: int) -> None:
        opt.param_groups[0]["lr"] = 0.1 / (step + 2)

    kept = _kept_per_save(sync, model, tmp_path, monkeypatch, schedule)
    assert all(PARAM_GROUPS not in parts for parts in kept)


@pytest.mark.parametrize(
    "change",
    ["lr", "new key", "group added", "params appended", "tensor lr", "tensor lr in place"],
)
def test_a_changed_group_is_saved_as_it_is_now(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    """The file holds the groups of the step it was saved at, whatever changed in them."""
    model, opt, sync = _trained(0.1)
    extra = torch.nn.Parameter(torch.ones(2))

    def at_step(step: int) -> None:
        group = opt.param_groups[0]
        if change == "tensor lr in place" and step == 0:
            group["lr"] = torch.tensor(0.1, dtype=torch.float64)
        if step != 3:
            return
        if change == "lr":
            group["lr"] = 0.025
        elif change == "new key":
            group["note"] = "x"
        elif change == "group added":
            opt.add_param_group({"params": [extra], "lr": 0.5})
        elif change == "params appended":
            group["params"].append(extra)
        elif change == "tensor lr":
            group["lr"] = torch.tensor(0.025, dtype=torch.float64)
        elif change == "tensor lr in place":  # no tag changes: such groups are never kept
            group["lr"].fill_(0.025)

    _kept_per_save(sync, model, tmp_path, monkeypatch, at_step, saves=5)
    store = CheckpointStore(tmp_path)
    info = store.latest()
    assert info is not None and info.step == 5
    saved = store.load(info, 0)[PARAM_GROUPS]
    expected = opt.state_dict()["param_groups"]
    if change.startswith("tensor lr"):
        assert float(saved[0]["lr"]) == 0.025
        saved[0]["lr"] = expected[0]["lr"] = 0.025
    assert saved == expected


def test_an_ordered_group_reordered_in_place_is_saved_in_its_new_order(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``move_to_end`` changes the order alone: the file keeps the groups in their new order
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    group = OrderedDict(params=list(model.parameters()), lr=0.1)
    opt = torch.optim.AdamW([group], weight_decay=0.01)  # type: ignore[list-item]
    sync = gs.Synchronizer(model, opt, strategy="bsp", timeout_s=30)

    def reorder(step: int) -> None:
        if step == 3:
            opt.param_groups[0].move_to_end("lr")

    _kept_per_save(sync, model, tmp_path, monkeypatch, reorder, saves=5)
    store = CheckpointStore(tmp_path)
    info = store.latest()
    assert info is not None
    saved = store.load(info, 0)[PARAM_GROUPS]
    assert list(saved[0]) == list(opt.state_dict()["param_groups"][0])
