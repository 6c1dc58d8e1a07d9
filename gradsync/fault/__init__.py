"""Fault tolerance: atomic, verified checkpoints and weights_only-safe RNG state.

The names below are loaded on first use (PEP 562), as in ``gradsync`` itself: the background
checkpoint writer's process (``gradsync.fault.writer_child``) imports this package without
torch, and most of these modules import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the static view of the lazy names below, for mypy and editors
    from gradsync.fault.checkpoint import (
        FORMAT_VERSION,
        MANIFEST,
        CheckpointError,
        CheckpointInfo,
        CheckpointStore,
        CheckpointWarning,
        FileEntry,
        safe_load,
    )
    from gradsync.fault.rng import rng_state, set_rng_state

_LAZY = {
    "FORMAT_VERSION": "gradsync.fault.files",
    "MANIFEST": "gradsync.fault.files",
    "CheckpointError": "gradsync.fault.files",
    "CheckpointInfo": "gradsync.fault.files",
    "CheckpointStore": "gradsync.fault.checkpoint",
    "CheckpointWarning": "gradsync.fault.checkpoint",
    "FileEntry": "gradsync.fault.files",
    "rng_state": "gradsync.fault.rng",
    "safe_load": "gradsync.fault.checkpoint",
    "set_rng_state": "gradsync.fault.rng",
}

__all__ = [
    "FORMAT_VERSION",
    "MANIFEST",
    "CheckpointError",
    "CheckpointInfo",
    "CheckpointStore",
    "CheckpointWarning",
    "FileEntry",
    "rng_state",
    "safe_load",
    "set_rng_state",
]


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gradsync.fault' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
