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
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradsync.compression._wire import accumulator_dtype, all_gather_mean
from gradsync.compression.base import BucketLike, Compressor, Layout, Stateless

DEFAULT_CHUNK = 64


@dataclass(slots=True)
class SignState:
    group: dist.ProcessGroup | None = None
    bytes_sent: int = 0
    chunk: int = DEFAULT_CHUNK
    sent: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        return {"chunk": self.chunk}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.chunk = int(state["chunk"])


def _bit_weights(device: torch.device) -> torch.Tensor:
    return torch.tensor([1, 2, 4, 8, 16, 32, 64, 128], dtype=torch.uint8, device=device)


def pack_signs(x: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``x`` -> (fp32 scale per chunk, sign bits packed eight to a byte)."""
    n = x.numel()
    pad = (-n) % chunk
    rows = F.pad(x.reshape(-1).float(), (0, pad)).view(-1, chunk)
    # Padding is zeros, so it adds nothing to the sum; divide by the real count per chunk.
    counts = torch.full((rows.shape[0],), float(chunk), device=rows.device)
    counts[-1] = chunk - pad
    scale = rows.abs().sum(dim=1) / counts
    bits = (rows >= 0).to(torch.uint8).view(-1, 8)
    packed = (bits * _bit_weights(rows.device)).sum(dim=1, dtype=torch.uint8)
    # Whole chunks are only needed for the scales; the bits stop at the last real byte.
    return scale, packed[: -(-n // 8)]


def unpack_signs(scale: torch.Tensor, packed: torch.Tensor, numel: int, chunk: int) -> torch.Tensor:
    bits = (packed[:, None] & _bit_weights(packed.device)) != 0
    signs = F.pad(bits.view(-1).float(), (0, scale.numel() * chunk - 8 * packed.numel()))
    signs = signs.view(-1, chunk).mul_(2.0).sub_(1.0).mul_(scale[:, None])
    return signs.view(-1)[:numel]


class SignCodec(Stateless):
    """``ceil(n / chunk)`` fp32 scales ``mean |x|``, then ``ceil(n / 8)`` bytes of sign bits."""

    __slots__ = ("acc", "chunk", "layout", "numel")

    def __init__(self, numel: int, chunk: int, acc: torch.dtype) -> None:
        self.numel, self.chunk, self.acc = numel, chunk, acc
        self.layout: Layout = ((torch.float32, -(-numel // chunk)), (torch.uint8, -(-numel // 8)))

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        scale, bits = pack_signs(x, self.chunk)
        return [scale, bits]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        return unpack_signs(parts[0], parts[1], self.numel, self.chunk).to(self.acc)

    def accumulate(self, parts: list[torch.Tensor], out: torch.Tensor, step: int) -> None:
        out.add_(unpack_signs(parts[0], parts[1], self.numel, self.chunk).to(out.dtype))


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
