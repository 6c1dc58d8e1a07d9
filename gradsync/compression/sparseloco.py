"""``sparseloco``: sparse 2-bit pseudo-gradients with a decaying error-feedback accumulator.

What it does (SparseLoCo, Sarfi et al., 2025). At each outer synchronization of ``local:H`` or
``diloco:H`` each rank folds its pseudo-gradient ``d`` into an accumulator,
``e <- BETA * e + d``, keeps the ``k = ceil(DENSITY * CHUNK)`` largest magnitudes of each chunk
of CHUNK elements of ``e``, sends each as its position in the chunk and a 2-bit code, and
subtracts what it sent, as every rank decodes it, from ``e``. Every rank applies the mean of
the decoded sparse updates. The decayed accumulator stands in for DiLoCo's outer momentum (it
carries what was not sent, and with it the direction of earlier exchanges), so ``diloco:H``
takes its outer step without momentum when this compressor is set (plain SGD at its
``outer_lr``), and ``local:H``, which applies the mean as it is, is SparseLoCo with an outer
learning rate of 1. ``Compressor.replaces_momentum`` says so to the strategies; the other
strategies refuse it (``gradsync.strategies.factory.check_compressor``).

The 2-bit code is the sign and one of two magnitude levels of the chunk: the kept magnitudes of
a chunk are split at their mean, and each level is the mean of its side, so each side's decoded
magnitudes add up to its kept ones. A chunk sends its two levels as fp32. The last chunk may be
shorter and keeps ``ceil(DENSITY * length)``.

Bytes this rank hands to the collective: ``8 * ceil(n / CHUNK)`` for the levels, then one
record of ``ceil(log2 CHUNK) + 2`` bits per kept element (position and code), packed across
bytes: at the default ``0.02:4096`` 82 records of 14 bits a chunk, about 0.93% of fp32's bytes
(108x fewer). Payloads differ per rank, so they are all-gathered and decoded in rank order
(bitwise identical on every rank); each rank receives W - 1 payloads, which stays below an
fp32 all-reduce's traffic up to about 200 ranks.

Selection is the exact per-chunk top-k (the set of ``view(-1, CHUNK).abs().topk(k, dim=1)``, up
to ties), without running torch.topk over whole chunks, which costs about 14 ns an element on
one core (85 ms for 6M): a threshold per chunk from a fixed sample of 256 of its positions,
about three standard deviations below the k-th largest; the positions that reach it (one pass,
about 5% of the chunk); then torch.topk among those only, padded into a chunks x candidates
matrix. A chunk whose sample overestimated (fewer than k candidates) or that has more than
8k (many equal magnitudes, such as zeros) goes through torch.topk itself.

Why it is written here: torch's DDP communication hooks cover fp16/bf16 casts, PowerSGD and
per-tensor/per-channel quantization, and no maintained torch piece we know of does chunk-wise
top-k with low-bit values and a decaying accumulator; the paper's reference code
(github.com/one-covenant/SparseLoCo) is not a package gradsync could depend on, nor shaped as a
hook and codec that the periodic strategies and checkpoints can drive.

What it costs: one more copy of the model per rank (the accumulator, in the accumulator dtype),
beside the global copy the periodic strategies keep anyway; per exchange an encode of a few
passes over the pseudo-gradient and one decode per rank of its k records per chunk, slower
than topk's (about 2.7x on one core: docs/sparseloco.md, "Speed", which also has the spec,
defaults and limits).
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync.compression._wire import (
    BLOCK,
    accumulator_dtype,
    pack,
    split_chunks,
    unpack,
    world_and_rank,
)
from gradsync.compression.base import BucketLike, Compressor, Layout, Stateless
from gradsync.spec import SPARSELOCO_DEFAULTS, parse_compression_spec

DEFAULT_DENSITY, DEFAULT_CHUNK, DEFAULT_BETA = SPARSELOCO_DEFAULTS
#: the sign, and which of the chunk's two magnitude levels
CODE_BITS = 2
#: positions of a chunk sampled to set its threshold
SAMPLE = 256
#: a chunk with more candidates than this many times k (equal magnitudes) uses torch.topk
CROWDED = 8


def kept(density: float, length: int) -> int:
    """How many of a chunk's ``length`` elements are sent: at least one, at most all."""
    return min(length, max(1, math.ceil(density * length)))


def index_bits(chunk: int) -> int:
    """Bits of a position inside a chunk."""
    return max(1, (chunk - 1).bit_length())


# -- selection ---------------------------------------------------------------------------------


@functools.lru_cache(maxsize=16)
def _sample_columns(width: int, device: torch.device) -> torch.Tensor:
    # Fixed positions, the same on every call and rank, not a stride: a stride would alias
    # with a matrix's columns and sample one column of every chunk.
    gen = torch.Generator().manual_seed(width)
    return torch.randint(width, (SAMPLE,), generator=gen).sort().values.to(device)


def _torch_top_k(rows: torch.Tensor, k: int) -> torch.Tensor:
    return rows.abs().topk(k, dim=1, sorted=False).indices


def _reaching(rows: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """Flat positions, ascending, where ``|rows| >= threshold`` of their row."""
    count, width = rows.shape
    hit = torch.empty((count, width), dtype=torch.bool, device=rows.device)
    step = max(1, BLOCK // width)
    mag = torch.empty((min(count, step), width), dtype=rows.dtype, device=rows.device)
    for first in range(0, count, step):
        # |x| a block of chunks at a time into one reused buffer: no bucket-sized temporary.
        last = min(count, first + step)
        part = torch.abs(rows[first:last], out=mag[: last - first])
        torch.ge(part, threshold[first:last, None], out=hit[first:last])
    # nonzero over n bools costs as much as the passes above: find the 8-byte words with a hit
    # first (n/8 of them), then the hits inside those words only (as _select._reaching does).
    flat = hit.view(-1)
    if flat.numel() % 8:
        return flat.nonzero().squeeze(1)
    words = flat.view(torch.uint8).view(torch.int64)
    hot = words.nonzero().squeeze(1)
    inside = words[hot].view(torch.bool).nonzero().squeeze(1)
    return hot[inside >> 3] * 8 + (inside & 7)


def chunk_top_k(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Columns ``(chunks, k)`` of the ``k`` largest ``|rows|`` of each row (contiguous rows)."""
    count, width = rows.shape
    expected = k * SAMPLE / width
    rank = math.ceil(expected + 3 * math.sqrt(expected) + 2)
    if width < 4 * SAMPLE or 8 * k > width or rank >= SAMPLE:
        return _torch_top_k(rows, k)  # the sample would not thin the chunk out
    sample = rows[:, _sample_columns(width, rows.device)].abs_()
    threshold = sample.topk(rank, dim=1, sorted=False).values.amin(dim=1)
    pos = _reaching(rows, threshold)
    # The usual chunk is a power of two: a shift instead of an integer division.
    row = pos >> (width.bit_length() - 1) if width & (width - 1) == 0 else pos // width
    have = torch.bincount(row, minlength=count)
    fits = (have >= k) & (have <= CROWDED * k)
    misfits = (~fits).nonzero().squeeze(1)
    if misfits.numel() == count:
        return _torch_top_k(rows, k)
    cols = _top_among(rows, pos, row, have, fits if misfits.numel() else None, k)
    if misfits.numel():
        cols[misfits] = _torch_top_k(rows[misfits], k)
    return cols


def _top_among(
    rows: torch.Tensor,
    pos: torch.Tensor,
    row: torch.Tensor,
    have: torch.Tensor,
    fits: torch.Tensor | None,
    k: int,
) -> torch.Tensor:
    """Columns of the top k among each chunk's candidates (flat positions ``pos``, ascending,
    in chunks ``row``, ``have`` per chunk), laid side by side in a chunks x widest matrix padded
    with -1 (below any magnitude). Chunks not in ``fits`` (None: all fit) get columns the caller
    replaces."""
    count, width = rows.shape
    start = torch.cumsum(have, 0) - have
    slot = torch.arange(pos.numel(), device=rows.device) - start[row]
    widest = int(have.max() if fits is None else torch.where(fits, have, 0).max())
    target = row * widest + slot
    if fits is not None:
        # A misfit's candidates all land on one spare element past the matrix, never read.
        target = torch.where(fits[row], target, count * widest)
    mags = torch.full((count * widest + 1,), -1.0, dtype=rows.dtype, device=rows.device)
    mags[target] = rows.view(-1)[pos].abs()
    choice = mags[:-1].view(count, widest).topk(k, dim=1, sorted=False).indices
    flat = pos[(start[:, None] + choice).clamp_(max=pos.numel() - 1)]
    return flat - torch.arange(count, device=rows.device)[:, None] * width


# -- the 2-bit code and the records ------------------------------------------------------------


def levels(magnitudes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of kept magnitudes ``(chunks, k)``: the (low, high) levels ``(chunks, 2)`` and
    which magnitudes take the high one. The split is at the row's mean; each level is the mean
    of its side (a side left empty gets 0, and no magnitude uses it)."""
    high = magnitudes >= magnitudes.mean(dim=1, keepdim=True)
    n_high = high.sum(dim=1)
    zero = magnitudes.new_zeros(())
    s_high = torch.where(high, magnitudes, zero).sum(dim=1)
    s_low = torch.where(high, zero, magnitudes).sum(dim=1)
    k = magnitudes.shape[1]
    hi = s_high / n_high.clamp(min=1)
    lo = s_low / (k - n_high).clamp(min=1)
    return torch.stack([lo, hi], dim=1), high


def _record_bytes(
    count: int, width: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Where each of ``count`` records of ``width`` bits starts: (first byte, bit in it), and
    how many bytes one record can touch."""
    start = torch.arange(count, device=device) * width
    return start >> 3, start & 7, (width + 7 + 7) // 8


def pack_uint(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below ``2**width`` (at most 25 bits), back to back, lowest bit
    first, in ``ceil(count * width / 8)`` bytes (the last padded with zeros)."""
    count = values.numel()
    size = -(-count * width // 8)
    first, bit, span = _record_bytes(count, width, values.device)
    shifted = values.to(torch.int64) << bit
    out = torch.zeros(size + span, dtype=torch.int64, device=values.device)
    for i in range(span):
        # Records share bytes but never bits, so adding the byte pieces is OR-ing them.
        out.index_add_(0, first + i, (shifted >> (8 * i)) & 255)
    return out[:size].to(torch.uint8)


def unpack_uint(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` integers ``pack_uint`` packed, as int64."""
    first, bit, span = _record_bytes(count, width, packed.device)
    wide = torch.cat([packed, packed.new_zeros(span)]).to(torch.int64)
    word = wide[first]
    for i in range(1, span):
        word |= wide[first + i] << (8 * i)
    return (word >> bit) & ((1 << width) - 1)


def _encode_rows(rows: torch.Tensor, k: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks ``(count, width)`` -> (their levels ``(count, 2)``, one record per kept element:
    its column, then the sign bit, then the level bit)."""
    cols = chunk_top_k(rows, k)
    values = rows.gather(1, cols)
    lv, high = levels(values.abs())
    code = (values < 0).to(torch.int64) | (high.to(torch.int64) << 1)
    return lv, (cols | (code << bits)).view(-1)


class SparseLoCoCodec(Stateless):
    """fp32 (low, high) levels per chunk, then the packed records of the kept elements, chunk
    after chunk. Deterministic: the encode needs no random stream. The accumulator is the
    hook's (:class:`SparseLoCoState`), not the codec's: a codec encodes what it is given."""

    __slots__ = ("acc", "bits", "chunk", "k", "k_tail", "layout", "numel", "total")

    def __init__(self, numel: int, density: float, chunk: int, acc: torch.dtype) -> None:
        self.numel, self.chunk, self.acc = numel, chunk, acc
        self.bits = index_bits(chunk)
        self.k = kept(density, chunk)
        full, tail = divmod(numel, chunk)
        #: what the short last chunk keeps: never more than a whole chunk's k
        self.k_tail = kept(density, tail) if tail else 0
        self.total = full * self.k + self.k_tail
        record_bytes = -(-self.total * (self.bits + CODE_BITS) // 8)
        self.layout: Layout = ((torch.float32, 2 * -(-numel // chunk)), (torch.uint8, record_bytes))

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        del step
        rows, tail = split_chunks(x.reshape(-1), self.chunk)
        parts = [(x.new_empty(0), torch.empty(0, dtype=torch.int64, device=x.device))]
        if rows.shape[0]:
            parts.append(_encode_rows(rows, self.k, self.bits))
        if tail.numel():
            parts.append(_encode_rows(tail.view(1, -1), self.k_tail, self.bits))
        lv = torch.cat([p[0].reshape(-1) for p in parts]).to(torch.float32)
        records = torch.cat([p[1] for p in parts])
        return [lv, pack_uint(records, self.bits + CODE_BITS)]

    def entries(self, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(flat positions, decoded values in the accumulator dtype) of one payload's records."""
        lv, packed = parts
        records = unpack_uint(packed, self.bits + CODE_BITS, self.total)
        # Record j belongs to chunk j // k: the short last chunk keeps at most k.
        chunk_of = torch.arange(self.total, device=packed.device) // self.k
        code = records >> self.bits
        pos = chunk_of * self.chunk + (records & ((1 << self.bits) - 1))
        mag = lv.to(self.acc)[chunk_of * 2 + (code >> 1)]
        return pos, torch.where((code & 1).bool(), -mag, mag)

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=self.acc, device=parts[0].device)
        self.accumulate(parts, out, step)
        return out

    def accumulate(self, parts: list[torch.Tensor], out: torch.Tensor, step: int) -> None:
        del step
        # One payload's positions are distinct: index_add_ has no colliding adds.
        pos, values = self.entries(parts)
        out.index_add_(0, pos, values.to(out.dtype))


# -- the exchange ------------------------------------------------------------------------------


@dataclass(slots=True)
class SparseLoCoState:
    """Settings, bytes, and one accumulator per bucket index (a streaming fragment's own).

    No ``sent`` attribute: the accumulator is this compressor's own error feedback, so
    ``error_feedback(sparseloco())`` is refused rather than feeding back twice."""

    group: dist.ProcessGroup | None = None
    bytes_sent: int = 0
    density: float = DEFAULT_DENSITY
    chunk: int = DEFAULT_CHUNK
    beta: float = DEFAULT_BETA
    accumulators: dict[int, torch.Tensor] = field(default_factory=dict, repr=False)

    def state_dict(self) -> dict[str, Any]:
        # Copies: the hook updates its accumulators in place, and a checkpoint written in the
        # background must keep what they held when it was taken.
        saved = {i: acc.detach().clone() for i, acc in self.accumulators.items()}
        return {
            "density": self.density,
            "chunk": self.chunk,
            "beta": self.beta,
            "accumulators": saved,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.density = float(state["density"])
        self.chunk = int(state["chunk"])
        self.beta = float(state["beta"])
        self.accumulators = {int(i): acc.clone() for i, acc in state["accumulators"].items()}


def _fold(state: SparseLoCoState, index: int, flat: torch.Tensor) -> torch.Tensor:
    """``e <- BETA * e + d`` for bucket ``index``, in the accumulator dtype; a bucket seen for
    the first time, or whose size changed, starts from ``e = 0``."""
    dtype = accumulator_dtype(flat.dtype)
    acc = state.accumulators.get(index)
    if acc is None or acc.numel() != flat.numel():
        acc = flat.to(dtype, copy=True)
    else:
        acc = acc.to(device=flat.device, dtype=dtype).mul_(state.beta).add_(flat)
    state.accumulators[index] = acc
    return acc


def sparseloco_hook(
    state: SparseLoCoState, bucket: BucketLike
) -> torch.futures.Future[torch.Tensor]:
    """Fold the bucket into its accumulator, send the accumulator's sparse 2-bit encoding, take
    what was sent out of it; the future is the mean of every rank's decoded payload."""
    buf = bucket.buffer()
    flat = buf.reshape(-1)
    acc = _fold(state, bucket.index(), flat)
    codec = SparseLoCoCodec(flat.numel(), state.density, state.chunk, acc.dtype)
    payload = pack(codec.encode(acc, 0))
    state.bytes_sent += payload.numel()
    # Decoded from the bytes themselves, as every rank decodes them: what leaves e is exactly
    # what the others add, so nothing is lost or counted twice (beyond the decay).
    pos, sent = codec.entries(unpack(payload, codec.layout))
    acc.index_add_(0, pos, sent, alpha=-1)
    world, _ = world_and_rank(state.group)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    work = dist.all_gather(gathered, payload, group=state.group, async_op=True)
    assert work is not None

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.wait()
        total = torch.zeros(flat.numel(), dtype=acc.dtype, device=flat.device)
        for part in gathered:  # rank order on every rank: the same sum everywhere
            codec.accumulate(unpack(part, codec.layout), total, 0)
        return total.div_(world).to(buf.dtype).view_as(buf)

    return work.get_future().then(finish)


def sparseloco_codec(
    numel: int,
    dtype: torch.dtype,
    shapes: list[list[int]],
    stream: int,
    *,
    density: float,
    chunk: int,
) -> SparseLoCoCodec:
    """``Compressor.codec`` for sparseloco (no random stream; no accumulator: the strategies
    that take sparseloco exchange through the hook)."""
    del shapes, stream
    return SparseLoCoCodec(numel, density, chunk, accumulator_dtype(dtype))


def sparseloco(
    density: float = DEFAULT_DENSITY, chunk: int = DEFAULT_CHUNK, beta: float = DEFAULT_BETA
) -> Compressor:
    """The ``sparseloco:DENSITY:CHUNK:BETA`` compressor (its accumulator is its own error
    feedback: ``parse_compression`` adds no wrapper). Arguments are checked by the spec parser,
    so a bad one gets the message of the spec string that would carry it."""
    spec = parse_compression_spec(f"sparseloco:{density!r}:{chunk!r}:{beta!r}")
    assert isinstance(spec.argument, tuple), spec
    density, chunk, beta = spec.argument
    k = kept(density, chunk)
    per_chunk = 8 + -(-k * (index_bits(chunk) + CODE_BITS) // 8)
    # partial, not a closure, so a Compressor pickles into spawned workers.
    return Compressor(
        spec=str(spec),
        make_state=functools.partial(SparseLoCoState, density=density, chunk=chunk, beta=beta),
        hook=sparseloco_hook,
        nominal_ratio=per_chunk / (4 * chunk),
        codec=functools.partial(sparseloco_codec, density=density, chunk=chunk),
        replaces_momentum=True,
    )
