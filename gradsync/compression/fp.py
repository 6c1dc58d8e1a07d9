"""Half-precision exchange: ``fp16`` and ``bf16``.

Each rank divides its buffer by the world size *before* casting (so the on-the-wire sum of W
values, each at most max/W, cannot overflow fp16 where the fp32 values did not), all-reduces the
16-bit tensor asynchronously, and casts the mean back to the buffer's dtype. Bytes on the wire:
2 per element. The estimate is within half-precision rounding of the mean (relative error about
2**-11 for fp16 normals, 2**-8 for bf16); fp16 cannot represent a per-rank share above 65504, and
such values become inf (the non-finite guard then reports the step).

:class:`CastCodec` is the encoding (every element, cast to the wire dtype): the hook casts each
rank's share with it, parameter-server pushes send it, and ``none`` (allreduce.py) is the same
codec with the gradient's own dtype on the wire.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsync import exit_safety
from gradsync.compression._wire import (
    accumulator_dtype,
    all_reduce_async,
    record_sent,
    world_and_rank,
)
from gradsync.compression.base import BucketLike, Compressor, Group, Layout, Stateless


@dataclass(slots=True)
class CastState:
    group: Group = None
    bytes_sent: int = 0
    #: set to a dict by an error-feedback wrapper: bucket index -> this rank's decoded share.
    sent: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


class CastCodec(Stateless):
    """Every element, cast to ``wire``; decoded into a new tensor of the accumulator dtype."""

    __slots__ = ("acc", "layout", "wire")

    def __init__(self, numel: int, wire: torch.dtype, acc: torch.dtype) -> None:
        self.wire, self.acc = wire, acc
        self.layout: Layout = ((wire, numel),)

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        return [x.to(self.wire)]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        return parts[0].to(self.acc, copy=True)  # never a view of the receive buffer


def cast_hook(
    dtype: torch.dtype, state: CastState, bucket: BucketLike
) -> torch.futures.Future[torch.Tensor]:
    """Mean of ``bucket.buffer()`` over ranks, exchanged as ``dtype`` (bind dtype with partial)."""
    buf = bucket.buffer()
    world, _ = world_and_rank(state.group)
    codec = CastCodec(buf.numel(), dtype, accumulator_dtype(buf.dtype))
    # Each rank's share, not its value: the wire's sum cannot overflow where the fp32 did not.
    (wire,) = codec.encode(buf.div(world), 0)
    state.bytes_sent += wire.numel() * wire.element_size()
    if state.sent is not None:
        record_sent(state, bucket.index(), codec.decode([wire], 0).mul_(world))
    work = all_reduce_async(wire, state.group)

    def cast_back(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buf.copy_(fut.value()[0].view_as(buf))

    return exit_safety.then(work.get_future(), cast_back)


def fp16_hook(state: CastState, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    return cast_hook(torch.float16, state, bucket)


def bf16_hook(state: CastState, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    return cast_hook(torch.bfloat16, state, bucket)


def cast_codec(
    numel: int, dtype: torch.dtype, shapes: list[list[int]], stream: int, *, wire: torch.dtype
) -> CastCodec:
    """``Compressor.codec`` for fp16 / bf16 (bind ``wire`` with partial)."""
    del shapes, stream
    return CastCodec(numel, wire, accumulator_dtype(dtype))


def _make_state(group: Group) -> CastState:
    return CastState(group=group)


FP16 = Compressor(
    spec="fp16",
    make_state=_make_state,
    hook=fp16_hook,
    nominal_ratio=0.5,
    codec=functools.partial(cast_codec, wire=torch.float16),
)
BF16 = Compressor(
    spec="bf16",
    make_state=_make_state,
    hook=bf16_hook,
    nominal_ratio=0.5,
    codec=functools.partial(cast_codec, wire=torch.bfloat16),
)

#: the wire dtype of each cast compressor, by spec: what live membership's quorum sends
#: (``Membership.allreduce(tensor, wire)``) when BSP is given one of them
CAST_WIRE = {"fp16": torch.float16, "bf16": torch.bfloat16}

__all__ = [
    "CAST_WIRE",
    "BF16",
    "FP16",
    "CastCodec",
    "CastState",
    "bf16_hook",
    "cast_codec",
    "cast_hook",
    "fp16_hook",
]
