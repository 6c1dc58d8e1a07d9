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

A compressor family also has a **codec**: the pure encode/decode of one flat tensor into
payload pieces (:class:`Codec`), with no communication. The family's hook builds its
collective around that codec where the math is the same, and the parameter-server push path
(``gradsync.compression.push``) frames the same codec's pieces into one point-to-point message.
``Compressor.codec`` is the factory that builds it for a given tensor; a compressor without one
works as a hook but cannot compress pushes.
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


#: ``(dtype, numel)`` of each payload piece, in order: what ``_wire.to_payload`` concatenates and
#: ``_wire.from_payload`` splits again. It depends only on the codec's arguments, never on the data.
Layout = tuple[tuple[torch.dtype, int], ...]


class Codec(Protocol):
    """One family's encoding of a flat tensor into payload pieces, and back.

    ``encode(x, step)`` takes a flat tensor and returns pieces matching ``layout``;
    ``decode(parts, step)`` returns a new flat tensor in the accumulator dtype (at least fp32).
    ``step`` is the encode's sequence number: stochastic codecs derive their random draw from
    it (plus the key they were built with), so a decoder built with the same arguments redraws
    what it needs. ``state_dict()`` holds what one encode carries to the next (PowerSGD's warm
    start; empty for the others), tensors and plain values only.
    """

    @property
    def layout(self) -> Layout: ...

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]: ...
    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor: ...
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class CodecFactory(Protocol):
    """Builds a family's codec for ``numel`` elements of ``dtype``.

    ``shapes`` are the tensors concatenated in the flat input, in order (their sizes add up to
    ``numel``; ``[[numel]]`` when unknown), which PowerSGD needs to find matrices. ``stream``
    names the caller's random stream (a parameter-server worker and shard), so two callers
    with different streams draw independently. Families bind their own options (chunk,
    fraction, rank, seed) with ``functools.partial``, which keeps a Compressor picklable.
    """

    def __call__(
        self, numel: int, dtype: torch.dtype, shapes: list[list[int]], stream: int
    ) -> Codec: ...


class Stateless:
    """Mixin for codecs that carry nothing from one encode to the next."""

    __slots__ = ()

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class Contribution(Protocol):
    """This rank's decoded contribution kept in a form cheaper than a dense tensor.

    A hook may record one in ``state.sent[index]`` instead of the tensor: the error-feedback
    wrapper then calls ``subtract_from(corrected)``, which returns ``corrected`` minus the
    contribution, computed in place. PowerSGD's is ``P P^T M``, which it subtracts from its
    factors rather than building an n x m product only to subtract it.
    """

    def subtract_from(self, corrected: torch.Tensor) -> torch.Tensor: ...


class ReplicaExchange:
    """Where a compressor's collectives go when they are not torch.distributed's: live
    membership's replicas (``membership.ft_manager``), whose all-gathers and all-reduces run on
    torchft's process group, rebuilt at every new quorum and never registered with
    torch.distributed. Its size, this replica's rank, and the two collectives compressors
    post, each returning a ``Work`` as ``async_op=True`` does. A base class rather than a
    Protocol: ``_wire`` tells it from a process group with one ``isinstance`` per exchange."""

    def size(self) -> int:
        raise NotImplementedError

    def rank(self) -> int:
        raise NotImplementedError

    def all_gather(self, outputs: list[torch.Tensor], tensor: torch.Tensor) -> dist.Work:
        raise NotImplementedError

    def all_reduce_sum(self, tensor: torch.Tensor) -> dist.Work:
        raise NotImplementedError


#: Where a compressor state's collectives go: a torch.distributed group (None: the default
#: group) or live membership's replicas.
Group = dist.ProcessGroup | ReplicaExchange | None

#: What a hook records in ``state.sent[index]`` for error feedback.
Sent = torch.Tensor | Contribution


class CompressorState(Protocol):
    group: Group
    bytes_sent: int

    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, state: dict[str, Any]) -> None: ...


Hook = Callable[[Any, BucketLike], "torch.futures.Future[torch.Tensor]"]


@dataclass(frozen=True, slots=True)
class Compressor:
    """How to make per-run state, the hook that exchanges one bucket, and the family's codec."""

    spec: str
    make_state: Callable[[Group], Any]
    hook: Hook
    #: payload bytes per fp32 byte, for reports; None when it depends on the data.
    nominal_ratio: float | None = None
    #: builds the family's :class:`Codec` (the same encoding the hook uses), for point-to-point
    #: pushes; None for a compressor that only has a hook (``make_push_codec`` refuses it).
    codec: CodecFactory | None = None
    #: True when ``error_feedback`` wrapped it: a push keeps the worker's residual too.
    feedback: bool = False
    #: True when its state is the outer momentum of a periodic average (sparseloco's decaying
    #: accumulator): only ``local:H`` and ``diloco:H`` take it, and DiLoCo's outer step then
    #: runs without a momentum of its own.
    replaces_momentum: bool = False


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
