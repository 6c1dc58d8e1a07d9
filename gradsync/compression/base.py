"""The compressor contract shared by every strategy that sends gradients.

A compressor is a small function plus a state object, in the shape of torch's DDP communication
hooks (``powerSGD_hook(state, bucket)`` with ``PowerSGDState``):

    hook(state, bucket) -> torch.futures.Future[torch.Tensor]

``bucket`` is anything with DDP's ``GradBucket`` surface (``buffer()``, ``index()``,
``is_last()``, ``parameters()``, ``gradients()``); a real ``GradBucket`` works, so the same hook
plugs into ``DistributedDataParallel.register_comm_hook``. The future's value is the **mean**
over the ranks of ``state.group`` of ``bucket.buffer()``, same shape and dtype, and it must be
bitwise identical on every rank (replicas stay identical). The hook may write into the buffer.

Every state counts ``bytes_sent``: the payload bytes this rank handed to collectives.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist


class BucketLike(Protocol):
    def buffer(self) -> torch.Tensor: ...
    def index(self) -> int: ...
    def is_last(self) -> bool: ...
    def parameters(self) -> list[torch.Tensor]: ...
    def gradients(self) -> list[torch.Tensor]: ...


class CompressorState(Protocol):
    group: dist.ProcessGroup | None
    bytes_sent: int

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


Hook = Callable[[Any, BucketLike], "torch.futures.Future[torch.Tensor]"]


@dataclass(frozen=True, slots=True)
class Compressor:
    """A named pair: how to make per-run state, and the hook that exchanges one bucket."""

    spec: str
    make_state: Callable[[dist.ProcessGroup | None], Any]
    hook: Hook
    #: payload bytes per fp32 byte, for reports; None when it depends on the data.
    nominal_ratio: float | None = None


class FlatBucket:
    """A ``GradBucket`` look-alike over one flat tensor, for strategies that are not DDP-shaped
    (DiLoCo's pseudo-gradient, parameter-server pushes) and for tests."""

    __slots__ = ("_buffer", "_index", "_is_last", "_params", "_shapes")

    def __init__(
        self,
        buffer: torch.Tensor,
        index: int = 0,
        is_last: bool = True,
        params: list[torch.Tensor] | None = None,
    ) -> None:
        self._buffer = buffer
        self._index = index
        self._is_last = is_last
        self._params = params if params is not None else [buffer]

    def buffer(self) -> torch.Tensor:
        return self._buffer

    def set_buffer(self, buffer: torch.Tensor) -> None:
        self._buffer = buffer

    def index(self) -> int:
        return self._index

    def is_last(self) -> bool:
        return self._is_last

    def parameters(self) -> list[torch.Tensor]:
        return self._params

    def gradients(self) -> list[torch.Tensor]:
        # Views into the flat buffer, in parameter order, like GradBucket.gradients().
        out, offset = [], 0
        for p in self._params:
            n = p.numel()
            out.append(self._buffer[offset : offset + n].view_as(p))
            offset += n
        return out
