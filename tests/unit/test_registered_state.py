"""State a script registers with ``sync.register_state`` goes with every checkpoint and is put
back by ``sync.load``; what a checkpoint lacks, or holds that nothing registered, is said."""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
import torch

import gradsync as gs
from gradsync.checkpoint import CheckpointStore
from gradsync.checkpoint.export import single_process_state
from gradsync.checkpoint.registry import REGISTERED, StateRegistry
from gradsync.checkpoint.store import CheckpointWarning
from gradsync.errors import CheckpointError, UsageError

pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(60),
    pytest.mark.usefixtures("one_rank", "inline_writer"),
]


class _Parts:
    """A model, its optimizer and scheduler, and a Synchronizer over them."""

    def __init__(self) -> None:
        torch.manual_seed(0)
        self.model = torch.nn.Linear(4, 2)
        self.opt = torch.optim.SGD(self.model.parameters(), lr=0.1)
        self.sched = torch.optim.lr_scheduler.StepLR(self.opt, step_size=2, gamma=0.5)
        self.sync = gs.Synchronizer(self.model, self.opt, strategy="bsp", timeout_s=30)

    def train(self, steps: int) -> None:
        for _ in range(steps):
            with self.sync.step():
                self.model(torch.randn(3, 4)).sum().backward()
            self.sched.step()


def test_a_registered_scheduler_and_tensor_state_come_back_on_load(tmp_path: Path) -> None:
    saved = _Parts()
    ema = {"weight": torch.zeros(2, 4), "count": 0}

    def ema_state() -> dict[str, Any]:
        return {"weight": ema["weight"], "count": ema["count"]}

    saved.sync.register_state("scheduler", saved.sched.state_dict, saved.sched.load_state_dict)
    saved.sync.register_state("ema", ema_state, lambda s: None)
    try:
        saved.train(5)
        ema["weight"] = saved.model.weight.detach().clone()
        ema["count"] = 5
        saved.sync.save(tmp_path)
    finally:
        saved.sync.close()

    resumed = _Parts()
    loaded_ema: list[Any] = []
    resumed.sync.register_state(
        "scheduler", resumed.sched.state_dict, resumed.sched.load_state_dict
    )
    resumed.sync.register_state("ema", ema_state, loaded_ema.append)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", CheckpointWarning)
            assert resumed.sync.load(tmp_path) is not None
    finally:
        resumed.sync.close()
    assert resumed.sched.state_dict() == saved.sched.state_dict()
    assert resumed.opt.param_groups[0]["lr"] == saved.opt.param_groups[0]["lr"] == 0.1 * 0.25
    assert loaded_ema[0]["count"] == 5
    assert torch.equal(loaded_ema[0]["weight"], saved.model.weight.detach())
    # In the rank's file, under its own entry.
    store = CheckpointStore(tmp_path)
    info = store.latest()
    assert info is not None
    assert set(store.load(info, 0)[REGISTERED]) == {"scheduler", "ema"}
    # and in the export a plain script opens
    exported = single_process_state(tmp_path)
    assert exported["registered"]["scheduler"] == saved.sched.state_dict()


def test_nothing_registered_writes_no_entry(tmp_path: Path) -> None:
    parts = _Parts()
    try:
        parts.train(1)
        parts.sync.save(tmp_path)
    finally:
        parts.sync.close()
    store = CheckpointStore(tmp_path)
    info = store.latest()
    assert info is not None and REGISTERED not in store.load(info, 0)


def _save_with_data(tmp_path: Path) -> None:
    """A checkpoint whose only registered entry is ``data``."""
    before = _Parts()
    before.sync.register_state("data", lambda: {"position": 7}, lambda s: None)
    try:
        before.train(1)
        before.sync.save(tmp_path)
    finally:
        before.sync.close()


def test_a_key_the_checkpoint_lacks_or_nothing_registered_is_warned_of(tmp_path: Path) -> None:
    _save_with_data(tmp_path)
    after = _Parts()
    after.sync.register_state("scheduler", after.sched.state_dict, after.sched.load_state_dict)
    try:
        with pytest.warns(CheckpointWarning) as caught:
            after.sync.load(tmp_path)
    finally:
        after.sync.close()
    said = " | ".join(str(w.message) for w in caught)
    assert "holds no state for 'scheduler'" in said
    assert "holds state for 'data', which nothing registered" in said
    assert after.sched.last_epoch == 0  # kept its own


def test_a_load_function_that_raises_names_its_key(tmp_path: Path) -> None:
    _save_with_data(tmp_path)

    def refuse(state: Any) -> None:
        raise KeyError("position")

    after = _Parts()
    after.sync.register_state("data", lambda: {}, refuse)
    try:
        with pytest.raises(CheckpointError, match=r"registered state 'data'.*KeyError"):
            after.sync.load(tmp_path)
    finally:
        after.sync.close()


def test_a_state_a_checkpoint_cannot_hold_is_refused_at_save(tmp_path: Path) -> None:
    parts = _Parts()
    parts.sync.register_state("loader", lambda: {"it": iter([1])}, lambda s: None)
    try:
        parts.train(1)
        with pytest.raises(CheckpointError, match="loader"):
            parts.sync.save(tmp_path)
    finally:
        parts.sync.close()


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("", dict, print), "non-empty str"),
        ((3, dict, print), "non-empty str"),
        (("s", {"a": 1}, print), "state_fn must be callable.*not their results"),
        (("s", dict, None), "load_fn must be callable"),
    ],
)
def test_bad_registrations_are_refused(args: tuple[Any, ...], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        StateRegistry().register(*args)


def test_a_key_is_registered_once_until_unregistered() -> None:
    registry = StateRegistry()
    registry.register("s", dict, print)
    with pytest.raises(UsageError, match="registered already; unregister_state"):
        registry.register("s", dict, print)
    registry.unregister("s")
    registry.register("s", dict, print)
    with pytest.raises(UsageError, match=r"'t' is not registered \(registered: 's'\)"):
        registry.unregister("t")


def test_on_another_world_size_only_replicated_entries_load_from_rank_0s_file() -> None:
    got: dict[str, Any] = {}
    registry = StateRegistry()
    registry.register("schedule", dict, lambda s: got.update(schedule=s), replicated=True)
    registry.register("shard", dict, lambda s: got.update(shard=s))
    rank_0s = {"schedule": {"lr": 0.5}, "shard": {"position": 3}}
    with pytest.warns(CheckpointWarning, match="'shard' is per rank.*not restored"):
        registry.load(rank_0s, step=4, world_changed=True, warn=True)
    assert got == {"schedule": {"lr": 0.5}}
    registry.load(rank_0s, step=4, world_changed=False, warn=False)
    assert got == rank_0s


def test_an_extra_a_checkpoint_cannot_hold_is_named_at_save(tmp_path: Path) -> None:
    """The walk naming the bad entry looks inside gradsync's own share of the model and
    optimizer state rather than stopping at it (it named ``state['replicated']``)."""
    parts = _Parts()
    try:
        parts.train(1)
        with pytest.raises(CheckpointError, match=r"state\['extra'\]\['position'\]"):
            parts.sync.save(tmp_path, position=iter([1]))
    finally:
        parts.sync.close()
