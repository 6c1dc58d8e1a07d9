"""The optimizer's ``param_groups`` as a checkpoint holds them, made again only when a group
changed.

Why: with a checkpoint every step, each snapshot built the groups (each group's values, its
parameters as indices), encoded them and pickled them into the held message: about 25 us a save
right after a step (charlm, 2 ranks), for numbers that change only with a learning-rate
schedule. While the groups are unchanged, ``KeptGroups.now`` gives them encoded once
(``packing.constant``): the writer process gets their text once, as for the replicated share.

Unchanged is proven, not assumed: the same list of the same group dicts, each group's
parameter count the same, and each dict's version tag as when the groups were last made
(``dict_versions``; a new learning rate changes it). Only groups whose values, ``params`` aside,
are plain numbers, strings, None or tuples of those are kept so: a value that can change in
place (a tensor learning rate, a list) would change nothing a tag shows.

A schedule that changes the groups at every step gets fresh groups at every step, as before:
they are encoded to be kept only when unchanged since the snapshot before, so a new text is
not sent to the writer each step; and after a few changes in a row they are not watched
either (making a watch costs more than the groups), but for a look every 16th call.
"""

from __future__ import annotations

import operator
from typing import Any

import torch

from gradsync.fault import dict_versions, packing

__all__ = ["KeptGroups", "param_groups"]

_PLAIN = (int, float, bool, str, type(None), complex)
#: calls in a row finding the groups changed before ``now`` stops watching them (a schedule
#: that changes them at every step), and how often it looks again then
_CHANGED_TOLERATED = 3
_RETRY_EVERY = 16
_is = operator.is_


def param_groups(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """``optimizer.state_dict()["param_groups"]`` without building the rest: each group's
    values but ``params``, then ``params`` as indices in the order of every group's
    parameters (``state_plan.build`` checks that torch's state dict gives the same)."""
    packed, start = [], 0
    for group in optimizer.param_groups:
        entry = {k: v for k, v in group.items() if k != "params"}
        count = len(group["params"])
        entry["params"] = list(range(start, start + count))
        start += count
        packed.append(entry)
    return packed


def _plain(value: Any) -> bool:
    if type(value) is tuple:
        return all(type(v) in _PLAIN for v in value)
    return type(value) in _PLAIN


class KeptGroups:
    """One optimizer's groups as last made, and whether they still hold (module docstring)."""

    def __init__(self) -> None:
        self._optimizer: Any = None
        self._groups: list[dict[str, Any]] = []  # ``optimizer.param_groups`` then, held
        self._dicts: list[dict[str, Any]] = []  # its group dicts then
        self._counts: list[int] = []  # their parameter counts then
        self._watch: dict_versions.Watch | None = None
        self._made: list[dict[str, Any]] | None = None  # ``param_groups`` then
        self._encoded: Any = None  # ``_made`` encoded once (``packing.constant``)
        self._changed = 0  # calls in a row that found the groups changed

    def now(self, optimizer: torch.optim.Optimizer) -> Any:
        """The groups to save now: encoded once while unchanged, else fresh groups."""
        if self._made is not None and self._unchanged(optimizer):
            self._changed = 0
            if self._encoded is None:
                self._encoded = packing.constant(self._made)
            return self._encoded
        self._changed += 1
        if self._changed > _CHANGED_TOLERATED and self._changed % _RETRY_EVERY:
            # A schedule changing them at every step: made fresh, as before this module, and
            # looked at again now and then. What ``_made`` holds stays behind its mark: the
            # tags have changed since, so it is never given for these groups.
            return param_groups(optimizer)
        return self._make(optimizer)

    def forget(self) -> None:
        """Make the groups again at the next call (the optimizer's state was loaded)."""
        self._made, self._encoded, self._watch, self._changed = None, None, None, 0

    def _same_dicts(self, optimizer: torch.optim.Optimizer) -> bool:
        """Whether ``optimizer``'s groups are the watched list of the watched dicts."""
        groups = optimizer.param_groups
        return (
            self._watch is not None
            and optimizer is self._optimizer
            and groups is self._groups
            and len(groups) == len(self._dicts)
            and all(map(_is, groups, self._dicts))
        )

    def _unchanged(self, optimizer: torch.optim.Optimizer) -> bool:
        watch = self._watch
        return (
            watch is not None
            and self._same_dicts(optimizer)
            and [len(g["params"]) for g in optimizer.param_groups] == self._counts
            and watch.unchanged()
        )

    def _make(self, optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
        groups = optimizer.param_groups
        # The same dicts as the last call's: their watch serves again (making one takes
        # longer than making the groups).
        watch = self._watch if self._same_dicts(optimizer) else dict_versions.watch(groups)
        # The tags are read before the groups are: a change while they are made shows at the
        # next call instead of being taken into the mark.
        tags = watch.read() if watch is not None else b""
        made = param_groups(optimizer)
        self._made, self._encoded, self._watch = None, None, None
        # Exactly dicts: an ``OrderedDict`` group can be reordered (``move_to_end``), which
        # changes the saved order and no tag.
        keepable = all(type(g) is dict for g in groups) and all(
            _plain(v) for g in groups for k, v in g.items() if k != "params"
        )
        if watch is not None and keepable:
            watch.mark(tags)
            self._optimizer, self._groups, self._dicts = optimizer, groups, list(groups)
            self._counts = [len(g["params"]) for g in groups]
            self._watch, self._made = watch, made
        return made
