"""Fault tolerance: atomic, verified checkpoints and weights_only-safe RNG state."""

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
