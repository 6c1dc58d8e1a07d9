"""``sign``: one bit per element plus one fp32 scale per chunk (the EF-signSGD compressor).

Each chunk of ``chunk`` elements (default 64, a multiple of 8) is sent as its signs packed
eight to a byte and the scale ``mean |x|`` over the chunk, so the decoded chunk
``scale * sign(x)`` has the same L1 norm as ``x`` (Karimireddy et al., 2019). Zeros count as
positive. The estimate is biased; ``parse_compression("sign")`` wraps it in error feedback, which
is what makes scaled sign compression converge. Payloads differ per rank and cannot be summed as
bits, so they are all-gathered and decoded in rank order.

Bytes this rank hands to the collective: ``ceil(n / 8) + 4 * ceil(n / chunk)``, about 0.19 n
at the default chunk (21x fewer than fp32). :class:`SignCodec` is that encoding, shared by the
hook (every rank's payload) and parameter-server pushes.

Why 64 and not 1024: the optimizer sees the decoded gradient, and a chunk's one scale replaces
every element's magnitude. Adam divides each coordinate by its own running magnitude, so a
small-gradient coordinate sharing a chunk with large ones takes a much smaller step than it
would uncompressed. On charlm (AdamW, 2 ranks, 200 steps, seeds 0 and 1) the held-out loss
gap to uncompressed BSP was +11.5% and +13.0% at chunk 1024, +8.1% at 256, +5.1% and +5.6% at
128, +2.8% and +3.5% at 64, +2.9% at 32: 64 is the largest chunk inside 5%, for 1.5x the bytes
of chunk 1024.
"""

from __future__ import annotations

import functools
import sys
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F

from gradsync.compression import fused
from gradsync.compression._wire import (
    accumulator_dtype,
    add_scaled_chunks_,
    all_gather_mean,
    blocks,
    scale_chunks_,
    split_chunks,
)
from gradsync.compression.base import BucketLike, Compressor, Group, Layout, Stateless

DEFAULT_CHUNK = 64


@dataclass(slots=True)
class SignState:
    group: Group = None
    bytes_sent: int = 0
    chunk: int = DEFAULT_CHUNK
    sent: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        return {"chunk": self.chunk}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.chunk = int(state["chunk"])


#: ``w * PACK`` gathers the lowest bit of each of the 8 bytes of an int64 word ``w`` into its
#: top byte, byte j's bit landing on bit j: every partial product falls on its own bit (no
#: carries), and those meant for the top byte are exactly the 8 wanted ones. The product wraps
#: past 2**64 by design: torch's int64 multiply wraps in two's complement (tests compare the
#: result with the portable weighted sum below).
PACK = 0x0102040810204080


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


@functools.cache
def _sign_table(dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Row ``b``: the 8 signs (+1 for a set bit, -1 otherwise) that byte ``b`` packs."""
    bits = (torch.arange(256, device=device)[:, None] & _bit_weights(device)) != 0
    return bits.to(dtype).mul_(2.0).sub_(1.0)


def _chunk_abs_sums(part: torch.Tensor, chunk: int, out: torch.Tensor) -> None:
    """``sum |x|`` per chunk of ``part`` (a block starting on a chunk boundary) into ``out``'s
    first entries; |x| a block at a time: a bucket-sized temporary costs more than the sum."""
    rows, tail = split_chunks(part, chunk)
    torch.sum(rows.abs(), dim=1, out=out[: rows.shape[0]])
    if tail.numel():
        out[rows.shape[0]] = tail.abs().sum()


def _divide_sums(sums: torch.Tensor, n: int, chunk: int) -> torch.Tensor:
    sums[: n // chunk].div_(chunk)
    if n % chunk:
        sums[-1] /= n % chunk
    return sums


def pack_bits(bits: torch.Tensor) -> torch.Tensor:
    """Flat bool ``bits`` (a multiple of 8 long) -> one byte per 8, bit ``8i + j`` on bit ``j``
    of byte ``i``."""
    if sys.byteorder != "little":  # the word trick below reads bytes in little-endian order
        weights = _bit_weights(bits.device)
        return (bits.view(-1, 8).to(torch.uint8) * weights).sum(dim=1, dtype=torch.uint8)
    # One int64 word per output byte: multiply, keep the top byte. Two passes over n/8 words
    # instead of eight shifts, or a weighted sum, over all n bytes.
    product = bits.view(torch.uint8).view(torch.int64).mul_(PACK)
    return product.view(torch.uint8)[7::8].clone()


def pack_signs(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``x`` -> (fp32 scale per chunk, sign bits packed eight to a byte).

    Zeros count as positive, and so do the unused bits of the last byte (as before, when the
    input was padded with zeros).
    """
    flat = x.reshape(-1).float()
    n = flat.numel()
    scale = torch.empty(-(-n // chunk), device=flat.device)
    bits = torch.empty(-(-n // 8) * 8, dtype=torch.bool, device=flat.device)
    bits[n:] = True
    # Both passes over one block while it is in cache, not two passes over the bucket.
    for start, stop in blocks(n, chunk, flat.device):
        part = flat[start:stop]
        _chunk_abs_sums(part, chunk, scale[start // chunk :])
        torch.ge(part, 0, out=bits[start:stop])
    return _divide_sums(scale, n, chunk), pack_bits(bits)


def signs_of(packed: torch.Tensor, numel: int, dtype: torch.dtype) -> torch.Tensor:
    """+1 or -1 per element, as a new flat tensor of ``dtype``: one table row per byte."""
    table = _sign_table(dtype, packed.device)
    return F.embedding(packed.long(), table).view(-1)[:numel]


def unpack_signs(
    scale: torch.Tensor,
    packed: torch.Tensor,
    numel: int,
    chunk: int,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    return scale_chunks_(signs_of(packed, numel, dtype), scale, chunk)


class SignCodec(Stateless):
    """``ceil(n / chunk)`` fp32 scales ``mean |x|``, then ``ceil(n / 8)`` bytes of sign bits."""

    __slots__ = ("acc", "chunk", "layout", "numel")

    def __init__(self, numel: int, chunk: int, acc: torch.dtype) -> None:
        self.numel, self.chunk, self.acc = numel, chunk, acc
        self.layout: Layout = ((torch.float32, -(-numel // chunk)), (torch.uint8, -(-numel // 8)))

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        got = fused.SIGN_ENCODE.run_on(x, x, self.chunk)
        scale, bits = pack_signs(x, self.chunk) if got is None else got
        return [scale, bits]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        scale, packed = parts
        got = fused.SIGN_DECODE.run_on(packed, packed, scale, self.numel, self.chunk, self.acc)
        if got is not None:
            return got
        return unpack_signs(scale, packed, self.numel, self.chunk, self.acc)

    def accumulate(self, parts: list[torch.Tensor], out: torch.Tensor, step: int) -> None:
        # +-1 times the scale is exact, so this equals out.add_(decode(...)) bit for bit.
        self.accumulate_all([parts], out, step)

    def accumulate_all(
        self,
        parts_by_rank: list[list[torch.Tensor]],
        out: torch.Tensor,
        step: int,
        sign: float = 1.0,
    ) -> None:
        """Every rank's payload added into ``out`` in rank order (``sign`` -1: subtracted), a
        block of ``out`` at a time for all ranks while it is in cache (chunks are a multiple of
        8: blocks start on a byte), with no bucket-sized signs. Each element sees the same adds
        in the same order as one ``accumulate`` per rank, so the sum is the same bit for bit."""
        chunk = self.chunk
        if fused.on_device(out):
            # Rank by rank, each payload a pass of its own kernel; one the kernel did not take
            # (compilation off or failed) goes the blocked way, still in rank order.
            for parts in parts_by_rank:
                scale, packed = parts
                decoded = (packed, scale, self.numel, chunk, out.dtype)
                if not fused.accumulate(fused.SIGN_DECODE, out, sign, *decoded):
                    self._accumulate_blocked([parts], out, sign)
            return
        self._accumulate_blocked(parts_by_rank, out, sign)

    def _accumulate_blocked(
        self, parts_by_rank: list[list[torch.Tensor]], out: torch.Tensor, sign: float
    ) -> None:
        chunk = self.chunk
        for start, stop in blocks(self.numel, chunk, out.device):
            first, last = start // chunk, -(-stop // chunk)
            for scale, packed in parts_by_rank:
                signs = signs_of(packed[start // 8 : -(-stop // 8)], stop - start, out.dtype)
                add_scaled_chunks_(out[start:stop], signs, scale[first:last], chunk, sign)

    def contribution(self, parts: list[torch.Tensor], step: int) -> SignSent:
        return SignSent(self, parts)


class SignSent:
    """This rank's decoded signs, for error feedback: subtracted from the corrected gradient a
    block at a time, never built as a dense tensor. ``x - s * scale`` rounds once, as
    ``x - decode(...)`` does, since ``s * scale`` (``s`` = +-1) is exact."""

    __slots__ = ("codec", "parts")

    def __init__(self, codec: SignCodec, parts: list[torch.Tensor]) -> None:
        self.codec, self.parts = codec, parts

    def subtract_from(self, corrected: torch.Tensor) -> torch.Tensor:
        self.codec.accumulate_all([self.parts], corrected.view(-1), 0, sign=-1.0)
        return corrected


def sign_hook(state: SignState, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    """Mean over ranks of scaled signs, via one async all-gather of bits plus scales."""
    buf = bucket.buffer()
    codec = SignCodec(buf.numel(), state.chunk, accumulator_dtype(buf.dtype))
    return all_gather_mean(state, bucket, codec, 0)


def sign_codec(
    numel: int, dtype: torch.dtype, shapes: list[list[int]], stream: int, *, chunk: int
) -> SignCodec:
    """``Compressor.codec`` for sign (deterministic: ``stream`` is not used)."""
    del shapes, stream
    return SignCodec(numel, chunk, accumulator_dtype(dtype))


def sign(chunk: int = DEFAULT_CHUNK) -> Compressor:
    """Scaled sign without error feedback (``parse_compression("sign")`` adds it)."""
    if chunk < 8 or chunk % 8:
        raise ValueError(f"sign chunk must be a positive multiple of 8, got {chunk}")
    return Compressor(
        spec="sign",
        make_state=functools.partial(SignState, chunk=chunk),
        hook=sign_hook,
        nominal_ratio=(chunk / 8 + 4) / (4 * chunk),
        codec=functools.partial(sign_codec, chunk=chunk),
    )
