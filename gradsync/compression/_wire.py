"""Helpers shared by the compressors: byte packing, per-step seeds, and the all-gather exchange.

Compressors whose payloads cannot be summed on the wire (int8 with per-rank scales, sign bits,
top-k values with their indices) all-gather one byte payload per rank, packed from their
codec's pieces, and decode every rank's payload in rank order with the same codec. Decoding
in the same order on every rank is what makes the mean bitwise identical across ranks,
whatever the reduction order of the transport.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Protocol

import torch
import torch.distributed as dist

from gradsync import exit_safety
from gradsync.compression.base import BucketLike, Codec, Group, ReplicaExchange, Sent

_MASK64 = (1 << 64) - 1


class GatherCodec(Codec, Protocol):
    """A codec that can also add its decoded tensor into an accumulator.

    ``accumulate(parts, out, step)`` adds one rank's decoded contribution into ``out`` (flat,
    accumulator dtype). Adding rather than returning lets the all-gather path avoid one dense
    tensor per rank (top-k scatters k values instead of building n).
    """

    def accumulate(self, parts: list[torch.Tensor], out: torch.Tensor, step: int) -> None: ...


def world_and_rank(group: Group) -> tuple[int, int]:
    if isinstance(group, ReplicaExchange):
        return group.size(), group.rank()
    return dist.get_world_size(group), dist.get_rank(group)


def all_gather_async(outputs: list[torch.Tensor], tensor: torch.Tensor, group: Group) -> dist.Work:
    """``tensor`` of every rank of ``group`` into ``outputs``, started: its ``Work``."""
    if isinstance(group, ReplicaExchange):
        return group.all_gather(outputs, tensor)
    work = dist.all_gather(outputs, tensor, group=group, async_op=True)
    assert work is not None
    return work


def all_reduce_async(tensor: torch.Tensor, group: Group) -> dist.Work:
    """The sum of ``tensor`` over ``group``, in place, started: its ``Work``."""
    if isinstance(group, ReplicaExchange):
        return group.all_reduce_sum(tensor)
    work = dist.all_reduce(tensor, group=group, async_op=True)
    assert work is not None
    return work


def derive_seed(*parts: int) -> int:
    """A 63-bit seed from integers (base seed, bucket index, step, ...), splitmix64-style.

    Python's ``hash`` is salted per process for some types, so it cannot be shared by ranks.
    """
    h = 0x9E3779B97F4A7C15
    for part in parts:
        h = (h ^ (part & _MASK64)) & _MASK64
        h = (h * 0xBF58476D1CE4E5B9) & _MASK64
        h ^= h >> 31
        h = (h * 0x94D049BB133111EB) & _MASK64
        h ^= h >> 29
    return h & ((1 << 63) - 1)


def generator(seed: int, device: torch.device) -> torch.Generator:
    # A private generator: the user's global torch RNG stream is never touched.
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return gen


def accumulator_dtype(dtype: torch.dtype) -> torch.dtype:
    """Decode and sum in at least fp32, so an fp16 buffer does not lose the sum."""
    return torch.promote_types(dtype, torch.float32)


def to_payload(parts: Sequence[torch.Tensor]) -> torch.Tensor:
    """Concatenate tensors as raw bytes into one uint8 tensor: one collective, not several."""
    return torch.cat([p.contiguous().reshape(-1).view(torch.uint8) for p in parts])


def from_payload(
    payload: torch.Tensor, layout: Sequence[tuple[torch.dtype, int]]
) -> list[torch.Tensor]:
    """Split a uint8 payload back into ``(dtype, numel)`` pieces, in the order they were packed."""
    out, offset = [], 0
    for dtype, numel in layout:
        size = torch.empty((), dtype=dtype).element_size()
        piece = payload[offset : offset + numel * size]
        if (piece.storage_offset() % size) != 0:
            # view(dtype) needs an aligned start; copying costs O(piece) and only hits odd layouts.
            piece = piece.clone()
        out.append(piece.view(dtype))
        offset += numel * size
    return out


#: Elements per block for the codecs' multi-pass kernels (int8, sign, topk): each pass runs over
#: a block that stays in cache, not over the whole bucket, and no temporary is as large as the
#: bucket. A fresh 24 MB temporary costs 6,000 page faults each time: on a busy machine they
#: made int8's encode 1.5-2x slower than the same passes on reused memory.
BLOCK = 1 << 18
#: Device types whose codecs work a cache-sized block at a time. Elsewhere (a GPU) a bucket is
#: one block: there is no per-core cache to stay in, and every block costs kernel launches (on
#: an H200, int8's encode of 64M elements in 245 blocks took 26 ms, a copy of them 0.13 ms).
_CACHE_BLOCKED = {"cpu"}
_WHOLE = 1 << 62


def cache_blocked(device: torch.device | None) -> bool:
    """Whether codecs on ``device`` work a block at a time (None: the CPU)."""
    return device is None or device.type in _CACHE_BLOCKED


def block_elements(device: torch.device | None) -> int:
    """Elements per block on ``device``: ``BLOCK`` where cache-blocked, else all of them."""
    return BLOCK if cache_blocked(device) else _WHOLE


def blocks(
    numel: int, chunk: int = 1, device: torch.device | None = None
) -> Iterator[tuple[int, int]]:
    """``[start, stop)`` ranges covering ``numel`` elements, about ``block_elements(device)``
    long and starting on chunk boundaries (so only the last may end in a short chunk)."""
    step = max(chunk, block_elements(device) // chunk * chunk)
    for start in range(0, numel, step):
        yield start, min(numel, start + step)


def split_chunks(flat: torch.Tensor, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A flat tensor as (whole chunks, ``rows x chunk``; the ragged tail), both views.

    Codecs with a scale per chunk work on these two views instead of a zero-padded copy: a
    bucket is almost never a multiple of the chunk, and padding copies every byte of it.
    """
    full = flat.numel() - flat.numel() % chunk
    return flat[:full].view(-1, chunk), flat[full:]


def scale_chunks_(values: torch.Tensor, scale: torch.Tensor, chunk: int) -> torch.Tensor:
    """``values[i] *= scale[i // chunk]`` in place (flat ``values``); returns ``values``."""
    rows, tail = split_chunks(values, chunk)
    scale = scale.to(values.dtype)
    rows.mul_(scale[: rows.shape[0], None])
    if tail.numel():
        tail.mul_(scale[-1])
    return values


def add_scaled_chunks_(
    out: torch.Tensor, values: torch.Tensor, scale: torch.Tensor, chunk: int, sign: float = 1.0
) -> None:
    """``out[i] += sign * values[i] * scale[i // chunk]``, in one pass and without a temporary
    (``sign`` is 1 or -1, so it adds no rounding of its own).

    ``addcmul`` fuses the multiply and the add where the CPU can (one rounding instead of two),
    so the sum may differ from ``out.add_(values * scale)`` in its last bit; every rank decodes
    every payload with this same call (on a GPU, with the same compiled kernel instead:
    ``fused``), so the ranks still agree bit for bit.
    """
    out_rows, out_tail = split_chunks(out, chunk)
    rows, tail = split_chunks(values, chunk)
    scale = scale.to(out.dtype)
    out_rows.addcmul_(rows, scale[: rows.shape[0], None], value=sign)
    if tail.numel():
        out_tail.addcmul_(tail, scale[-1:], value=sign)


def record_sent(state: Any, index: int, contribution: Sent) -> None:
    """Keep this rank's decoded contribution when an error-feedback wrapper asked for it.

    ``state.sent`` is None unless a wrapper enabled it; the wrapper pops the entry once the
    exchange completes. The mean over ranks of the contributions is the hook's result.
    """
    sent = getattr(state, "sent", None)
    if sent is not None:
        sent[index] = contribution


def all_gather_mean(
    state: Any, bucket: BucketLike, codec: GatherCodec, step: int
) -> torch.futures.Future[torch.Tensor]:
    """Encode the bucket with ``codec``, all-gather the packed payload (async), decode every
    rank's in rank order, return the mean.

    One collective; the decode runs in the future's callback, so buckets still overlap. The
    mean is written into the bucket's buffer when that is a contiguous tensor of the
    accumulator dtype (the contract allows it, and it spares a bucket-sized allocation and the
    caller's copy back), else into a new tensor.

    Optional codec methods, used when present: ``contribution(parts, step)`` gives this rank's
    decoded contribution for error feedback in a cheaper form than a dense tensor (a
    ``base.Contribution``), and ``accumulate_all(parts_by_rank, out, step)`` adds every rank's
    payload in rank order, as ``accumulate`` per rank would, bit for bit (e.g. a block of
    ``out`` at a time for all ranks, while it is in cache).
    """
    buf = bucket.buffer()
    world, _ = world_and_rank(state.group)
    acc = accumulator_dtype(buf.dtype)
    payload = to_payload(codec.encode(buf.reshape(-1), step))
    state.bytes_sent += payload.numel() * payload.element_size()

    if getattr(state, "sent", None) is not None:
        contribution = getattr(codec, "contribution", None)
        if contribution is not None:
            record_sent(
                state, bucket.index(), contribution(from_payload(payload, codec.layout), step)
            )
        else:
            mine = torch.zeros(buf.numel(), dtype=acc, device=buf.device)
            codec.accumulate(from_payload(payload, codec.layout), mine, step)
            record_sent(state, bucket.index(), mine)
    gathered = [torch.empty_like(payload) for _ in range(world)]
    work = all_gather_async(gathered, payload, state.group)
    in_place = buf.dtype == acc and buf.is_contiguous()

    def finish(fut: torch.futures.Future[Any]) -> torch.Tensor:
        fut.wait()
        if in_place:
            total = buf.view(-1).zero_()
        else:
            total = torch.zeros(buf.numel(), dtype=acc, device=buf.device)
        parts = [from_payload(part, codec.layout) for part in gathered]
        accumulate_all = getattr(codec, "accumulate_all", None)
        if accumulate_all is not None:
            accumulate_all(parts, total, step)
        else:
            for one in parts:
                codec.accumulate(one, total, step)
        total.div_(world)
        return buf if in_place else total.to(buf.dtype).view_as(buf)

    return exit_safety.then(work.get_future(), finish)
