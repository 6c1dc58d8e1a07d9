"""A checkpoint every step under ``bsp`` reuses the encoding of the snapshot before while the
state is laid out alike (``packing``). Whatever a script changes between two saves, the snapshot
must hold what the state dicts hold at that save: each change below is made after a few saves,
and the packed snapshot is compared with ``model.state_dict()`` and ``optimizer.state_dict()``
taken then."""

from __future__ import annotations

from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.checkpoint import checkpointer, packing
from gradsync.checkpoint.checkpointer import PARAM_GROUPS

pytestmark = [
    pytest.mark.unit,
    pytest.mark.timeout(60),
    pytest.mark.usefixtures("one_rank", "inline_writer"),
]

Change = Callable[[nn.Sequential, torch.optim.Optimizer], None]


def _model() -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(6, 5), nn.LayerNorm(5), nn.Linear(5, 3))
    model.register_buffer("scale", torch.ones(3))
    return model


def _model_and_adamw() -> tuple[nn.Sequential, torch.optim.Optimizer]:
    model = _model()
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


def _step(model: nn.Module, sync: gs.Synchronizer) -> None:
    with sync.step():
        model(torch.randn(4, 6)).float().sum().backward()


class _Snapshots:
    """What each ``sync.save`` packed."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.packed: list[packing.Packed] = []
        snap = checkpointer.snapshot

        def kept_snapshot(state: Any, **kwargs: Any) -> packing.Packed:
            packed = snap(state, **kwargs)
            self.packed.append(packed)
            return packed

        monkeypatch.setattr(checkpointer, "snapshot", kept_snapshot)

    def save(self, sync: gs.Synchronizer, directory: Path) -> dict[str, Any]:
        sync.save(directory, wait=False)
        return packing.unpack(self.packed[-1])


@contextmanager
def _saving(
    model: nn.Module, opt: torch.optim.Optimizer, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[gs.Synchronizer, _Snapshots]]:
    """A bsp Synchronizer whose saves are kept (``_Snapshots``): its checkpoints are waited
    for at the end, and it is closed whatever happens."""
    sync = gs.Synchronizer(model, opt, strategy="bsp", timeout_s=30)
    try:
        yield sync, _Snapshots(monkeypatch)
        sync.wait_for_checkpoints()
    finally:
        sync.close()


def _assert_same(got: Any, want: Any, where: str = "state") -> None:
    """Equal as a checkpoint must be: the same containers, keys, plain values and tensors
    (dtype, shape and values)."""
    assert type(got) is type(want) or {type(got), type(want)} <= {dict, OrderedDict}, where
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and got.shape == want.shape, where
        assert torch.equal(got, want.detach().cpu()), where
    elif isinstance(want, dict):
        assert list(got) == list(want), where
        for k in want:
            _assert_same(got[k], want[k], f"{where}[{k!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), where
        for i, (g, w) in enumerate(zip(got, want, strict=True)):
            _assert_same(g, w, f"{where}[{i}]")
    else:
        assert type(got) is type(want) and got == want, where


def _assert_as_state_dicts(saved: dict[str, Any], model: nn.Module, opt: Any) -> None:
    want_opt = opt.state_dict()
    _assert_same(saved["replicated"]["model"], model.state_dict(), "model")
    _assert_same(saved["replicated"]["optimizer"]["state"], want_opt["state"], "optimizer")
    _assert_same(saved[PARAM_GROUPS], want_opt["param_groups"], "param_groups")


def _replace_weight(model: nn.Sequential, opt: Any) -> None:
    model[0].weight = nn.Parameter(torch.randn(5, 6))


def _reshape_data(model: nn.Sequential, opt: Any) -> None:
    model[2].bias.data = torch.arange(6.0).reshape(2, 3)


def _data_as_double(model: nn.Sequential, opt: Any) -> None:
    model[0].weight.data = model[0].weight.data.double()


def _renamed_parameter(model: nn.Sequential, opt: Any) -> None:
    model[2]._parameters["shift"] = model[2]._parameters.pop("bias")


def _to_double(model: nn.Sequential, opt: Any) -> None:
    model.to(torch.float64)


def _new_buffer(model: nn.Sequential, opt: Any) -> None:
    model[1].register_buffer("seen", torch.full((2,), 7.0))


def _buffer_not_persistent(model: nn.Sequential, opt: Any) -> None:
    model.register_buffer("scale", model.scale, persistent=False)


def _bypassed_registration(model: nn.Sequential, opt: Any) -> None:
    model[0]._parameters["late"] = nn.Parameter(torch.ones(2))


def _replaced_container(model: nn.Sequential, opt: Any) -> None:
    # A module may swap a container for a new one (``Sequential`` does, on a deletion): what
    # goes into the new one must be seen.
    model[0]._parameters = OrderedDict(model[0]._parameters)
    model[0]._parameters["late"] = nn.Parameter(torch.ones(2))


def _new_module(model: nn.Sequential, opt: Any) -> None:
    model.add_module("head", nn.Linear(3, 2))


def _deleted_module(model: nn.Sequential, opt: Any) -> None:
    del model[1]


def _bias_none(model: nn.Sequential, opt: Any) -> None:
    model[2].bias = None


def _state_dict_hook(model: nn.Sequential, opt: Any) -> None:
    def hook(module: nn.Module, sd: Any, prefix: str, meta: Any) -> None:
        sd[prefix + "hooked"] = torch.zeros(1)

    model._register_state_dict_hook(hook)


def _optimizer_loaded(model: nn.Sequential, opt: Any) -> None:
    other = {"state": {k: dict(v) for k, v in opt.state_dict()["state"].items()}}
    for entry in other["state"].values():
        entry["exp_avg"] = torch.full_like(entry["exp_avg"], 3.0)
    other["param_groups"] = opt.state_dict()["param_groups"]
    opt.load_state_dict(other)


def _moment_reset(model: nn.Sequential, opt: Any) -> None:
    state = opt.state[model[0].weight]
    state["exp_avg"] = torch.zeros_like(state["exp_avg"])


def _state_entry_replaced(model: nn.Sequential, opt: Any) -> None:
    p = model[0].weight
    opt.state[p] = {k: v.clone() for k, v in opt.state[p].items()}
    opt.state[p]["exp_avg"].fill_(5.0)


def _reordered_parameters(model: nn.Sequential, opt: Any) -> None:
    opt.param_groups[0]["params"].reverse()


def _moment_as_bfloat16(model: nn.Sequential, opt: Any) -> None:
    moment = opt.state[model[0].weight]["exp_avg"]
    moment.data = moment.data.to(torch.bfloat16)


def _moment_resized(model: nn.Sequential, opt: Any) -> None:
    opt.state[model[0].weight]["exp_avg"].resize_(2, 2)


class _DoubledWeight(nn.Linear):
    def _save_to_state_dict(self, destination: Any, prefix: str, keep_vars: bool) -> None:
        super()._save_to_state_dict(destination, prefix, keep_vars)
        destination[prefix + "weight"] = destination[prefix + "weight"] * 2


def _module_class_swapped(model: nn.Sequential, opt: Any) -> None:
    model[0].__class__ = _DoubledWeight


class _OwnStateDict(torch.optim.AdamW):
    def state_dict(self) -> dict[str, Any]:
        out = super().state_dict()
        for entry in out["state"].values():
            entry["exp_avg"] = entry["exp_avg"] * 0
        return out


def _optimizer_class_swapped(model: nn.Sequential, opt: Any) -> None:
    opt.__class__ = _OwnStateDict


def _state_reset(model: nn.Sequential, opt: Any) -> None:
    opt.state = defaultdict(dict)


def _new_group(model: nn.Sequential, opt: Any) -> None:
    opt.add_param_group({"params": [nn.Parameter(torch.ones(4))], "lr": 0.5})


def _new_learning_rate(model: nn.Sequential, opt: Any) -> None:
    opt.param_groups[0]["lr"] = 0.0125


def _values_only(model: nn.Sequential, opt: Any) -> None:
    with torch.no_grad():
        model[0].weight.add_(1.0)
        opt.state[model[0].weight]["exp_avg"].mul_(2.0)


CHANGES: list[Change] = [
    _values_only,
    _new_learning_rate,
    _replace_weight,
    _reshape_data,
    _data_as_double,
    _renamed_parameter,
    _to_double,
    _new_buffer,
    _buffer_not_persistent,
    _bypassed_registration,
    _replaced_container,
    _new_module,
    _deleted_module,
    _bias_none,
    _state_dict_hook,
    _optimizer_loaded,
    _moment_reset,
    _moment_as_bfloat16,
    _moment_resized,
    _module_class_swapped,
    _optimizer_class_swapped,
    _state_entry_replaced,
    _reordered_parameters,
    _state_reset,
    _new_group,
]


@pytest.mark.parametrize("change", CHANGES, ids=[c.__name__[1:] for c in CHANGES])
def test_a_snapshot_after_any_change_holds_the_state_dicts_of_that_moment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Change
) -> None:
    model, opt = _model_and_adamw()
    with _saving(model, opt, monkeypatch) as (sync, snaps):
        for _ in range(3):
            _step(model, sync)
            _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        change(model, opt)
        _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        # and the save after it, whose packing may reuse the encoding of the one before
        _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
