"""A checkpoint every step under a learning-rate schedule: ``bsp`` keeps the optimizer's
``param_groups`` beside the replicated share, so a new learning rate does not make every
snapshot walk and encode the whole model and optimizer state again, and a resume still gets
the saved step's learning rate back."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

import gradsync as gs
from gradsync.fault import CheckpointStore
from gradsync.fault.resume import PARAM_GROUPS

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60), pytest.mark.usefixtures("one_rank")]


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
            writer = sync._writer
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


def test_the_owners_encoding_is_kept_and_not_sent_with_every_snapshot(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``replicated_owners`` (one number per tensor) travels as a kept encoding, like the
    share's: its text goes to the writer once per layout, not in every held snapshot."""
    model, opt, sync = _trained(0.1)
    kept_parts: list[dict[str, object]] = []
    try:
        for _ in range(3):
            _step(model, sync)
            writer = sync._writer
            if writer is not None and not kept_parts and "submit" not in vars(writer):
                submit = writer.submit

                def seen(step: int, packed: Any, submit: Any = submit, **kw: Any) -> None:
                    tree, kept, _ = packed.header_parts()
                    names = [tree["root"]["d"][i][0] for i, _ in kept]
                    kept_parts.append(dict(zip(names, (e for _, e in kept), strict=True)))
                    submit(step, packed, **kw)

                monkeypatch.setattr(writer, "submit", seen)
            sync.save(tmp_path, wait=False)
        sync.wait_for_checkpoints()
    finally:
        sync.close()
    assert len(kept_parts) == 2  # the saves after the writer was made
    for parts in kept_parts:
        assert set(parts) == {"replicated", "replicated_owners"}
    assert kept_parts[0]["replicated_owners"] is kept_parts[1]["replicated_owners"]
    store = CheckpointStore(tmp_path)
    info = store.latest()
    assert info is not None
    owners = store.load(info, 0)["replicated_owners"]
    # a world of one: rank 0 owns every tensor, 4 parameters and 3 AdamW tensors for each
    assert owners == [0] * (4 + 3 * 4)
