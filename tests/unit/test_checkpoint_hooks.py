"""A strategy of a user's that still defines the checkpoint members the protocol dropped
(``prepare_checkpoint``, ``checkpoint_held``, ``flush_checkpoints``, ``holds_snapshots``) is
refused at construction, naming them and ``CheckpointHooks``: its methods would otherwise
silently never run. Registering the hooks instead works."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import gradsync as gs
from gradsync.strategies import BSP
from gradsync.strategies.base import CheckpointHooks, SyncContext

pytestmark = [pytest.mark.unit, pytest.mark.usefixtures("one_rank", "inline_writer")]


class OldStyle(BSP):
    def prepare_checkpoint(self, step: int) -> None:
        raise AssertionError("never called")


class Registered(BSP):
    def setup(self, ctx: SyncContext) -> None:
        super().setup(ctx)
        self.before: list[int] = []
        ctx.register_checkpoint_hooks(CheckpointHooks(before_save=self.before.append))


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    model = torch.nn.Linear(3, 2)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def test_a_strategy_defining_a_retired_member_is_refused() -> None:
    model, opt = _model()
    with pytest.raises(gs.UsageError, match="prepare_checkpoint.*register_checkpoint_hooks"):
        gs.Synchronizer(model, opt, strategy=OldStyle(), timeout_s=30)


def test_registered_hooks_are_called_by_a_save(tmp_path: Path) -> None:
    model, opt = _model()
    strategy = Registered()
    sync = gs.Synchronizer(model, opt, strategy=strategy, timeout_s=30)
    try:
        with sync.step():
            model(torch.ones(4, 3)).sum().backward()
        sync.save(tmp_path)
    finally:
        sync.close()
    assert strategy.before == [1]
