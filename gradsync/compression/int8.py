"""``int8``: per-chunk scaled 8-bit quantization with stochastic rounding, exchanged by all-gather.

Each chunk of ``chunk`` elements (default 1024) gets the scale ``s = max|x| / 127``; an element
becomes ``q = floor(x / s + u)`` with ``u ~ U[0, 1)``, so ``E[q * s] = x``: the estimate is
unbiased and its error per element is below one step ``s`` (variance at most ``s**2 / 4``).

The exchange is an all-gather of every rank's int8 payload plus its fp32 scales, decoded in rank
order. We chose it over an integer all-reduce with a shared scale because (a) an int8 sum of W
values overflows unless each rank keeps only ``127 / W`` levels (at 8 ranks, 4 bits of
precision), and widening to int16/int32 on the wire gives back most of the saving; (b) a shared
scale costs an extra max all-reduce round trip before the payload can leave; (c) per-rank scales
keep each rank's precision when one rank's gradient is much larger. The price: each rank
*receives* ``(W - 1) * n`` bytes, against about ``2 * 4n`` for an fp32 ring all-reduce, so int8
saves traffic up to about 8 ranks and is meant for few workers on slow links.

Bytes this rank hands to the collective: ``n + 4 * ceil(n / chunk)``.
Randomness: a private generator seeded from ``(seed, rank, bucket index, step)``, so runs are
reproducible, ranks round independently (their errors average out) and the user's RNG is untouched.

:class:`Int8Codec` is the encoding (``ceil(n / chunk)`` fp32 scales, then ``n`` int8 codes),
used by the hook for every rank's payload and by parameter-server pushes, whose rounding
stream is ``(derive_seed(seed, worker stream), step)`` instead.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gradsync.compression._wire import (
    accumulator_dtype,
    all_gather_mean,
    derive_seed,
    generator,
    world_and_rank,
)
from gradsync.compression.base import BucketLike, Compressor, Layout, Stateless

DEFAULT_CHUNK = 1024


@dataclass(slots=True)
class Int8State:
    group: dist.ProcessGroup | None = None
    bytes_sent: int = 0
    seed: int = 0
    chunk: int = DEFAULT_CHUNK
    #: calls per bucket index: the step part of the rounding seed.
    steps: dict[int, int] = field(default_factory=dict)
    sent: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "chunk": self.chunk, "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.seed = int(state["seed"])
        self.chunk = int(state["chunk"])
        self.steps = {int(k): int(v) for k, v in state["steps"].items()}


def quantize(
    x: torch.Tensor, chunk: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``x`` -> (fp32 scale per chunk, one int8 code per element)."""
    pad = (-x.numel()) % chunk
    flat = x.reshape(-1).float()
    # Only a ragged tail needs a padded copy; rows is never written to.
    rows = (F.pad(flat, (0, pad)) if pad else flat).view(-1, chunk)
    # max(max, -min) equals abs().amax() bit for bit, without a temporary as large as x:
    # on CPU it is about 7x faster (1.6 ms against 11 ms for 6M elements, 1 thread).
    scale = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg()) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    noise = torch.rand(rows.shape, generator=gen, device=rows.device, dtype=rows.dtype)
    # In place on one temporary (each fresh tensor of x's size costs page faults); the same
    # operations in the same order as floor(rows / s + noise), so the codes are unchanged.
    # The clamp only bites when fp rounding pushes |x/s| a hair past 127 (bias ~1e-7 * s).
    codes = (rows / safe[:, None]).add_(noise).floor_().clamp_(-127, 127).to(torch.int8)
    return scale, codes.view(-1)[: x.numel()]


def dequantize(scale: torch.Tensor, codes: torch.Tensor, chunk: int) -> torch.Tensor:
    pad = scale.numel() * chunk - codes.numel()
    values = codes.float()  # a fresh tensor: safe to scale in place
    rows = (F.pad(values, (0, pad)) if pad else values).view(-1, chunk).mul_(scale[:, None])
    return rows.view(-1)[: codes.numel()]


class Int8Codec(Stateless):
    """``ceil(n / chunk)`` fp32 scales, then ``n`` int8 codes (scales first: 4-byte aligned).

    The rounding noise of an encode comes from ``derive_seed(*key, step)``: the hook's key is
    ``(seed, rank, bucket index)``, a push's ``(derive_seed(seed, stream),)``. A decoder never
    needs the noise, so only the encoding side's key matters.
    """

    __slots__ = ("acc", "chunk", "key", "layout", "numel")

    def __init__(self, numel: int, chunk: int, key: tuple[int, ...], acc: torch.dtype) -> None:
        self.numel, self.chunk, self.key, self.acc = numel, chunk, key, acc
        self.layout: Layout = ((torch.float32, -(-numel // chunk)), (torch.int8, numel))

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        gen = generator(derive_seed(*self.key, step), x.device)
        scale, codes = quantize(x, self.chunk, gen)
        return [scale, codes]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        return dequantize(parts[0], parts[1], self.chunk).to(self.acc)

    def accumulate(self, parts: list[torch.Tensor], out: torch.Tensor, step: int) -> None:
        out.add_(dequantize(parts[0], parts[1], self.chunk).to(out.dtype))


def int8_hook(state: Int8State, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    """Mean over ranks via an async all-gather of int8 codes plus scales (one collective)."""
    buf = bucket.buffer()
    index = bucket.index()
    _, rank = world_and_rank(state.group)
    step = state.steps.get(index, 0)
    state.steps[index] = step + 1
    acc = accumulator_dtype(buf.dtype)
    codec = Int8Codec(buf.numel(), state.chunk, (state.seed, rank, index), acc)
    return all_gather_mean(state, bucket, codec, step)


def int8_codec(
    numel: int, dtype: torch.dtype, shapes: list[list[int]], stream: int, *, chunk: int, seed: int
) -> Int8Codec:
    """``Compressor.codec`` for int8: rounding noise from the caller's ``stream`` and ``seed``."""
    del shapes
    return Int8Codec(numel, chunk, (derive_seed(seed, stream),), accumulator_dtype(dtype))


def int8(chunk: int = DEFAULT_CHUNK, seed: int = 0) -> Compressor:
    """The ``int8`` compressor; ``chunk`` elements share one scale."""
    if chunk < 1:
        raise ValueError(f"int8 chunk must be >= 1, got {chunk}")

    # partial, not a closure, so a Compressor pickles into spawned workers.
    return Compressor(
        spec="int8",
        make_state=functools.partial(Int8State, seed=seed, chunk=chunk),
        hook=int8_hook,
        nominal_ratio=(1.0 + 4.0 / chunk) / 4.0,
        codec=functools.partial(int8_codec, chunk=chunk, seed=seed),
    )
