"""The names ``gradsync.fault`` held before checkpointing got a package of its own
(``gradsync.checkpoint``) and the checks around a step another (``gradsync.checks``): kept so
that scripts importing ``from gradsync.fault import CheckpointStore, rng_state`` go on working.
New code imports from ``gradsync.checkpoint``."""

from __future__ import annotations

from typing import Any

from gradsync import checkpoint

__all__ = list(checkpoint.__all__)


def __getattr__(name: str) -> Any:
    if name in checkpoint.__all__:
        return getattr(checkpoint, name)
    raise AttributeError(f"module 'gradsync.fault' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(__all__))
