"""Whether any of a fixed set of dicts changed since a mark, told from the version tag each dict
carries, read in place in one gather.

Why: a checkpoint every step proves, at every snapshot, that the model's and the optimizer's
containers are as the snapshot plan found them (``state_plan``). Comparing every module's
dicts entry by entry took about 70 us of a 560 us snapshot right after a training step
(charlm, 2 ranks), though the same comparison repeated at once took 16: nearly all of it was
reading objects the step had pushed out of the caches. The version tags of those dicts, one
word each, are gathered by one numpy indexing and compared as bytes: about 20 us in place.

CPython keeps in each dict a version tag (PEP 509) that changes whenever its contents do
(an entry added, removed or given another object; setting an entry to the object it holds
changes nothing). No API reads it, so where it lies is found, not assumed: ``_probe`` makes
fresh dicts, an instance's ``__dict__`` among them, changes them in every way and looks for
the one word that changed at each change and at no other time. Where no word behaves so (a
Python that dropped the tag, as 3.14 did, or another implementation), ``watch`` returns None
and the caller compares entries as before. A tag that changed says nothing about what
changed: the caller then compares in full and marks again.

What a tag cannot tell, the caller checks apart: an ``OrderedDict`` reordered in place
(``move_to_end``), a dict replaced by another (the caller compares the objects it holds with
the live ones), a set's contents.
"""

from __future__ import annotations

import ctypes
import sys
import sysconfig
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

__all__ = ["Watch", "watch"]

_WORD = 8
# Whole words inside a dict object, after its reference count and type.
_SEARCHED = range(2 * _WORD, dict.__basicsize__ - _WORD + 1, _WORD)


def _word(obj: Any, offset: int) -> int:
    return ctypes.c_uint64.from_address(id(obj) + offset).value


class _Probed:
    """Attribute-free holder for the instance-``__dict__`` case of the probe."""


def _changes(d: dict[Any, Any], holder: Any) -> list[Callable[[], object]]:
    """Changes to ``d`` that each must change its tag (``holder``: the object whose
    ``__dict__`` ``d`` is, changed through attribute setting, or None)."""
    moves: list[Callable[[], object]] = []
    if holder is not None:  # first: an instance's dict may change form at a dict method
        moves += [
            lambda: setattr(holder, "a", object()),
            lambda: setattr(holder, "z", 2),
            lambda: delattr(holder, "z"),
        ]
    moves += [
        lambda: d.__setitem__("a", object()),  # the same key, another object
        lambda: d.__setitem__("new", 1),
        lambda: d.__delitem__("new"),
        lambda: d.update(b=object()),
        lambda: d.pop("b"),
        lambda: d.setdefault("c", object()),
        lambda: d.popitem(),
        lambda: d.clear(),
    ]
    return moves


def _probe() -> int | None:
    """The offset of a dict's version tag from its address; None where none is found."""
    if sys.implementation.name != "cpython" or sysconfig.get_config_var("Py_GIL_DISABLED"):
        return None  # id() is no address elsewhere; without the GIL a read may tear
    holder = _Probed()
    setattr(holder, "a", 1)  # noqa: B010 - an attribute of an empty class
    cases: list[tuple[dict[Any, Any], Any]] = [({"a": 1}, None), (vars(holder), holder)]
    found = None
    for offset in _SEARCHED:
        if all(_tracks(d, holder, offset) for d, holder in cases):
            if found is not None:
                return None  # two words behave alike: neither can be trusted
            found = offset
    return found


def _tracks(d: dict[Any, Any], holder: Any, offset: int) -> bool:
    """Whether the word at ``offset`` changes at every change of ``d`` and when no change is
    made (the same object set again, a read) stays."""
    if "a" not in d:
        d["a"] = 1
    seen = _word(d, offset)
    same = d["a"]
    d["a"] = same
    _ = d.get("a")
    if _word(d, offset) != seen:
        return False
    for move in _changes(d, holder):
        move()
        now = _word(d, offset)
        if now == seen:
            return False
        seen = now
    return True


_OFFSET = _probe()


class Watch:
    """The version tags of ``dicts`` as marked, and whether they still read the same."""

    def __init__(self, dicts: Sequence[dict[Any, Any]], offset: int) -> None:
        self._dicts = list(dicts)  # held: a dict freed and another made there would read
        addresses = np.fromiter((id(d) + offset for d in self._dicts), np.int64, len(dicts))
        low = int(addresses.min())
        # One array over the addresses from the lowest to the highest tag; only the indexed
        # words are ever read.
        span = (ctypes.c_uint64 * (int(addresses.max() - low) // _WORD + 1)).from_address(low)
        self._memory = np.ctypeslib.as_array(span)
        self._index = (addresses - low) // _WORD
        self._then: bytes | None = None  # no mark yet: not unchanged

    @property
    def marked(self) -> bool:
        """Whether a mark was taken (``unchanged`` is False before)."""
        return self._then is not None

    def read(self) -> bytes:
        """The tags as they read now."""
        return self._memory[self._index].tobytes()

    def unchanged(self) -> bool:
        """Whether no watched dict changed since the mark (compared as bytes: numpy's
        comparison functions cost tens of microseconds right after a step)."""
        return self._memory[self._index].tobytes() == self._then

    def mark(self, tags: bytes) -> None:
        """Take ``tags`` (a ``read`` made before the caller proved its dicts as it expects
        them) as the mark."""
        self._then = tags


def watch(dicts: Sequence[dict[Any, Any]]) -> Watch | None:
    """A ``Watch`` of ``dicts`` (exactly dicts and their subclasses that keep entries in
    the dict itself); None where tags cannot be read here, or ``dicts`` is empty."""
    if _OFFSET is None or not dicts or not all(isinstance(d, dict) for d in dicts):
        return None
    try:
        return Watch(dicts, _OFFSET)
    except (OverflowError, MemoryError, ValueError, TypeError):
        # a view over the span its addresses cover could not be made here: a snapshot then
        # compares in full rather than fail
        return None
