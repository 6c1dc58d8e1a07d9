"""A snapshot of the model and optimizer state without building their state dicts.

With a checkpoint every step under ``bsp``, each ``sync.save`` built ``model.state_dict()`` and
``optimizer.state_dict()`` and walked both (``packing.skeleton``), only to find them laid out as
at the step before: about 260 us of a 940 us snapshot on ``charlm`` (2 ranks, timed in place
right after a step). A ``SnapshotPlan`` is taken from one such full build: the live tensors
behind both state dicts, in the order ``pack`` copies them, the encoding that build made, and
every container that decides what the two state dicts hold. At a later snapshot, checking those
containers proves that both state dicts would come out alike but for the tensors' values; the
snapshot then copies the live tensors through the kept encoding.

What ``SnapshotPlan.share_now`` checks, each time, at C speed (``map`` over the kept
containers):
- every module: the same class; its parameter, buffer and submodule dicts the same objects,
  of the same lengths, with the same names, each value the same object (a parameter or module
  replaced, added, deleted, renamed, moved or set to None fails this); the same
  non-persistent buffer names; no state-dict hook registered since;
- the optimizer: the same class; its ``state`` the same object (``load_state_dict`` replaces
  it), for the same parameters in the same order, each the same dict with the same keys and
  tensor objects; its ``param_groups`` holding the same parameters; no state-dict hook;
- every tensor's shape, dtype and device, the model's and the optimizer's (``.data = ...``,
  ``model.to()`` and ``resize_`` keep the object but change these).

How, cheaply: the dicts among those containers by their version tags (``dict_versions``:
compared entry by entry only when a tag changed), and the tensors' shapes, dtypes and devices
by one C++ guard (``compat.tensor_metadata_guard``, TorchDynamo's; every tensor's getters only
when it fails, or where torch has none).

No plan is made where these checks could not prove it, and those snapshots build the state
dicts every time, as before: a module class or instance with its own ``state_dict``,
``_save_to_state_dict`` or ``get_extra_state``, or with state-dict hooks; an optimizer class
with its own ``state_dict``, or with state-dict hooks; a per-parameter optimizer state holding
anything but tensors (a number may change every step); a torch without the containers
(``compat.module_state_containers``).

The caller (``resume``) drops its plan at every ``load()``, and rebuilds it in full at every
``FULL_EVERY``-th snapshot whatever the checks say; a rebuild whose layout differs from one the
old plan still vouched for is a gradsync defect, warned of (``SnapshotPlanWarning``); the
rebuilt snapshot is right either way.
"""

from __future__ import annotations

import operator
import warnings
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from itertools import chain
from typing import Any, Protocol

import torch

from gradsync import compat
from gradsync.fault import dict_versions
from gradsync.fault.kept_groups import KeptGroups, param_groups
from gradsync.fault.packing import Packed, Share, skeleton

__all__ = [
    "FULL_EVERY",
    "PlanKeeper",
    "ServerPlan",
    "SnapshotPlan",
    "SnapshotPlanWarning",
    "build",
    "build_server",
    "param_groups",
]

#: a plan is rebuilt from the state dicts at every this many snapshots (and checked then)
FULL_EVERY = 64

_is = operator.is_
_DICT_OF = operator.attrgetter("__dict__")
_TENSOR_TYPES = (torch.Tensor, torch.nn.Parameter)
_SHAPE_DTYPE_DEVICE = operator.attrgetter("shape", "dtype", "device")


class SnapshotPlanWarning(RuntimeWarning):
    """A snapshot plan vouched for a layout that a full build found changed (a defect)."""


class _Watched:
    """A layout whose full comparison (``compare``) is skipped while the version tags of the
    dicts it compares read as at its last success (``dict_versions``) and the rest of what
    ``quick`` checks holds."""

    versions: dict_versions.Watch | None
    misses: int

    def compare(self) -> bool:
        raise NotImplementedError

    def quick(self) -> bool:
        raise NotImplementedError

    def unchanged(self) -> bool:
        versions = self.versions
        if versions is None:
            return self.compare()
        if versions.unchanged() and self.quick():
            return True
        # The tags are read before the comparison: a change made while it runs shows at the
        # next snapshot instead of being taken into the mark.
        tags = versions.read()
        first = not versions.marked  # the first call after a build: no mark to miss yet
        if not self.compare():
            return False
        versions.mark(tags)
        # A dict that changes at every step to the same layout (a module setting an attribute
        # in its forward) would make each snapshot pay for both checks: compare only.
        self.misses += 0 if first else 1
        if self.misses >= _MISSES_TOLERATED:
            self.versions = None
        return True


#: tags changed with the layout the same this many times: a layout stops reading them
_MISSES_TOLERATED = 3


@dataclass(eq=False, slots=True)
class _ModuleLayout(_Watched):
    """What decides ``model.state_dict()``'s keys and tensors, from one build."""

    modules: list[torch.nn.Module]  # in ``state_dict``'s order
    types: list[type]  # their classes (a class swapped in may make its own state dict)
    own: list[Any]  # every module's ``compat.MODULE_STATE_CONTAINERS``, one list
    containers: list[dict[str, Any]]  # each module's parameters, buffers, submodules
    sizes: list[int]  # their lengths
    keys: list[str]  # their keys, one list
    values: list[Any]  # their values, one list
    non_persistent: list[set[str]]
    non_persistent_then: list[set[str]]
    hooks: list[dict[Any, Any]]
    tensors: list[torch.Tensor]  # the state dict's, live (parameters and buffers themselves)
    #: every module's ``__dict__``: a container replaced changes its tag
    dicts: list[dict[str, Any]]
    #: of ``dicts``, the containers and the hook dicts; None: compare every time
    versions: dict_versions.Watch | None
    misses: int = 0

    def quick(self) -> bool:
        # What the tags cannot tell: a class swapped, a ``__dict__`` replaced, a set changed.
        return (
            list(map(type, self.modules)) == self.types
            and all(map(_is, map(_DICT_OF, self.modules), self.dicts))
            and all(map(operator.eq, self.non_persistent, self.non_persistent_then))
        )

    def compare(self) -> bool:
        # The containers themselves first: a module may replace one (``Sequential`` does, on
        # a deletion), and the kept one then no longer tells.
        own = list(chain.from_iterable(map(compat.MODULE_STATE_CONTAINERS, self.modules)))
        if len(own) != len(self.own) or not all(map(_is, own, self.own)):
            return False
        containers = self.containers
        values = list(chain.from_iterable(map(dict.values, containers)))
        return (
            list(map(type, self.modules)) == self.types
            # Lengths too: the keys and values are compared as one list each, where an entry
            # moved from the end of one container to the start of the next would not show.
            and list(map(len, containers)) == self.sizes
            and len(values) == len(self.values)
            and all(map(_is, values, self.values))
            and list(chain.from_iterable(containers)) == self.keys
            and all(map(operator.eq, self.non_persistent, self.non_persistent_then))
            and not any(map(len, self.hooks))
        )


@dataclass(eq=False, slots=True)
class _OptimizerLayout(_Watched):
    """What decides ``optimizer.state_dict()["state"]``, from one build."""

    optimizer: torch.optim.Optimizer
    cls: type  # its class (a class swapped in may make its own state dict)
    state: Any  # ``optimizer.state`` itself
    params: list[torch.Tensor]  # every group's, in order
    keys: list[Any]  # ``state``'s keys (parameters), in order
    dicts: list[dict[str, Any]]  # ``state``'s values
    sizes: list[int]  # their lengths
    inner_keys: list[str]  # their keys, one list
    tensors: list[torch.Tensor]  # their values, one list
    hooks: list[dict[Any, Any]]
    own: dict[str, Any]  # the optimizer's ``__dict__``: ``state`` replaced changes its tag
    #: of ``own``, ``state``, ``dicts`` and the hook dicts; None: compare every time
    versions: dict_versions.Watch | None
    misses: int = 0

    def quick(self) -> bool:
        # What the tags cannot tell: a class swapped, a ``__dict__`` replaced, the groups'
        # parameter lists changed (lists carry no tag).
        optimizer = self.optimizer
        return (
            type(optimizer) is self.cls
            and _DICT_OF(optimizer) is self.own
            and self._same_params(optimizer)
        )

    def _same_params(self, optimizer: torch.optim.Optimizer) -> bool:
        params = list(chain.from_iterable(g["params"] for g in optimizer.param_groups))
        return len(params) == len(self.params) and all(map(_is, params, self.params))

    def compare(self) -> bool:
        optimizer, state, dicts = self.optimizer, self.state, self.dicts
        if type(optimizer) is not self.cls:
            return False
        if optimizer.state is not state or len(state) != len(self.keys):
            return False
        tensors = list(chain.from_iterable(map(dict.values, dicts)))
        return (
            self._same_params(optimizer)
            and all(map(_is, state, self.keys))
            and all(map(_is, state.values(), dicts))
            and len(tensors) == len(self.tensors)
            and all(map(_is, tensors, self.tensors))
            and list(map(len, dicts)) == self.sizes
            and list(chain.from_iterable(dicts)) == self.inner_keys
            and not any(map(len, self.hooks))
        )


class _Described:
    """The shape, dtype and device of a plan's tensors as it found them, and whether they
    still hold: asked of one C++ guard (``compat.tensor_metadata_guard``) while it passes, of
    every tensor's getters when it does not (a getter call per tensor took about 60 us a
    snapshot right after a step, for charlm's 120 tensors, the guard a few). The guard also
    fails on what the plan does not care about (strides, ``requires_grad``, the grad mode
    at the call); the getters decide then, and a new guard is made, up to
    ``_MISSES_TOLERATED`` times."""

    __slots__ = ("_guard", "_misses", "described")

    def __init__(self, sources: Sequence[torch.Tensor]) -> None:
        self.described = list(map(_SHAPE_DTYPE_DEVICE, sources))
        self._guard = compat.tensor_metadata_guard(sources)
        self._misses = 0

    def hold(self, sources: Sequence[torch.Tensor]) -> bool:
        guard = self._guard
        if guard is not None and guard(*sources):
            return True
        if list(map(_SHAPE_DTYPE_DEVICE, sources)) != self.described:
            return False
        if guard is not None:
            self._misses += 1
            keep = self._misses < _MISSES_TOLERATED
            self._guard = compat.tensor_metadata_guard(sources) if keep else None
        return True


@dataclass(eq=False, slots=True)
class SnapshotPlan:
    """The replicated share of a snapshot (``{"model": ..., "optimizer": {"state": ...}}``)
    without its state dicts: see the module docstring."""

    model: _ModuleLayout
    #: None for a share of the model alone (a strategy whose ranks each hold their own
    #: optimizer state, saved beside the share: a parameter-server worker, local SGD)
    optimizer: _OptimizerLayout | None
    share: Share  # the full build's: owners, rank, skeleton
    encoded: Any  # its encoding (``packing._EncodedShare``)
    sources: list[torch.Tensor]  # live tensors in the share's order
    #: their shape, dtype and device: ``.data = ...``, ``model.to()`` or ``resize_`` keep a
    #: tensor object but change these, and the kept encoding holds the old ones
    described: _Described

    def share_now(self) -> Share | None:
        """The share to pack now, its tree left out; None when the layout may have changed
        (build the state dicts then)."""
        if not (
            self.model.unchanged()
            and (self.optimizer is None or self.optimizer.unchanged())
            and self.described.hold(self.sources)
        ):
            return None
        return _through(self.share, self.sources, self.encoded)

    def same_layout(self, other: SnapshotPlan) -> bool:
        """Whether ``other`` (a later build) describes the same share: skeleton, owners and
        the same live tensors."""
        return (
            self.share.skeleton == other.share.skeleton
            and tuple(self.share.owner) == tuple(other.share.owner)
            and len(self.sources) == len(other.sources)
            and all(map(_is, self.sources, other.sources))
        )


@dataclass(eq=False, slots=True)
class ServerPlan:
    """A parameter server's shard and its optimizer's per-parameter state without the
    optimizer's state dict (``_Server.checkpoint_state``, ``resume.save_server``): the same
    checks as ``SnapshotPlan``'s for the optimizer; the shard is the server's own list of
    tensors, checked to hold the same objects."""

    params: list[torch.Tensor]  # the server's list itself
    tensors: list[torch.Tensor]  # what it held at the build, in order
    optimizer: _OptimizerLayout | None  # None: the server has no optimizer
    #: the full build's shares (owners, rank, skeleton): the shard's, the optimizer state's
    shares: tuple[Share, Share | None]
    encoded: tuple[Any, Any]  # their encodings (``packing._EncodedShare``)
    sources: list[torch.Tensor]  # every live tensor, the shard's then the optimizer's
    described: _Described  # their shape, dtype and device then

    def of(self, params: list[torch.Tensor], optimizer: Any) -> bool:
        """Whether this plan was made for this shard list and this optimizer (objects)."""
        mine = self.optimizer.optimizer if self.optimizer is not None else None
        return params is self.params and optimizer is mine

    def share_now(self) -> tuple[Share, Share | None] | None:
        """The two shares to pack now, their trees left out; None when the layout may have
        changed (build the optimizer's state dict then)."""
        optimizer, params = self.optimizer, self.params
        if not (
            len(params) == len(self.tensors)
            and all(map(_is, params, self.tensors))
            and (optimizer is None or optimizer.unchanged())
            and self.described.hold(self.sources)
        ):
            return None
        shard, state = self.shares
        made = _through(shard, self.tensors, self.encoded[0])
        if state is None or optimizer is None:
            return made, None
        return made, _through(state, optimizer.tensors, self.encoded[1])

    def same_layout(self, other: Any) -> bool:
        """Whether ``other`` (a later build) describes the same shares and live tensors."""
        return (
            type(other) is ServerPlan
            and [s.skeleton if s else None for s in self.shares]
            == [s.skeleton if s else None for s in other.shares]
            and len(self.sources) == len(other.sources)
            and all(map(_is, self.sources, other.sources))
        )


def build_server(
    params: list[torch.Tensor],
    optimizer: torch.optim.Optimizer | None,
    shares: tuple[Share, Share | None],
    groups: list[Any] | None,
    packed: Packed,
) -> ServerPlan | None:
    """A plan from a server's full build: ``shares`` of its shard (``params`` detached) and of
    its optimizer state dict's ``state``, packed in that order in ``packed``, that state
    dict's ``groups`` beside them. None where the checks could not prove the layout."""
    shard, state = shares
    encodings = list(packed.shares)
    if len(encodings) != (1 if state is None else 2) or shard.skeleton is None:
        return None
    tensors = list(params)
    if not _alike(shard.tensors, tensors, len(tensors)):
        return None
    layout = None
    if optimizer is not None:
        if state is None or state.skeleton is None or groups is None:
            return None
        if not _same(groups, param_groups(optimizer)):
            return None
        layout = _optimizer_layout(optimizer)
        if layout is None or not _alike(state.tensors, layout.tensors, 0):
            return None
    sources = [*tensors, *(layout.tensors if layout is not None else ())]
    return ServerPlan(
        params=params,
        tensors=tensors,
        optimizer=layout,
        shares=shares,
        encoded=(encodings[0], encodings[1] if len(encodings) > 1 else None),
        sources=sources,
        described=_Described(sources),
    )


class _Plan(Protocol):
    def share_now(self) -> Any: ...

    def same_layout(self, other: Any) -> bool: ...


def _through(built: Share, tensors: Sequence[torch.Tensor], encoded: Any) -> Share:
    """``built`` (a full build's share) to pack again through its kept encoding: the live
    ``tensors`` copied, its tree not walked (``packing.Share``)."""
    return Share(None, built.owner, built.rank, built.skeleton, tensors, encoded)


class PlanKeeper:
    """A Synchronizer's plan (a ``SnapshotPlan``, or a parameter server's ``ServerPlan``):
    when to use it, when to build one (module docstring)."""

    def __init__(self) -> None:
        self.plan: _Plan | None = None
        self._count = 0
        self._want = True  # build a plan from the next full build
        self._vouched: _Plan | None = None  # a plan a due rebuild checks
        #: the optimizer's groups as the planned snapshots save them (``kept_groups``)
        self.groups = KeptGroups()

    def next_share(self) -> Any:
        """Counts a snapshot; what the plan gives to pack for it (``share_now``), or None:
        build the state dicts (then call ``rebuilt``)."""
        self._count += 1
        if self._count % FULL_EVERY == 0:
            self._want = True
            if self.plan is not None and self.plan.share_now() is not None:
                self._vouched = self.plan
            self.plan = None
            return None
        if self.plan is None:
            return None
        share = self.plan.share_now()
        if share is None:  # the layout changed (a first optimizer step, a new parameter)
            self.plan, self._want = None, True
        return share

    def rebuilt(self, make: Callable[[], _Plan | None]) -> None:
        """After a full build: a new plan from it (``make``), when one is wanted."""
        if not self._want:
            return
        self._want = False
        self.plan = make()
        vouched, self._vouched = self._vouched, None
        if vouched is not None and (self.plan is None or not vouched.same_layout(self.plan)):
            warnings.warn(
                "gradsync's checkpoint snapshot plan missed a change of the model's or the "
                "optimizer's state layout: snapshots since its last full build may hold the "
                "old layout (this one is whole). Please report it, with the change made",
                SnapshotPlanWarning,
                stacklevel=3,
            )

    def drop(self) -> None:
        """Forget the plan (the state was loaded): the next snapshot builds a new one."""
        self.plan, self._vouched, self._want = None, None, True
        self.groups.forget()


def build(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer | None,
    share: Share,
    packed: Packed,
    groups: list[Any] | None,
) -> SnapshotPlan | None:
    """A plan from a full build: ``share`` of ``{"model": model.state_dict(), "optimizer":
    state dict less its groups}``, packed first in ``packed``, and the groups taken out of
    it; with ``optimizer`` None, ``share`` of ``model.state_dict()`` alone (``groups`` not
    used). None where a plan could not prove the layout unchanged (module docstring)."""
    encoded = next((e for e in packed.shares if e.at == ()), None)
    if share.skeleton is None or encoded is None or len(share.tensors) != len(share.owner):
        return None
    model_layout = _module_layout(model)
    if model_layout is None:
        return None
    optimizer_layout = None
    if optimizer is not None:
        if groups is None or not _same(groups, param_groups(optimizer)):
            return None
        optimizer_layout = _optimizer_layout(optimizer)
        if optimizer_layout is None:
            return None
    sources = [*model_layout.tensors, *(optimizer_layout.tensors if optimizer_layout else ())]
    if not _alike(share.tensors, sources, len(model_layout.tensors)):
        return None
    return SnapshotPlan(
        model_layout, optimizer_layout, share, encoded, sources, _Described(sources)
    )


def _same(a: Any, b: Any) -> bool:
    # Equal as ``pack`` encodes them (types count) with the same tensor objects: ``==`` on a
    # group holding a tensor (a tensor learning rate) compares elements.
    sa, sb = skeleton(a), skeleton(b)
    return (
        sa is not None
        and sb is not None
        and sa[0] == sb[0]
        and len(sa[1]) == len(sb[1])
        and all(map(_is, sa[1], sb[1]))
    )


def _alike(built: Sequence[torch.Tensor], live: list[torch.Tensor], model_count: int) -> bool:
    """Whether the full build's tensors are the live ones: the model's (detached by
    ``state_dict``) the same memory, shape and dtype; the optimizer's the same objects."""
    if len(built) != len(live):
        return False
    for i, (b, t) in enumerate(zip(built, live, strict=True)):
        if i >= model_count:
            if b is not t:
                return False
        elif (
            b.data_ptr() != t.data_ptr()
            or _SHAPE_DTYPE_DEVICE(b) != _SHAPE_DTYPE_DEVICE(t)
            or b.stride() != t.stride()
        ):
            return False
    return True


_OWN_METHODS = ("state_dict", "_save_to_state_dict", "get_extra_state")


def _module_layout(model: torch.nn.Module) -> _ModuleLayout | None:
    modules: list[torch.nn.Module] = []
    own: list[tuple[Any, ...]] = []
    if not _walk(model, modules, own):
        return None
    base = torch.nn.Module
    for m in modules:
        cls = type(m)
        if any(getattr(cls, name) is not getattr(base, name) for name in _OWN_METHODS):
            return None
        if any(name in vars(m) for name in _OWN_METHODS):
            return None
    containers: list[dict[str, Any]] = []
    non_persistent: list[set[str]] = []
    hooks: list[dict[Any, Any]] = []
    for params, buffers, children, np_set, *hook_dicts in own:
        containers += [params, buffers, children]
        non_persistent.append(np_set)
        hooks += hook_dicts
    if any(map(len, hooks)):
        return None
    live = model.state_dict(keep_vars=True)
    tensors = list(live.values())
    if any(type(t) not in _TENSOR_TYPES for t in tensors):
        return None
    dicts = list(map(_DICT_OF, modules))
    # An ``OrderedDict`` container can be reordered in place, which its tag does not show.
    plain = all(type(c) is dict for c in containers)
    return _ModuleLayout(
        modules=modules,
        types=list(map(type, modules)),
        own=list(chain.from_iterable(own)),
        containers=containers,
        sizes=list(map(len, containers)),
        keys=list(chain.from_iterable(containers)),
        values=list(chain.from_iterable(map(dict.values, containers))),
        non_persistent=non_persistent,
        non_persistent_then=[set(s) for s in non_persistent],
        hooks=hooks,
        tensors=tensors,
        dicts=dicts,
        versions=dict_versions.watch([*dicts, *containers, *hooks]) if plain else None,
    )


def _walk(
    module: torch.nn.Module, modules: list[torch.nn.Module], own: list[tuple[Any, ...]]
) -> bool:
    """Every module in ``state_dict``'s order (a module held in two places, twice) into
    ``modules``, its containers (``compat.MODULE_STATE_CONTAINERS``) into ``own``; False where
    torch hides them."""
    containers = compat.module_state_containers(module)
    if containers is None:
        return False
    modules.append(module)
    own.append(containers)
    children = containers[2]
    return all(_walk(c, modules, own) for c in children.values() if c is not None)


def _optimizer_layout(optimizer: torch.optim.Optimizer) -> _OptimizerLayout | None:
    if type(optimizer).state_dict is not torch.optim.Optimizer.state_dict:
        return None
    if "state_dict" in vars(optimizer):
        return None
    hooks = compat.optimizer_state_dict_hooks(optimizer)
    if hooks is None or any(map(len, hooks)):
        return None
    state = optimizer.state
    params = list(chain.from_iterable(g["params"] for g in optimizer.param_groups))
    known = set(map(id, params))
    keys = list(state)
    dicts = list(state.values())
    if any(id(k) not in known for k in keys) or any(type(d) is not dict for d in dicts):
        return None
    tensors = list(chain.from_iterable(map(dict.values, dicts)))
    if any(type(t) not in _TENSOR_TYPES for t in tensors):
        return None
    return _OptimizerLayout(
        optimizer=optimizer,
        cls=type(optimizer),
        state=state,
        params=params,
        keys=keys,
        dicts=dicts,
        sizes=list(map(len, dicts)),
        inner_keys=list(chain.from_iterable(dicts)),
        tensors=tensors,
        hooks=hooks,
        own=_DICT_OF(optimizer),
        # An ``OrderedDict`` state can be reordered in place (``move_to_end``), which changes
        # the state dict's order and no tag: compared in full every time then.
        versions=(
            dict_versions.watch([_DICT_OF(optimizer), state, *dicts, *hooks])
            if type(state) in (dict, defaultdict)
            else None
        ),
    )
