"""Half-precision exchange: ``fp16`` and ``bf16``.

Each rank divides its buffer by the world size *before* casting (so the on-the-wire sum of W
values, each at most max/W, cannot overflow fp16 where the fp32 values did not), all-reduces the
16-bit tensor asynchronously, and casts the mean back to the buffer's dtype. Bytes on the wire:
2 per element. The estimate is within half-precision rounding of the mean (relative error about
2**-11 for fp16 normals, 2**-8 for bf16); fp16 cannot represent a per-rank share above 65504, and
such values become inf (the non-finite guard then reports the step).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync.compression._wire import accumulator_dtype, record_sent, world_and_rank
from gradsync.compression.base import BucketLike, Compressor


@dataclass(slots=True)
class CastState:
    group: dist.ProcessGroup | None = None
    bytes_sent: int = 0
    #: set to a dict by an error-feedback wrapper: bucket index -> this rank's decoded share.
    sent: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def cast_hook(
    dtype: torch.dtype, state: CastState, bucket: BucketLike
) -> torch.futures.Future[torch.Tensor]:
    """Mean of ``bucket.buffer()`` over ranks, exchanged as ``dtype`` (bind dtype with partial)."""
    buf = bucket.buffer()
    world, _ = world_and_rank(state.group)
    wire = buf.div(world).to(dtype)
    state.bytes_sent += wire.numel() * wire.element_size()
    if state.sent is not None:
        record_sent(state, bucket.index(), wire.to(accumulator_dtype(buf.dtype)).mul_(world))
    work = dist.all_reduce(wire, group=state.group, async_op=True)
    assert work is not None

    def cast_back(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return buf.copy_(fut.value()[0].view_as(buf))

    return work.get_future().then(cast_back)


def fp16_hook(state: CastState, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    return cast_hook(torch.float16, state, bucket)


def bf16_hook(state: CastState, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    return cast_hook(torch.bfloat16, state, bucket)


def _make_state(group: dist.ProcessGroup | None) -> CastState:
    return CastState(group=group)


FP16 = Compressor(spec="fp16", make_state=_make_state, hook=fp16_hook, nominal_ratio=0.5)
BF16 = Compressor(spec="bf16", make_state=_make_state, hook=bf16_hook, nominal_ratio=0.5)

__all__ = ["BF16", "FP16", "CastState", "bf16_hook", "cast_hook", "fp16_hook"]
