"""A checkpoint every step under ``bsp`` copies the live model and optimizer tensors through a
snapshot plan instead of building both state dicts (``gradsync.fault.state_plan``). Whatever a
script changes between two saves, the snapshot must hold what the state dicts hold at that
save: each change below is made after a plan is in use, and the packed snapshot is compared
with ``model.state_dict()`` and ``optimizer.state_dict()`` taken then."""

from __future__ import annotations

import warnings
from collections import OrderedDict, defaultdict
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

import gradsync as gs
from gradsync.fault import packing, resume, state_plan
from gradsync.fault.resume import PARAM_GROUPS

pytestmark = [pytest.mark.unit, pytest.mark.timeout(60), pytest.mark.usefixtures("one_rank")]

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
    """What each ``sync.save`` packed, and whether the state dicts were built for it."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch) -> None:
        self.packed: list[packing.Packed] = []
        self.built: list[bool] = []
        full, snap = resume._replicated_share, resume.snapshot

        def counted_full(sync: Any) -> Any:
            self.built[-1] = True
            return full(sync)

        def kept_snapshot(state: Any, **kwargs: Any) -> packing.Packed:
            packed = snap(state, **kwargs)
            self.packed.append(packed)
            return packed

        monkeypatch.setattr(resume, "_replicated_share", counted_full)
        monkeypatch.setattr(resume, "snapshot", kept_snapshot)

    def save(self, sync: gs.Synchronizer, directory: Path) -> dict[str, Any]:
        self.built.append(False)
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


CHANGES: list[tuple[Change, bool]] = [
    # (the change, whether the state dicts must be built again for the save after it)
    (_values_only, False),
    (_new_learning_rate, False),
    (_replace_weight, True),
    (_reshape_data, True),
    (_data_as_double, True),
    (_renamed_parameter, True),
    (_to_double, True),
    (_new_buffer, True),
    (_buffer_not_persistent, True),
    (_bypassed_registration, True),
    (_replaced_container, True),
    (_new_module, True),
    (_deleted_module, True),
    (_bias_none, True),
    (_state_dict_hook, True),
    (_optimizer_loaded, True),
    (_moment_reset, True),
    (_moment_as_bfloat16, True),
    (_moment_resized, True),
    (_module_class_swapped, True),
    (_optimizer_class_swapped, True),
    (_state_entry_replaced, True),
    (_reordered_parameters, True),
    (_state_reset, True),
    (_new_group, True),
]


#: changes after which no plan can be made (every save builds the state dicts)
NO_PLAN_AFTER = (_state_dict_hook, _module_class_swapped, _optimizer_class_swapped)


@pytest.mark.parametrize("change, rebuilt", CHANGES, ids=[c.__name__[1:] for c, _ in CHANGES])
def test_a_snapshot_after_any_change_holds_the_state_dicts_of_that_moment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Change, rebuilt: bool
) -> None:
    model, opt = _model_and_adamw()
    with _saving(model, opt, monkeypatch) as (sync, snaps):
        for _ in range(3):
            _step(model, sync)
            _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        # The first save builds the state dicts (and a plan), the next ones go by the plan.
        assert snaps.built == [True, False, False]
        change(model, opt)
        _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        assert snaps.built[-1] is rebuilt
        # and the save after it goes by the plan again (or a new one)
        _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        if change not in NO_PLAN_AFTER:
            assert snaps.built[-1] is False


#: changes to the optimizer alone: a plan of the model alone holds through them
OPTIMIZER_ONLY = (
    _new_learning_rate,
    _optimizer_loaded,
    _moment_reset,
    _state_entry_replaced,
    _reordered_parameters,
    _moment_as_bfloat16,
    _moment_resized,
    _optimizer_class_swapped,
    _state_reset,
    _new_group,
)


@pytest.mark.parametrize("change, rebuilt", CHANGES, ids=[c.__name__[1:] for c, _ in CHANGES])
def test_a_plan_of_the_model_alone_holds_its_state_dict_after_any_change(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: Change, rebuilt: bool
) -> None:
    """Where each rank writes its own model (not a replicated share: local SGD here, a
    parameter-server worker alike), the plan covers the model alone; the optimizer's state
    dict is built at every save."""
    model, opt = _model_and_adamw()
    sync = gs.Synchronizer(model, opt, strategy="local:2", timeout_s=30)
    snaps = _Snapshots(monkeypatch)
    built: list[bool] = []
    full = sync.strategy.model_state_dict

    def counted(m: nn.Module) -> dict[str, Any]:
        built[-1] = True
        return full(m)

    monkeypatch.setattr(sync.strategy, "model_state_dict", counted)

    def save() -> None:
        built.append(False)
        saved = snaps.save(sync, tmp_path)
        _assert_same(saved["model"], model.state_dict(), "model")
        _assert_same(saved["optimizer"], opt.state_dict(), "optimizer")

    try:
        for _ in range(3):
            _step(model, sync)
            save()
        assert built == [True, False, False]
        change(model, opt)
        save()
        assert built[-1] is (rebuilt and change not in OPTIMIZER_ONLY)
        save()
        if change is not _state_dict_hook and change is not _module_class_swapped:
            assert built[-1] is False
        sync.wait_for_checkpoints()
    finally:
        sync.close()


def test_the_optimizers_first_step_makes_a_new_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model_and_adamw()
    with _saving(model, opt, monkeypatch) as (sync, snaps):
        _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)  # no state yet
        for _ in range(2):
            _step(model, sync)  # the first makes AdamW's state
            _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        assert snaps.built == [True, True, False]


def _to_front(container: dict[str, Any], key: str, value: Any) -> None:
    """``container[key] = value`` as its first entry, in place."""
    rest = list(container.items())
    container.clear()
    container[key] = value
    container.update(rest)


def test_an_entry_moved_to_the_start_of_the_next_container_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The plan compares all containers' keys as one list, and all their values as another:
    # the last entry of one container moved to the front of the next leaves both lists as
    # they were, but not the state dicts.
    model, opt = _model_and_adamw()
    with _saving(model, opt, monkeypatch) as (sync, snaps):
        _step(model, sync)
        model[0].register_buffer("seen", torch.ones(2))  # model[0]'s last container entry
        first = opt.state[model[0].weight]
        first["extra"] = torch.ones(1)  # the last entry of the first parameter's state
        for _ in range(2):
            _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        assert snaps.built[-2:] == [True, False]  # a new plan, with both
        # model[0]'s buffers and submodules are empty after it: the next container is
        # model[1]'s parameters
        _to_front(model[1]._parameters, "seen", model[0]._buffers.pop("seen"))
        _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        assert snaps.built[-1] is True
        _to_front(opt.state[model[0].bias], "extra", first.pop("extra"))
        _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        assert snaps.built[-1] is True


class _CountsCalls(nn.Linear):
    """Extra state: a tensor that is a new object after every forward."""

    def __init__(self) -> None:
        super().__init__(6, 3)
        self.calls = torch.zeros(1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.calls = self.calls + 1
        return super().forward(x)

    def get_extra_state(self) -> Any:
        return self.calls

    def set_extra_state(self, state: Any) -> None:
        self.calls = state


def test_no_plan_where_a_module_makes_its_own_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = nn.Sequential(_CountsCalls())
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    with _saving(model, opt, monkeypatch) as (sync, snaps):
        for calls in range(1, 4):
            _step(model, sync)
            saved = snaps.save(sync, tmp_path)
            assert saved["replicated"]["model"]["0._extra_state"].item() == calls
        assert snaps.built == [True, True, True]
        assert sync._snapshot_plans.plan is None


def test_a_change_the_checks_miss_is_warned_of_at_the_next_full_build(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(state_plan, "FULL_EVERY", 6)
    model, opt = _model_and_adamw()
    with _saving(model, opt, monkeypatch) as (sync, snaps):
        for _ in range(3):
            _step(model, sync)
            snaps.save(sync, tmp_path)
        # An instance's own state_dict, set after the plan was made: not among the checks.
        own = model.state_dict
        monkeypatch.setattr(model, "state_dict", lambda *a, **k: own(*a, **k))
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            snaps.save(sync, tmp_path)
            snaps.save(sync, tmp_path)
        assert snaps.built[-2:] == [False, False]
        with pytest.warns(state_plan.SnapshotPlanWarning, match="missed a change"):
            snaps.save(sync, tmp_path)  # the 6th: built in full, and checked
        assert snaps.built[-1] is True


def test_a_load_drops_the_plan_and_the_resumed_snapshots_hold_the_loaded_state(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    model, opt = _model_and_adamw()
    with _saving(model, opt, monkeypatch) as (sync, snaps):
        for _ in range(3):
            _step(model, sync)
            snaps.save(sync, tmp_path)
        sync.wait_for_checkpoints()
        assert sync.load(tmp_path) is not None
        _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        assert snaps.built[-1] is True
        _step(model, sync)
        _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        assert snaps.built[-1] is False


# -- a parameter server's plan (``state_plan.ServerPlan``, ``resume.server_part``) -------------

ServerChange = Callable[[list[torch.Tensor], torch.optim.Optimizer], None]


def _server() -> tuple[list[torch.Tensor], torch.optim.Optimizer]:
    """A server's shard (its own tensors, as ``_Server`` holds them) and optimizer."""
    torch.manual_seed(0)
    params = [torch.randn(4, 3, requires_grad=True), torch.randn(5, requires_grad=True)]
    return params, torch.optim.AdamW(params, lr=0.1)


def _server_update(params: list[torch.Tensor], opt: torch.optim.Optimizer) -> None:
    for p in params:
        p.grad = torch.randn_like(p)
    opt.step()


def _s_values_only(params: list[torch.Tensor], opt: Any) -> None:
    with torch.no_grad():
        params[0].add_(1.0)
        opt.state[params[1]]["exp_avg"].mul_(2.0)


def _s_new_learning_rate(params: list[torch.Tensor], opt: Any) -> None:
    opt.param_groups[0]["lr"] = 0.0125


def _s_moment_reset(params: list[torch.Tensor], opt: Any) -> None:
    state = opt.state[params[0]]
    state["exp_avg"] = torch.zeros_like(state["exp_avg"])


def _s_state_entry_replaced(params: list[torch.Tensor], opt: Any) -> None:
    p = params[1]
    opt.state[p] = {k: v.clone() for k, v in opt.state[p].items()}
    opt.state[p]["exp_avg"].fill_(5.0)


def _s_optimizer_loaded(params: list[torch.Tensor], opt: Any) -> None:
    other = opt.state_dict()
    other["state"] = {k: dict(v) for k, v in other["state"].items()}
    for entry in other["state"].values():
        entry["exp_avg"] = torch.full_like(entry["exp_avg"], 3.0)
    opt.load_state_dict(other)


def _s_moment_as_bfloat16(params: list[torch.Tensor], opt: Any) -> None:
    moment = opt.state[params[0]]["exp_avg"]
    moment.data = moment.data.to(torch.bfloat16)


def _s_shard_reshaped(params: list[torch.Tensor], opt: Any) -> None:
    params[1].data = torch.arange(6.0).reshape(2, 3)


def _s_shard_tensor_replaced(params: list[torch.Tensor], opt: Any) -> None:
    params[0] = torch.full((4, 3), 9.0, requires_grad=True)


def _s_state_reset(params: list[torch.Tensor], opt: Any) -> None:
    opt.state = defaultdict(dict)


def _s_reordered_parameters(params: list[torch.Tensor], opt: Any) -> None:
    opt.param_groups[0]["params"].reverse()


def _s_new_group(params: list[torch.Tensor], opt: Any) -> None:
    opt.add_param_group({"params": [torch.ones(4, requires_grad=True)], "lr": 0.5})


SERVER_CHANGES: list[tuple[ServerChange, bool]] = [
    # (the change, whether the optimizer's state dict must be built again for the save after)
    (_s_values_only, False),
    (_s_new_learning_rate, False),
    (_s_moment_reset, True),
    (_s_state_entry_replaced, True),
    (_s_optimizer_loaded, True),
    (_s_moment_as_bfloat16, True),
    (_s_shard_reshaped, True),
    (_s_shard_tensor_replaced, True),
    (_s_state_reset, True),
    (_s_reordered_parameters, True),
    (_s_new_group, True),
]


@pytest.mark.parametrize(
    "change, rebuilt", SERVER_CHANGES, ids=[c.__name__[3:] for c, _ in SERVER_CHANGES]
)
def test_a_servers_snapshot_holds_its_shard_and_optimizer_state_dict_after_any_change(
    monkeypatch: pytest.MonkeyPatch, change: ServerChange, rebuilt: bool
) -> None:
    params, opt = _server()
    keeper, pool = state_plan.PlanKeeper(), packing.BufferPool()
    built: list[bool] = []
    full = resume._server_shares

    def counted(*args: Any) -> Any:
        built[-1] = True
        return full(*args)

    monkeypatch.setattr(resume, "_server_shares", counted)

    def save() -> None:
        built.append(False)
        # as ``_Server.checkpoint_state`` hands it: the shard and the optimizer themselves
        state = {"params": params, "optimizer": opt, "pushed": [3, 3], "checkpoints": [2, 3]}
        tree, packed_as = resume.server_part(keeper, state, 2)
        packed = packing.pack({"server": tree}, pool)
        packed_as(packed)
        got = packing.unpack(packed)["server"]
        _assert_same(got["params"], [p.detach() for p in params], "params")
        _assert_same(got["optimizer"], opt.state_dict(), "optimizer")
        assert got["pushed"] == [3, 3] and got["checkpoints"] == [2, 3]

    for _ in range(3):
        _server_update(params, opt)
        save()
    assert built == [True, False, False]  # the plan stands in from the second save
    change(params, opt)
    save()
    assert built[-1] is rebuilt
    save()
    assert built[-1] is False  # a new plan, or the old one still


def test_a_server_without_an_optimizer_packs_its_shard_through_the_plan(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """No parameter of the shard in any group: the server has no optimizer (its entry an
    empty dict, as ``_Server.state_dict`` gives it); the plan covers the shard alone."""
    params, _ = _server()
    keeper, pool = state_plan.PlanKeeper(), packing.BufferPool()
    calls: list[int] = []
    full = resume._server_shares

    def counted(*args: Any) -> Any:
        calls.append(1)
        return full(*args)

    monkeypatch.setattr(resume, "_server_shares", counted)
    for step in range(3):
        with torch.no_grad():
            params[0].add_(1.0)
        state = {"params": params, "optimizer": None, "pushed": [step]}
        tree, packed_as = resume.server_part(keeper, state, 1)
        packed = packing.pack({"server": tree}, pool)
        packed_as(packed)
        got = packing.unpack(packed)["server"]
        _assert_same(got["params"], [p.detach() for p in params], "params")
        assert got["optimizer"] == {} and got["pushed"] == [step]
    assert len(calls) == 1


def _server_snapshot(keeper: state_plan.PlanKeeper, state: dict[str, Any]) -> dict[str, Any]:
    tree, packed_as = resume.server_part(keeper, state, 2)
    packed = packing.pack({"server": tree}, packing.BufferPool())
    packed_as(packed)
    return dict(packing.unpack(packed)["server"])


def test_another_servers_state_is_not_packed_through_the_first_ones_plan() -> None:
    """A second ``serve()`` builds a new server, with tensors of the same shapes: the plan
    made for the first must not stand in for it."""
    keeper = state_plan.PlanKeeper()
    first_params, first_opt = _server()
    _server_update(first_params, first_opt)
    for _ in range(2):
        _server_snapshot(keeper, {"params": first_params, "optimizer": first_opt})
    params, opt = _server()
    with torch.no_grad():
        params[0].fill_(4.0)
    _server_update(params, opt)
    got = _server_snapshot(keeper, {"params": params, "optimizer": opt})
    _assert_same(got["params"], [p.detach() for p in params], "params")
    _assert_same(got["optimizer"], opt.state_dict(), "optimizer")


class _OwnOptimizer:
    """Not a ``torch.optim.Optimizer``, but with a state dict of its own."""

    def state_dict(self) -> dict[str, Any]:
        return {"steps": 3, "state": {0: {"m": torch.full((2,), 0.5)}}, "param_groups": []}


def test_a_server_optimizer_of_another_kind_keeps_its_state_dict() -> None:
    params, _ = _server()
    got = _server_snapshot(
        state_plan.PlanKeeper(), {"params": params, "optimizer": _OwnOptimizer()}
    )
    _assert_same(got["optimizer"], _OwnOptimizer().state_dict(), "optimizer")


def test_planned_and_full_snapshots_take_the_same_pooled_buffers(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A planned snapshot keys its buffers in the pool as a full build does (the shapes of a
    planned share are taken from its encoding, not asked of each tensor): across the full
    rebuild every ``FULL_EVERY`` snapshots, one pool entry per dtype."""
    monkeypatch.setattr(state_plan, "FULL_EVERY", 4)
    model, opt = _model_and_adamw()
    with _saving(model, opt, monkeypatch) as (sync, snaps):
        for _ in range(10):
            _step(model, sync)
            _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        assert snaps.built.count(True) >= 3  # full rebuilds among the planned ones
        sync.wait_for_checkpoints()
        pool = sync._writer.pool  # type: ignore[union-attr]
        dtypes = [key.dtype for key in pool._free]
    assert sorted(map(str, dtypes)) == ["torch.float32", "torch.int64", "torch.uint8"]


def test_a_plan_asks_one_guard_for_its_tensors_metadata_while_it_passes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``_Described``: the getters of every tensor are asked only when the C++ guard fails;
    a guard that fails with the metadata the same (``requires_grad`` toggled at every save,
    which the plan does not care about) is made again, then given up."""
    calls = [0]
    getters = state_plan._SHAPE_DTYPE_DEVICE

    def counted(t: torch.Tensor) -> Any:
        calls[0] += 1
        return getters(t)

    model, opt = _model_and_adamw()
    with _saving(model, opt, monkeypatch) as (sync, snaps):
        for _ in range(2):
            _step(model, sync)
            snaps.save(sync, tmp_path)
        plan = sync._snapshot_plans.plan
        assert isinstance(plan, state_plan.SnapshotPlan)
        assert plan.described._guard is not None
        monkeypatch.setattr(state_plan, "_SHAPE_DTYPE_DEVICE", counted)
        for _ in range(3):
            _step(model, sync)
            _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        assert calls == [0] and snaps.built[-3:] == [False] * 3
        weight = model[0].weight
        for i in range(state_plan._MISSES_TOLERATED + 1):
            _step(model, sync)
            weight.requires_grad_(i % 2 == 1)
            _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
            assert snaps.built[-1] is False
        assert calls[0] > 0 and plan.described._guard is None
        weight.requires_grad_(True)


def test_an_ordered_optimizer_state_reordered_in_place_is_seen(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # ``move_to_end`` changes the state dict's order and no dict version tag: such a state is
    # compared in full at every snapshot.
    model, opt = _model_and_adamw()
    with _saving(model, opt, monkeypatch) as (sync, snaps):
        _step(model, sync)
        opt.state = OrderedDict(opt.state)
        for _ in range(3):
            _step(model, sync)
            _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        assert snaps.built[-1] is False
        opt.state.move_to_end(model[0].weight)
        _assert_as_state_dicts(snaps.save(sync, tmp_path), model, opt)
        assert snaps.built[-1] is True
