"""``int8``: per-chunk scaled 8-bit quantization with stochastic rounding, exchanged by all-gather.

Each chunk of ``chunk`` elements (default 1024) gets the scale ``s = max|x| / 127``; an element
becomes ``q = floor(x / s + u)`` with ``u`` uniform on ``[0, 1)``, drawn with 16 random bits,
so ``E[q * s] = x`` to within ``2**-16 * s``: the estimate is unbiased to that resolution and its
error per element is below one step ``s`` (variance at most ``s**2 / 4``).

The noise comes from a table, not one draw per element (:class:`RoundingNoise`): each encode
draws a fresh table of ``NOISE_TABLE = 2**16`` values (all of them, fully independent, for a
payload no larger), and each piece of up to ``2**16`` elements adds a cyclic window of it that
starts at a random offset, negated with probability 1/2. Drawing a value per element was 2/3 of
the encode's time (about 6.5 of 10 ms for 6M elements, one core); with the table the noise is
about 1/4 of a 4.7 ms encode (no noise at all: 3.6 ms, measured side by side). What holds
per element is unchanged: its ``u`` is uniform on the ``2**16`` midpoints (the table's values
are, and the set is symmetric, so negation keeps it), so every element is unbiased as above, and
the noise is fresh at every step, rank and bucket. What changes: within one encode the noise
values are not all independent. Elements of one piece get distinct table entries (independent);
two elements of different pieces share one table entry with probability ``2**-16`` (each element
shares its entry with exactly one element of every other whole piece, a random one, with a random
relative sign). Pairs are random, not tied to positions (no stride at which noise repeats, as
one table added at the same offset everywhere would have: element ``i`` and ``i + 2**16`` paired
every step), and the sign makes a shared entry's correlation average out over partners whose
fractions ``frac(x / s)`` are spread: the variance of the sum of all ``2**20`` rounding errors of
a gradient-like bucket measured 0.166 per element against 0.147 with a draw per element and 1.37
with offsets but no sign (300 encodes). Elements whose fractions are all alike (a near-constant
tensor) keep part of the correlation, at most 1/2 between two that share an entry (sign averaged):
the sum of the errors of ``m`` of them can have up to about ``1 + m / 2**17`` times the variance
of independent rounding (none under ``2**16`` elements; measured 7.7x for ``2**20`` elements all
at fraction 0.1, 0.9x at 1/2). This is within one rank's one encode: ranks and steps draw
independent tables, so the all-reduced mean is unbiased as before, each element's error is
independent across ranks and steps, and no element's error exceeds one step.

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
The noise table and each piece's offset and sign are all drawn from it: the same key and step give
the same codes.

On a GPU the encode and decode are compiled kernels (``fused.int8_encode``): the same format
and guarantees, with each element's noise hashed from the seed and its index instead of drawn
from the generator and the table, so the codes differ from this path's.

:class:`Int8Codec` is the encoding (``ceil(n / chunk)`` fp32 scales, then ``n`` int8 codes),
used by the hook for every rank's payload and by parameter-server pushes, whose rounding
stream is ``(derive_seed(seed, worker stream), step)`` instead.
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
    cache_blocked,
    derive_seed,
    generator,
    scale_chunks_,
    split_chunks,
    world_and_rank,
)
from gradsync.compression.base import BucketLike, Compressor, Group, Layout, Stateless

DEFAULT_CHUNK = 1024


@dataclass(slots=True)
class Int8State:
    group: Group = None
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


#: random bits of rounding noise per element; see :func:`rounding_noise`.
NOISE_BITS = 16
#: rounding-noise values drawn per encode, the longest piece that adds one window of them; see
#: :class:`RoundingNoise`.
NOISE_TABLE = 1 << 16


def rounding_noise(
    numel: int, gen: torch.Generator, device: torch.device, out: torch.Tensor | None = None
) -> torch.Tensor:
    """``numel`` independent values ``r + 1/2``, ``r`` uniform on the integers in
    ``[-2**15, 2**15)``, as fp32 (into ``out`` if given): the midpoints of ``2**16`` equal
    steps, symmetric about 0.

    16 bits per element, cut from full-range 64-bit draws: the generator is the cost of the
    encode (one 32-bit draw per element, as ``torch.rand`` makes, took 60% of it on one core),
    and 16 bits already resolve the rounding probability to ``2**-16`` of a step, close to
    the resolution fp32 itself has for ``x / s`` near 127 (``2**-17``). :func:`quantize` draws
    only a table of these (:class:`RoundingNoise`), not one per element.
    """
    words = torch.empty(-(-numel // 4), dtype=torch.int64, device=device)
    # The whole int64 range: random_() alone leaves the top bit clear (one lane in four biased).
    words.random_(-(2**63), 2**63 - 1, generator=gen)
    if out is None:
        out = torch.empty(numel, dtype=torch.float32, device=device)
    out.copy_(words.view(torch.int16)[:numel])
    # r + 1/2 is exact in fp32; a separate pass, as int16 + 0.5 in one op is 8x slower.
    return out.add_(0.5)


class RoundingNoise:
    """The rounding noise of one encode of ``numel`` elements in ``blocks(numel, chunk)``,
    added to the blocks in order by :meth:`add_` (values ``(r + 1/2) / 2**16``, as
    :func:`rounding_noise`'s scaled to a step).

    One table of ``size = min(numel, NOISE_TABLE)`` values from :func:`rounding_noise`, then,
    only where ``numel > size``, one draw per piece (each block cut into pieces of ``size``
    elements, the last one shorter): a uniform offset into the table and a sign. A piece gets
    ``sign * table[(offset + j) % size]`` at its ``j``-th element; the table is stored twice
    over, so that window is one contiguous slice and the add one pass that reads it from cache
    (no noise buffer as large as the block). A payload of ``size`` elements or fewer gets the
    table as it is: one independent value per element, the stream earlier versions drew.
    Why a table and what it costs in independence: the module docstring.
    """

    __slots__ = ("draws", "size", "table")

    def __init__(self, numel: int, chunk: int, gen: torch.Generator, device: torch.device) -> None:
        # On a device without cache blocking, one fresh value per element: the generator is
        # cheap there, and per-piece adds are launches.
        self.size = min(numel, NOISE_TABLE) if cache_blocked(device) else numel
        table = rounding_noise(self.size, gen, device).mul_(2.0**-NOISE_BITS)
        self.table = torch.cat([table, table]) if numel > self.size else table
        pieces = sum(
            -(-(stop - start) // self.size) for start, stop in blocks(numel, chunk, device)
        )
        if numel > self.size:
            # One draw per piece: offset = d % size, negated where d >= size.
            drawn = torch.randint(0, 2 * self.size, (pieces,), generator=gen, device=device)
            self.draws = drawn.tolist()
        else:
            self.draws = [0] * pieces
        self.draws.reverse()  # consumed from the end

    def add_(self, v: torch.Tensor) -> torch.Tensor:
        """Add the next block's noise to flat ``v`` (that block's length) in place."""
        for start in range(0, v.numel(), self.size):
            piece = v[start : start + self.size]
            draw = self.draws.pop()
            offset = draw % self.size
            window = self.table[offset : offset + piece.numel()]
            piece.add_(window, alpha=-1.0 if draw >= self.size else 1.0)
        return v


def chunk_absmax(flat: torch.Tensor, chunk: int) -> torch.Tensor:
    """``max |x|`` per chunk of flat ``x`` (the last chunk may be short)."""
    rows, tail = split_chunks(flat, chunk)
    # max(max, -min) equals abs().amax() bit for bit, without a temporary as large as x:
    # on CPU it is about 7x faster (1.6 ms against 11 ms for 6M elements, 1 thread).
    out = torch.maximum(rows.amax(dim=1), rows.amin(dim=1).neg())
    if tail.numel():
        out = torch.cat([out, torch.maximum(tail.amax(), tail.amin().neg()).view(1)])
    return out


def quantize(
    x: torch.Tensor, chunk: int, gen: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Flat ``x`` -> (fp32 scale per chunk, one int8 code per element).

    ``q = round(x / s + (r + 1/2) / 2**16)`` (``rounding_noise``, up to sign) is
    ``floor(x / s + u)`` with ``u`` uniform on the midpoints ``(j + 1/2) / 2**16`` of
    ``[0, 1)``: rounded up with probability ``frac(x / s)`` to within ``2**-16`` (unbiased to
    that resolution; fp32's own rounding of ``x / s`` near 127 is ``2**-17``), and
    ``|q - x / s| < 1``. ``round`` folds the ``+ 1/2`` and the floor into one pass; its ties
    (to even) need ``frac(x / s)`` to be an odd multiple of ``2**-17``, and then move the
    probability by at most ``2**-16``. Each element's ``r`` is uniform and fresh per ``gen``;
    above ``2**16`` elements some pairs share one (:class:`RoundingNoise`).
    """
    flat = x.reshape(-1).float()
    scale = chunk_absmax(flat, chunk) / 127.0
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.empty(flat.numel(), dtype=torch.int8, device=flat.device)
    noise = RoundingNoise(flat.numel(), chunk, gen, flat.device)
    # Block by block, on one reused block-sized buffer: four passes over data in cache.
    v_block = torch.empty(
        min(flat.numel(), block_elements(flat.device) + chunk), device=flat.device
    )
    for start, stop in blocks(flat.numel(), chunk, flat.device):
        v = v_block[: stop - start]
        rows, tail = split_chunks(flat[start:stop], chunk)
        v_rows, v_tail = split_chunks(v, chunk)
        first = start // chunk
        torch.div(rows, safe[first : first + rows.shape[0], None], out=v_rows)
        if tail.numel():
            torch.div(tail, safe[-1], out=v_tail)
        noise.add_(v)
        # The clamp only bites when fp rounding pushes |x/s| a hair past 127 (bias ~1e-7 * s).
        codes[start:stop].copy_(v.round_().clamp_(-127, 127))
    return scale, codes


def dequantize(
    scale: torch.Tensor, codes: torch.Tensor, chunk: int, dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    """``codes * scale`` per chunk, as a new tensor of ``dtype``."""
    return scale_chunks_(codes.to(dtype), scale, chunk)


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
        seed = derive_seed(*self.key, step)
        got = None
        if fused.on_device(x):
            # Noise hashed from the seed in the kernel (fused module docstring): same format.
            words = fused.seed_words(seed, x.device)
            got = fused.INT8_ENCODE.run(x, self.chunk, *words)
        scale, codes = quantize(x, self.chunk, generator(seed, x.device)) if got is None else got
        return [scale, codes]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        got = fused.INT8_DECODE.run_on(parts[1], parts[1], parts[0], self.chunk, self.acc)
        if got is not None:
            return got
        return dequantize(parts[0], parts[1], self.chunk, self.acc)

    def accumulate(self, parts: list[torch.Tensor], out: torch.Tensor, step: int) -> None:
        scale, codes = parts
        decoded = (codes, scale, self.chunk, out.dtype)
        if fused.on_device(out) and fused.accumulate(fused.INT8_DECODE, out, 1.0, *decoded):
            return
        for start, stop in blocks(self.numel, self.chunk, out.device):
            # Widened a block at a time: no temporary as large as the bucket.
            first, last = start // self.chunk, -(-stop // self.chunk)
            values = codes[start:stop].to(out.dtype)
            add_scaled_chunks_(out[start:stop], values, scale[first:last], self.chunk)


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
