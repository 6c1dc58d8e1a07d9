"""Checkpoints: a rank's saves and loads (``checkpointer``), the files on disk and their commit
(``files``, ``store``), the packed format (``packing``), the writer off the training thread
(``writer_process`` and its torch-free ``writer_child``), replicated shares (``replicas``), the
RNG state (``rng``), the step-record log (``row_log``) and the export to torch's own formats
(``export``). See docs/checkpoints.md and docs/architecture.md.

The names below are loaded on first use (PEP 562): the writer's process (``writer_child``)
imports this package without torch, and most of these modules import it.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # the static view of the lazy names below, for mypy and editors
    from gradsync.checkpoint.rng import rng_state, set_rng_state
    from gradsync.checkpoint.store import (
        FORMAT_VERSION,
        MANIFEST,
        CheckpointError,
        CheckpointInfo,
        CheckpointStore,
        CheckpointWarning,
        FileEntry,
        safe_load,
    )

_LAZY = {
    "FORMAT_VERSION": "gradsync.checkpoint.files",
    "MANIFEST": "gradsync.checkpoint.files",
    "CheckpointError": "gradsync.checkpoint.files",
    "CheckpointInfo": "gradsync.checkpoint.files",
    "CheckpointStore": "gradsync.checkpoint.store",
    "CheckpointWarning": "gradsync.checkpoint.store",
    "FileEntry": "gradsync.checkpoint.files",
    "rng_state": "gradsync.checkpoint.rng",
    "safe_load": "gradsync.checkpoint.store",
    "set_rng_state": "gradsync.checkpoint.rng",
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
        raise AttributeError(f"module 'gradsync.checkpoint' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
