"""State that components register to be saved with every checkpoint and put back on load.

A component of the user's that owns state a resumed run needs (a learning-rate scheduler, a
data loader's position) registers it once under a key as a pair of functions, as torchft's
``Manager`` takes ``(state_dict, load_state_dict)`` per component::

    sync.register_state("scheduler", scheduler.state_dict, scheduler.load_state_dict)

``sync.save()`` writes what ``state_fn()`` returns with the rank's state, and ``sync.load()``
calls ``load_fn(saved)`` once the model and optimizer are restored: checkpoint code never
reaches into the component. What is restored where a key or an entry is missing, and on another
number of ranks: docs/checkpoints.md, "Your own state".
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gradsync.checkpoint.store import CheckpointWarning
from gradsync.errors import CheckpointError, UsageError

__all__ = ["REGISTERED", "StateRegistry"]

#: where a rank's file keeps the registered states (one entry per key); a file written
#: before a key was registered has no entry for it
REGISTERED = "registered"


@dataclass(frozen=True, slots=True)
class _Entry:
    state_fn: Callable[[], Any]
    load_fn: Callable[[Any], Any]
    replicated: bool


class StateRegistry:
    """The registered ``{key: (state_fn, load_fn)}`` of one rank, in registration order."""

    def __init__(self) -> None:
        self._entries: dict[str, _Entry] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def register(
        self,
        key: str,
        state_fn: Callable[[], Any],
        load_fn: Callable[[Any], Any],
        *,
        replicated: bool = False,
    ) -> None:
        """Save ``state_fn()`` under ``key`` with every checkpoint and call ``load_fn`` with
        it on load (see the module docstring). A key is registered once: ``unregister`` it
        first to register it anew."""
        if not isinstance(key, str) or not key:
            raise UsageError(f"register_state: the key must be a non-empty str, got {key!r}")
        if key in self._entries:
            raise UsageError(
                f"register_state: {key!r} is registered already; unregister_state({key!r}) "
                "first to register it anew"
            )
        for name, fn in (("state_fn", state_fn), ("load_fn", load_fn)):
            if not callable(fn):
                raise UsageError(
                    f"register_state({key!r}): {name} must be callable, got {fn!r} (e.g. "
                    "scheduler.state_dict and scheduler.load_state_dict, not their results)"
                )
        self._entries[key] = _Entry(state_fn, load_fn, bool(replicated))

    def unregister(self, key: str) -> None:
        if key not in self._entries:
            known = ", ".join(map(repr, self._entries)) or "none"
            raise UsageError(f"unregister_state: {key!r} is not registered (registered: {known})")
        del self._entries[key]

    def states(self) -> dict[str, Any]:
        """Every registered state as saved now, by key."""
        return {key: entry.state_fn() for key, entry in self._entries.items()}

    def load(
        self, saved: dict[str, Any] | None, *, step: int, world_changed: bool, warn: bool
    ) -> None:
        """Put back each registered state from ``saved``: this rank's file's entries, or,
        after a change of world size, rank 0's (then only the replicated ones). With ``warn``,
        warns of an entry the checkpoint lacks and of one it holds that nothing registered
        now: neither is silent."""
        saved = saved or {}
        for key, entry in self._entries.items():
            if world_changed and not entry.replicated:
                if warn:
                    _warn(
                        f"resuming from step {step} on another number of ranks: registered "
                        f"state {key!r} is per rank (registered without replicated=True) and "
                        "is not restored; it keeps its current value"
                    )
                continue
            if key not in saved:
                if warn:
                    _warn(
                        f"the checkpoint of step {step} holds no state for {key!r} (it was "
                        "written before that key was registered); it keeps its current value"
                    )
                continue
            try:
                entry.load_fn(saved[key])
            except Exception as exc:
                raise CheckpointError(
                    f"registered state {key!r} of the checkpoint of step {step}: its load "
                    f"function raised {type(exc).__name__}: {exc}"
                ) from exc
        unknown = [key for key in saved if key not in self._entries]
        if unknown and warn:
            _warn(
                f"the checkpoint of step {step} holds state for {', '.join(map(repr, unknown))}, "
                "which nothing registered in this run: not restored (register it before "
                "sync.load() to have it put back)"
            )


def _warn(message: str) -> None:
    warnings.warn(message, CheckpointWarning, stacklevel=4)
