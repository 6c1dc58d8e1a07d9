"""``int4``: per-chunk scaled 4-bit quantization, rounded to nearest, with error feedback.

Each chunk of ``chunk`` elements (default 128) gets the scale ``s = max|x| / 7``; an element
becomes ``q = round(x / s)``, in ``[-7, 7]``, stored as ``q + 8`` in four bits, two elements a
byte (the first in the low half). The error per element is at most ``s / 2``.

Rounding to nearest is biased (a value that always sits a third of a step above a level is
always sent a third of a step low), so ``parse_compression("int4")`` wraps it in error
feedback: what one exchange rounds away is added to the next exchange of the same bucket. We
chose that over int8's stochastic rounding because at 4 bits one step is 1/7 of the chunk's
largest value: unbiased rounding would add up to ``s**2 / 4`` of variance to every element of
every exchange, while error feedback carries the error forward and sends it later. The
intended use is a pseudo-gradient sent once every H steps (``diloco:H``, streaming DiLoCo's
fragments), where each exchange matters and there are few of them; the chunk is small, because
the 15 levels leave little room for a chunk whose values differ in size.

The exchange is int8's: an all-gather of every rank's payload (fp32 scales, then the packed
codes), decoded in rank order, so the mean is bitwise identical on every rank. Bytes this rank
hands to the collective: ``ceil(n / 2) + 4 * ceil(n / chunk)``, about 0.13 of fp32's at
chunk 128. Like int8, it saves traffic only up to about 8 ranks (each rank receives every
other rank's payload).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsync.compression import fused
from gradsync.compression._wire import (
    accumulator_dtype,
    add_scaled_chunks_,
    all_gather_mean,
    block_elements,
    blocks,
    scale_chunks_,
    split_chunks,
)
from gradsync.compression.base import BucketLike, Compressor, Group, Layout, Stateless
from gradsync.compression.int8 import chunk_absmax

DEFAULT_CHUNK = 128
#: the largest code: 15 levels, symmetric about 0, and ``q + 8`` fits in four bits
LEVELS = 7


@dataclass(slots=True)
class Int4State:
    group: Group = None
    bytes_sent: int = 0
    chunk: int = DEFAULT_CHUNK
    #: set by the error-feedback wrapper: this rank's decoded contribution per bucket index
    sent: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        return {"chunk": self.chunk}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.chunk = int(state["chunk"])


def quantize(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``x`` -> (fp32 scale per chunk, ``ceil(n / 2)`` bytes of packed codes)."""
    flat = x.reshape(-1).float()
    n = flat.numel()
    scale = chunk_absmax(flat, chunk) / LEVELS
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    # One byte per code first (padded to an even count with the code of 0), packed at the end.
    codes = torch.full((n + n % 2,), LEVELS + 1, dtype=torch.uint8, device=flat.device)
    v_block = torch.empty(min(n, block_elements(flat.device) + chunk), device=flat.device)
    for start, stop in blocks(n, chunk, flat.device):
        v = v_block[: stop - start]
        rows, tail = split_chunks(flat[start:stop], chunk)
        v_rows, v_tail = split_chunks(v, chunk)
        first = start // chunk
        torch.div(rows, safe[first : first + rows.shape[0], None], out=v_rows)
        if tail.numel():
            torch.div(tail, safe[-1], out=v_tail)
        # The clamp only bites when fp rounding pushes |x/s| a hair past 7.
        codes[start:stop].copy_(v.round_().clamp_(-LEVELS, LEVELS).add_(LEVELS + 1))
    return scale, codes[0::2] | (codes[1::2] << 4)


def unpack_codes(packed: torch.Tensor, start: int, stop: int, dtype: torch.dtype) -> torch.Tensor:
    """Elements ``[start, stop)`` (``start`` even) of packed codes, as signed levels."""
    part = packed[start // 2 : -(-stop // 2)]
    pairs = torch.stack([part & 15, part >> 4], dim=1).reshape(-1)[: stop - start]
    return pairs.to(dtype).sub_(LEVELS + 1)


class Int4Codec(Stateless):
    """``ceil(n / chunk)`` fp32 scales, then ``ceil(n / 2)`` bytes of codes. Deterministic: the
    encode needs no random stream."""

    __slots__ = ("acc", "chunk", "layout", "numel")

    def __init__(self, numel: int, chunk: int, acc: torch.dtype) -> None:
        self.numel, self.chunk, self.acc = numel, chunk, acc
        self.layout: Layout = ((torch.float32, -(-numel // chunk)), (torch.uint8, -(-numel // 2)))

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        del step
        got = fused.INT4_ENCODE.run_on(x, x, self.chunk)
        scale, packed = quantize(x, self.chunk) if got is None else got
        return [scale, packed]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        scale, packed = parts
        got = fused.INT4_DECODE.run_on(packed, packed, scale, self.numel, self.chunk, self.acc)
        if got is not None:
            return got
        out = torch.zeros(self.numel, dtype=self.acc, device=parts[0].device)
        self.accumulate(parts, out, step)
        return out

    def accumulate(self, parts: list[torch.Tensor], out: torch.Tensor, step: int) -> None:
        del step
        scale, packed = parts
        decoded = (packed, scale, self.numel, self.chunk, out.dtype)
        if fused.on_device(out) and fused.accumulate(fused.INT4_DECODE, out, 1.0, *decoded):
            return
        for start, stop in blocks(self.numel, self.chunk, out.device):
            # Widened a block at a time: no temporary as large as the bucket.
            first, last = start // self.chunk, -(-stop // self.chunk)
            values = unpack_codes(packed, start, stop, out.dtype)
            add_scaled_chunks_(out[start:stop], values, scale[first:last], self.chunk)

    def contribution(self, parts: list[torch.Tensor], step: int) -> Int4Sent:
        del step
        return Int4Sent(self, parts)


class Int4Sent:
    """This rank's decoded codes, for error feedback: subtracted from the corrected gradient a
    block at a time, never built as a dense tensor (it was: a zeroed bucket-sized tensor, the
    decode into it, then the subtraction, 1.5-2 ms of a fragment's 8 ms launch under streaming
    DiLoCo on the frontier's mlp, issue 46). The same bits as that: each value is scaled
    (rounded once, as the decode into zeros rounds it) and then subtracted (rounded once)."""

    __slots__ = ("codec", "parts")

    def __init__(self, codec: Int4Codec, parts: list[torch.Tensor]) -> None:
        self.codec, self.parts = codec, parts

    def subtract_from(self, corrected: torch.Tensor) -> torch.Tensor:
        flat, (scale, packed), chunk = corrected.view(-1), self.parts, self.codec.chunk
        decoded = (packed, scale, self.codec.numel, chunk, flat.dtype)
        if fused.on_device(flat) and fused.accumulate(fused.INT4_DECODE, flat, -1.0, *decoded):
            return corrected
        for start, stop in blocks(self.codec.numel, chunk, flat.device):
            first, last = start // chunk, -(-stop // chunk)
            values = unpack_codes(packed, start, stop, flat.dtype)
            flat[start:stop].sub_(scale_chunks_(values, scale[first:last], chunk))
        return corrected


def int4_hook(state: Int4State, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    """Mean over ranks via an async all-gather of packed 4-bit codes plus scales."""
    buf = bucket.buffer()
    codec = Int4Codec(buf.numel(), state.chunk, accumulator_dtype(buf.dtype))
    return all_gather_mean(state, bucket, codec, 0)


def int4_codec(
    numel: int, dtype: torch.dtype, shapes: list[list[int]], stream: int, *, chunk: int
) -> Int4Codec:
    """``Compressor.codec`` for int4 (no random stream: ``stream`` is not needed)."""
    del shapes, stream
    return Int4Codec(numel, chunk, accumulator_dtype(dtype))


def int4(chunk: int = DEFAULT_CHUNK) -> Compressor:
    """The ``int4`` compressor, unwrapped (``parse_compression`` adds error feedback);
    ``chunk`` elements share one scale. An even chunk keeps every block of codes whole bytes."""
    if chunk < 2 or chunk % 2:
        raise ValueError(f"int4 chunk must be an even integer >= 2, got {chunk}")
    # partial, not a closure, so a Compressor pickles into spawned workers.
    return Compressor(
        spec="int4",
        make_state=functools.partial(Int4State, chunk=chunk),
        hook=int4_hook,
        nominal_ratio=(0.5 + 4.0 / chunk) / 4.0,
        codec=functools.partial(int4_codec, chunk=chunk),
    )
