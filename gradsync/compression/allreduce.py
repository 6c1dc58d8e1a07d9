"""The uncompressed exchange: a plain asynchronous all-reduce of the bucket, then divide.

Its codec, for parameter-server pushes, is fp.py's :class:`~gradsync.compression.fp.CastCodec`
with the gradient's own dtype on the wire: the values, exactly. The hook has nothing to encode
(it reduces the buffer in place), so it does not call the codec.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from gradsync import exit_safety
from gradsync.compression._wire import accumulator_dtype, all_reduce_async, world_and_rank
from gradsync.compression.base import BucketLike, Compressor, Group
from gradsync.compression.fp import CastCodec


@dataclass(slots=True)
class AllReduceState:
    group: Group = None
    bytes_sent: int = field(default=0)

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        del state


def allreduce_hook(state: AllReduceState, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    world, _ = world_and_rank(state.group)
    state.bytes_sent += buf.numel() * buf.element_size()
    work = all_reduce_async(buf, state.group)

    def mean(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        return fut.value()[0].div_(world)

    return exit_safety.then(work.get_future(), mean)


def plain_codec(numel: int, dtype: torch.dtype, shapes: list[list[int]], stream: int) -> CastCodec:
    """``Compressor.codec`` for ``none``: every value in its own dtype."""
    del shapes, stream
    return CastCodec(numel, dtype, accumulator_dtype(dtype))


def _make_state(group: Group) -> AllReduceState:
    return AllReduceState(group=group)


ALLREDUCE = Compressor(
    spec="none",
    make_state=_make_state,
    hook=allreduce_hook,
    nominal_ratio=1.0,
    codec=plain_codec,
)
