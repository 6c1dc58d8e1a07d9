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

Selection is the exact per-chunk top-k (the set of ``view(-1, CHUNK).abs().topk(k, dim=1)``;
on the CPU ties at the k-th magnitude go to the lowest positions), and a chunk's records go in
ascending position order. torch.topk over whole chunks costs about 14 ns an element on one core
(85 ms for 6M) and torch's compare and nonzero 1 to 4 ns, so on the CPU the selection runs in
numpy on the floats' bits read as integers (with the sign bit cleared they order as the
magnitudes do), a block of chunks at a time so that the passes after the first read cache: the
maxima of the chunk's groups of 16 strided elements, whose k-th largest is a threshold at least
k elements reach (about 1.2k on pseudo-gradients); the positions that reach it; the exact k-th
largest among those (numpy's partition of a chunks x candidates matrix). A chunk with more than
8k candidates (many equal magnitudes, such as zeros) is partitioned whole. On other devices
torch.topk selects, ties as it breaks them.

Why it is written here: torch's DDP communication hooks cover fp16/bf16 casts, PowerSGD and
per-tensor/per-channel quantization, and no maintained torch piece we know of does chunk-wise
top-k with low-bit values and a decaying accumulator; the paper's reference code
(github.com/one-covenant/SparseLoCo) is not a package gradsync could depend on, nor shaped as a
hook and codec that the periodic strategies and checkpoints can drive.

What it costs: one more copy of the model per rank (the accumulator, in the accumulator dtype),
beside the global copy the periodic strategies keep anyway; per exchange an encode of a few
passes over the pseudo-gradient and one decode per rank of its k records per chunk, together
about as fast as topk's on one core (docs/sparseloco.md, "Speed", which also has the spec,
defaults and limits).
"""

from __future__ import annotations

import functools
import math
import sys
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from gradsync import exit_safety
from gradsync.compression._wire import (
    BLOCK,
    accumulator_dtype,
    all_gather_async,
    from_payload,
    split_chunks,
    to_payload,
    world_and_rank,
)
from gradsync.compression.base import BucketLike, Compressor, Group, Layout, Stateless
from gradsync.spec import SPARSELOCO_DEFAULTS, parse_compression_spec

DEFAULT_DENSITY, DEFAULT_CHUNK, DEFAULT_BETA = SPARSELOCO_DEFAULTS
#: the sign, and which of the chunk's two magnitude levels
CODE_BITS = 2


def kept(density: float, length: int) -> int:
    """How many of a chunk's ``length`` elements are sent: at least one, at most all."""
    return min(length, max(1, math.ceil(density * length)))


def index_bits(chunk: int) -> int:
    """Bits of a position inside a chunk."""
    return max(1, (chunk - 1).bit_length())


# -- selection ---------------------------------------------------------------------------------

#: the integer type a float's bits are read as: with the sign bit cleared, a float's bits order
#: as its magnitude does (NaN above inf, where torch.topk ranks it too)
_BITS = {
    torch.float64: torch.int64,
    torch.float32: torch.int32,
    torch.float16: torch.int16,
    torch.bfloat16: torch.int16,
}
#: elements per group, longest first, whose maxima give a chunk's threshold (_group_length)
GROUP_LENGTHS = (16, 8, 4, 2)
#: a chunk with more candidates than this many times k (equal magnitudes, such as zeros) has
#: its k-th largest found over the whole chunk instead of among its candidates
CROWDED = 8


def _group_length(width: int, k: int) -> int:
    """Elements per group when a chunk of ``width`` is cut into groups: the longest that divides
    it into at least 2k groups, or 1 (each element its own group) where none does."""
    for length in GROUP_LENGTHS:
        if width % length == 0 and width // length >= 2 * k:
            return length
    return 1


def _torch_select(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`_select` off the CPU: torch.topk, quick on a GPU, ties as it breaks them."""
    cols = rows.abs().topk(k, dim=1, sorted=False).indices.sort(dim=1).values
    return cols, rows.gather(1, cols)


def _candidates(bits: np.ndarray, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Of chunks ``bits`` (a float matrix's bits as integers): the flat positions, ascending,
    whose magnitude reaches the chunk's threshold, their bits, and the thresholds.

    The threshold is the k-th largest of the chunk's group maxima (groups of
    ``_group_length`` elements at a stride): k groups reach it, so at least k elements do, and
    on pseudo-gradients about 1.2k (97 for k = 82 of 4096). With groups of one it is the k-th
    largest magnitude itself."""
    count, width = bits.shape
    length = _group_length(width, k)
    groups = width // length
    magnitude = np.iinfo(bits.dtype).max  # every bit but the sign
    step = max(1, BLOCK // width)
    mags = np.empty((min(step, count), width), dtype=bits.dtype)
    hit = np.empty(mags.shape, dtype=np.bool_)
    thresholds = np.empty(count, dtype=bits.dtype)
    positions, found_bits = [], []
    for first in range(0, count, step):
        # A block of chunks at a time through buffers that stay in cache: the passes after the
        # first read cache, not memory.
        last = min(count, first + step)
        mag = np.bitwise_and(bits[first:last], magnitude, out=mags[: last - first])
        tops = mag if length == 1 else mag.reshape(last - first, length, groups).max(axis=1)
        cut = np.partition(tops, groups - k, axis=1)[:, groups - k]
        thresholds[first:last] = cut
        found = _flat_nonzero(np.greater_equal(mag, cut[:, None], out=hit[: last - first]))
        positions.append(found + first * width)
        found_bits.append(bits[first:last].reshape(-1)[found])
    return np.concatenate(positions), np.concatenate(found_bits), thresholds


def _flat_nonzero(hit: np.ndarray) -> np.ndarray:
    """``np.flatnonzero`` of a sparse bool matrix, quicker: numpy pays about 25 ns a hit below
    10% density and 1 ns an element above, so find the 8-byte words with a hit first (about
    18% of them here), then the hits in those words only (about 14%)."""
    flat = hit.reshape(-1)
    if flat.size % 8:
        return np.flatnonzero(flat)
    words = flat.view(np.uint64)
    hot = np.flatnonzero(words != 0)
    inside = np.flatnonzero(words[hot].view(np.bool_))
    return (hot[inside >> 3] << 3) | (inside & 7)


def _kth_largest(
    bits: np.ndarray, row: np.ndarray, starts: np.ndarray, mags: np.ndarray, k: int
) -> np.ndarray:
    """Per chunk, the k-th largest magnitude, from its candidates (chunk ``row``, the chunk's
    first at ``starts``, magnitudes ``mags``; at least k each) laid side by side in a chunks x
    widest matrix padded with -1, below any magnitude. A crowded chunk is partitioned whole."""
    count, width = bits.shape
    have = np.diff(starts)
    kth = np.empty(count, dtype=bits.dtype)
    crowded = have > CROWDED * k
    if crowded.any():
        whole = np.bitwise_and(bits[crowded], np.iinfo(bits.dtype).max)
        kth[crowded] = np.partition(whole, width - k, axis=1)[:, width - k]
        fits = ~crowded[row]
        row, mags, have = row[fits], mags[fits], np.where(crowded, 0, have)
        starts = np.cumsum(have) - have
    widest = int(have.max())
    if widest:
        table = np.full((count, widest), -1, dtype=bits.dtype)
        # Candidate i of chunk r (i counted from the chunk's first) goes to column i of row r.
        offset = np.arange(count) * widest - starts[:count]
        table.reshape(-1)[np.arange(row.size) + offset[row]] = mags
        kth[~crowded] = np.partition(table, widest - k, axis=1)[~crowded, widest - k]
    return kth


def _keep(row: np.ndarray, mags: np.ndarray, kth: np.ndarray, k: int) -> np.ndarray:
    """Indices of the candidates (ascending positions, chunk ``row``) that are sent: those above
    their chunk's k-th largest magnitude, then of those equal to it the lowest positions, k per
    chunk."""
    cut = kth[row]
    keep = mags >= cut
    if np.count_nonzero(keep) > kth.size * k:  # ties at the k-th magnitude somewhere
        tied = mags == cut
        room = k - np.bincount(row[keep & ~tied], minlength=kth.size)
        tied_at = np.flatnonzero(tied)
        tied_row = row[tied_at]
        # Rows ascend: a tie's rank in its chunk is its index past the chunk's first tie.
        rank = np.arange(tied_at.size) - np.searchsorted(tied_row, tied_row)
        keep[tied_at[rank >= room[tied_row]]] = False
    return np.flatnonzero(keep)


def _select(rows: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Columns ``(chunks, k)``, ascending, of the k largest ``|rows|`` of each row, and the
    values there. On the CPU ties at the k-th magnitude go to the lowest columns; elsewhere
    torch.topk picks (:func:`_torch_select`: the same set up to ties)."""
    count, width = rows.shape
    if rows.device.type != "cpu" or rows.dtype not in _BITS:
        return _torch_select(rows, k)
    bits = rows.detach().contiguous().view(_BITS[rows.dtype]).numpy()
    pos, found, thresholds = _candidates(bits, k)
    power_of_two = width & (width - 1) == 0  # the usual chunk: shifts and masks, no division
    if pos.size != count * k:  # more than k reached a threshold somewhere
        row = pos >> (width.bit_length() - 1) if power_of_two else pos // width
        # Positions ascend: each chunk's candidates are the run between two of these.
        starts = np.searchsorted(pos, np.arange(count + 1) * width)
        mags = np.bitwise_and(found, np.iinfo(bits.dtype).max)
        exact = _group_length(width, k) == 1
        kth = thresholds if exact else _kth_largest(bits, row, starts, mags, k)
        keep = _keep(row, mags, kth, k)
        pos, found = np.take(pos, keep), np.take(found, keep)
    cols = pos & (width - 1) if power_of_two else pos % width
    values = torch.from_numpy(found.reshape(count, k)).view(rows.dtype)
    return torch.from_numpy(cols.reshape(count, k)), values


def chunk_top_k(rows: torch.Tensor, k: int) -> torch.Tensor:
    """Columns ``(chunks, k)``, ascending, of the ``k`` largest ``|rows|`` of each row: the set
    of ``rows.abs().topk(k, dim=1)`` up to ties."""
    return _select(rows, k)[0]


# -- the 2-bit code and the records ------------------------------------------------------------


def levels(magnitudes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of kept magnitudes ``(chunks, k)``: the (low, high) levels ``(chunks, 2)`` and
    which magnitudes take the high one. The split is at the row's mean; each level is the mean
    of its side (a side left empty gets 0, and no magnitude uses it)."""
    high = magnitudes >= magnitudes.mean(dim=1, keepdim=True)
    n_high = high.sum(dim=1)
    # Each side's sum over the magnitudes with the other side's cleared to +0.0, as
    # torch.where(high, m, 0) gives them bit for bit, by masking their bits (torch.where costs
    # 6 ns an element on the CPU, the masks under 1).
    bits = magnitudes.view(_BITS[magnitudes.dtype])
    ones = high.to(bits.dtype).neg_()  # every bit set where high
    s_high = (bits & ones).view(magnitudes.dtype).sum(dim=1)
    s_low = (bits & ones.bitwise_not_()).view(magnitudes.dtype).sum(dim=1)
    k = magnitudes.shape[1]
    hi = s_high / n_high.clamp(min=1)
    lo = s_low / (k - n_high).clamp(min=1)
    return torch.stack([lo, hi], dim=1), high


#: bits of a 64-bit lane
LANE = 64
_LITTLE = sys.byteorder == "little"


def _group(width: int) -> tuple[int, int, list[tuple[int, int, int]]]:
    """Records of ``width`` bits per group, the group's bytes, and each record's (index, lane,
    first bit): the fewest records that fill whole bytes (4 of 14 bits fill 7 bytes, in one
    lane), laid in int64 lanes; a record past its lane's last bit goes on in the next."""
    per_group = 8 // math.gcd(width, 8)
    places = [(r, r * width // LANE, r * width % LANE) for r in range(per_group)]
    return per_group, per_group * width // 8, places


def _as_bytes(lanes: torch.Tensor) -> torch.Tensor:
    """int64 lanes ``(groups, L)`` as their bytes ``(groups, 8L)``, least significant first."""
    out = lanes.view(torch.uint8).view(lanes.shape[0], -1, 8)
    return (out if _LITTLE else out.flip(-1)).reshape(lanes.shape[0], -1)


def pack_uint(values: torch.Tensor, width: int) -> torch.Tensor:
    """Non-negative integers below ``2**width`` (at most 25 bits), back to back, lowest bit
    first, in ``ceil(count * width / 8)`` bytes (the last padded with zeros)."""
    count = values.numel()
    per_group, group_bytes, places = _group(width)
    groups = -(-count // per_group)
    # A group of records at a time, built in int64 lanes with one shift and one OR per record
    # (two where a record straddles lanes), not a pass per bit or byte.
    records = values.new_zeros(groups * per_group, dtype=torch.int64)
    records[:count] = values
    records = records.view(groups, per_group)
    lanes = values.new_zeros((groups, -(-group_bytes // 8)), dtype=torch.int64)
    for r, lane, bit in places:
        lanes[:, lane] |= records[:, r] << bit
        if bit + width > LANE:
            lanes[:, lane + 1] |= records[:, r] >> (LANE - bit)
    return _as_bytes(lanes)[:, :group_bytes].reshape(-1)[: -(-count * width // 8)]


def unpack_uint(packed: torch.Tensor, width: int, count: int) -> torch.Tensor:
    """The ``count`` integers ``pack_uint`` packed, as int64."""
    per_group, group_bytes, places = _group(width)
    groups = -(-count // per_group)
    padded = packed.new_zeros(groups * group_bytes)
    padded[: packed.numel()] = packed
    grouped = packed.new_zeros((groups, -(-group_bytes // 8) * 8))
    grouped[:, :group_bytes] = padded.view(groups, group_bytes)
    if not _LITTLE:
        grouped = grouped.view(groups, -1, 8).flip(-1).reshape(groups, -1)
    words = grouped.view(torch.int64)
    out = torch.empty((groups, per_group), dtype=torch.int64, device=packed.device)
    for r, lane, bit in places:
        record = torch.bitwise_right_shift(words[:, lane], bit, out=out[:, r])
        if bit + width > LANE:
            # The shift above is arithmetic: clear what it copied of the sign before the rest.
            record &= (1 << (LANE - bit)) - 1
            record |= words[:, lane + 1] << (LANE - bit)
    return out.view(-1)[:count] & ((1 << width) - 1)


def _encode_rows(rows: torch.Tensor, k: int, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunks ``(count, width)`` -> (their levels ``(count, 2)``, one record per kept element:
    its column, then the sign bit, then the level bit)."""
    cols, values = _select(rows, k)
    lv, high = levels(values.abs())
    # The fields' bits do not overlap: adding them is OR-ing them, in two ops instead of six.
    records = torch.add(cols, values < 0, alpha=1 << bits).add_(high, alpha=1 << (bits + 1))
    return lv, records.view(-1)


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
        chunk_of = self._chunk_of(packed.device)
        code = records >> self.bits
        pos = records.bitwise_and_((1 << self.bits) - 1).add_(chunk_of, alpha=self.chunk)
        # The four values a chunk's codes decode to, in code order (sign bit, then level bit):
        # one lookup per record instead of a level lookup and a sign flip.
        low, high = lv.to(self.acc).view(-1, 2).unbind(1)
        table = torch.stack([low, -low, high, -high], dim=1).view(-1)
        return pos, table.index_select(0, code.add_(chunk_of, alpha=4))

    def _chunk_of(self, device: torch.device) -> torch.Tensor:
        """Each record's chunk: record j is in chunk j // k (the short last chunk keeps at most
        k), written row by row instead of divided."""
        full = self.numel // self.chunk
        out = torch.empty(self.total, dtype=torch.int64, device=device)
        out[: full * self.k].view(full, self.k).copy_(
            torch.arange(full, device=device)[:, None].expand(full, self.k)
        )
        out[full * self.k :] = full
        return out

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        out = torch.zeros(self.numel, dtype=self.acc, device=parts[0].device)
        self.accumulate(parts, out, step)
        return out

    def accumulate(self, parts: list[torch.Tensor], out: torch.Tensor, step: int) -> None:
        del step
        # One payload's positions are distinct: no two adds land on one element (scatter_add_
        # is quicker than index_add_ on the CPU, and adds the same).
        pos, values = self.entries(parts)
        out.scatter_add_(0, pos, values.to(out.dtype))


# -- the exchange ------------------------------------------------------------------------------


@dataclass(slots=True)
class SparseLoCoState:
    """Settings, bytes, and one accumulator per bucket index (a streaming fragment's own).

    No ``sent`` attribute: the accumulator is this compressor's own error feedback, so
    ``error_feedback(sparseloco())`` is refused rather than feeding back twice."""

    group: Group = None
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
    payload = to_payload(codec.encode(acc, 0))
    state.bytes_sent += payload.numel()
    # Decoded from the bytes themselves, as every rank decodes them: what leaves e is exactly
    # what the others add, so nothing is lost or counted twice (beyond the decay).
    pos, sent = codec.entries(from_payload(payload, codec.layout))
    acc.index_add_(0, pos, sent, alpha=-1)
    world, _ = world_and_rank(state.group)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    work = all_gather_async(gathered, payload, state.group)

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.wait()
        total = torch.zeros(flat.numel(), dtype=acc.dtype, device=flat.device)
        for part in gathered:  # rank order on every rank: the same sum everywhere
            codec.accumulate(from_payload(part, codec.layout), total, 0)
        return total.div_(world).to(buf.dtype).view_as(buf)

    return exit_safety.then(work.get_future(), finish)


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
