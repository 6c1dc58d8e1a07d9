"""``dict_versions``: a watch of dicts' version tags sees every change to their contents, and
spares the snapshot plan its full comparison while nothing changed."""

from __future__ import annotations

import sys
import sysconfig
from collections import OrderedDict, defaultdict
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn

from gradsync.fault import dict_versions, state_plan

pytestmark = pytest.mark.unit

# Not on the test below: a probe that stops finding the tag on a Python that has one must fail.
needs_tags = pytest.mark.skipif(
    dict_versions._OFFSET is None, reason="this Python keeps no readable version tags"
)


class _Holder:
    """An object whose ``__dict__`` is watched, changed through its attributes."""


def test_the_tag_is_found_on_the_pythons_that_keep_one() -> None:
    # CPython kept a version tag per dict from 3.6 through 3.13 (PEP 509); free-threaded
    # builds are not read
    kept = (
        sys.implementation.name == "cpython"
        and sys.version_info < (3, 14)
        and not sysconfig.get_config_var("Py_GIL_DISABLED")
    )
    assert (dict_versions._OFFSET is not None) is kept


Move = Callable[[dict[str, Any]], object]

DICT_CHANGES: list[tuple[str, Move]] = [
    ("another object", lambda d: d.__setitem__("a", [1])),
    ("a new key", lambda d: d.__setitem__("new", 1)),
    ("a deletion", lambda d: d.__delitem__("a")),
    ("pop", lambda d: d.pop("a")),
    ("popitem", lambda d: d.popitem()),
    ("clear", lambda d: d.clear()),
    ("update", lambda d: d.update(a=2.5)),
    ("setdefault", lambda d: d.setdefault("new", 3)),
    ("in-place or", lambda d: d.__ior__({"b": 4})),
]


def _watched() -> tuple[_Holder, list[dict[str, Any]], dict_versions.Watch]:
    holder = _Holder()
    holder.a = 1  # type: ignore[attr-defined]
    dicts: list[dict[str, Any]] = [vars(holder), {"a": 1}, OrderedDict(a=1), defaultdict(int, a=1)]
    watch = dict_versions.watch(dicts)
    assert watch is not None
    watch.mark(watch.read())
    assert watch.unchanged()
    return holder, dicts, watch


@needs_tags
@pytest.mark.parametrize("move", [m for _, m in DICT_CHANGES], ids=[n for n, _ in DICT_CHANGES])
@pytest.mark.parametrize("which", ["instance", "dict", "OrderedDict", "defaultdict"])
def test_every_change_to_a_watched_dict_is_seen(move: Move, which: str) -> None:
    _, dicts, watch = _watched()
    index = ["instance", "dict", "OrderedDict", "defaultdict"].index(which)
    move(dicts[index])
    assert not watch.unchanged()


ATTRIBUTE_CHANGES: list[tuple[str, Callable[[_Holder], object]]] = [
    ("setattr", lambda h: setattr(h, "a", "other")),
    ("new attribute", lambda h: setattr(h, "z", 5)),
    ("delattr", lambda h: delattr(h, "a")),
]


@pytest.mark.parametrize(
    "move", [m for _, m in ATTRIBUTE_CHANGES], ids=[n for n, _ in ATTRIBUTE_CHANGES]
)
@needs_tags
def test_every_attribute_change_of_an_object_whose_dict_is_watched_is_seen(
    move: Callable[[_Holder], object],
) -> None:
    holder, _, watch = _watched()
    move(holder)
    assert not watch.unchanged()


@needs_tags
def test_setting_an_entry_to_the_object_it_holds_is_no_change() -> None:
    # what lets ``model.train()`` at every step keep the plan's quick check
    module = nn.Linear(2, 2)
    watch = dict_versions.watch([vars(module), module._parameters])
    assert watch is not None
    watch.mark(watch.read())
    module.train()
    module.weight = module.weight
    assert watch.unchanged()


@needs_tags
def test_dicts_far_apart_in_memory_are_watched() -> None:
    many = [{"i": i} for i in range(50_000)]  # spread over many allocator arenas
    first, last = many[0], many[-1]
    watch = dict_versions.watch([last, vars(dict_versions), first])
    assert watch is not None
    watch.mark(watch.read())
    assert watch.unchanged()
    first["i"] = -1
    assert not watch.unchanged()


@needs_tags
def test_no_watch_where_the_view_over_the_addresses_cannot_be_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    def refused(*args: object) -> object:
        raise ValueError("no such view here")

    monkeypatch.setattr(dict_versions.np.ctypeslib, "as_array", refused)
    assert dict_versions.watch([{}, {}]) is None


def test_no_watch_without_tags_or_dicts(monkeypatch: pytest.MonkeyPatch) -> None:
    assert dict_versions.watch([]) is None
    monkeypatch.setattr(dict_versions, "_OFFSET", None)
    assert dict_versions.watch([{}]) is None


def _plan_layouts() -> tuple[nn.Sequential, Any, Any]:
    model = nn.Sequential(nn.Linear(3, 4), nn.ReLU(), nn.Linear(4, 2))
    model(torch.ones(1, 3)).sum().backward()
    opt = torch.optim.AdamW(model.parameters())
    opt.step()
    layout = state_plan._module_layout(model)
    opt_layout = state_plan._optimizer_layout(opt)
    assert layout is not None and opt_layout is not None
    return model, layout, opt_layout


def _counting(layout: Any, monkeypatch: pytest.MonkeyPatch) -> list[int]:
    calls = [0]
    full = type(layout).compare

    def counted(self: Any) -> bool:
        calls[0] += 1
        return full(self)

    monkeypatch.setattr(type(layout), "compare", counted)
    return calls


@needs_tags
def test_the_plan_compares_in_full_only_when_a_tag_changed(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, layout, opt_layout = _plan_layouts()
    for kept in (layout, opt_layout):
        calls = _counting(kept, monkeypatch)
        assert kept.versions is not None
        assert kept.unchanged()  # no mark yet: compared in full, then marked
        assert calls == [1]
        for _ in range(5):
            assert kept.unchanged()
        assert calls == [1]
    calls = _counting(layout, monkeypatch)
    model[1].note = "a new attribute, the layout the same"
    assert layout.unchanged()
    assert calls == [1]
    model[0].weight = nn.Parameter(torch.zeros(4, 3))  # a tag changed, and the layout
    assert not layout.unchanged()


@needs_tags
def test_a_dict_that_changes_at_every_step_stops_the_quick_check(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    model, layout, _ = _plan_layouts()
    calls = _counting(layout, monkeypatch)
    for step in range(state_plan._MISSES_TOLERATED + 2):
        model[2].last_step = step  # a module noting something in its forward
        assert layout.unchanged()
        if step == state_plan._MISSES_TOLERATED - 1:
            # the first call only took the mark: a miss fewer than the calls so far
            assert layout.versions is not None
    assert layout.versions is None
    # compared in full at every call since, never by the tags
    assert calls == [state_plan._MISSES_TOLERATED + 2]
