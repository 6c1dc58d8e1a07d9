"""``powersgd:R``: rank-R approximation of each matrix-shaped gradient (Vogels et al., 2019).

Per bucket and step, for each compressible n x m matrix M (a parameter with 2+ dimensions,
viewed as ``shape[0] x rest``) with warm-started Q (m x R, kept per bucket index):

1. ``P = M Q`` for every matrix; one all-reduce sums all the bucket's Ps. The hook **waits for
   it synchronously**: the second collective depends on it, and issuing that from a future
   callback would start it on a transport thread at a per-rank moment, so two buckets in
   flight could pair the wrong collectives across ranks.
2. Orthonormalize each summed P (QR), then ``Q = M^T P``; one **async** all-reduce sums the Qs
   together with the bucket's uncompressed elements (vectors, small matrices), and the
   future's callback writes the mean ``P Q^T / W``, so that part overlaps with backward.
3. The summed Q is kept as the next step's warm start.

A matrix is compressed only when that saves at least ``min_compression_rate`` (default 2x):
``n * m >= min_compression_rate * (n + m) * R``. For the first ``start_iter`` calls of a bucket
index, and for buckets with no compressible matrix, the hook is a plain all-reduce.

Bytes this rank hands to collectives per compressed step, in the accumulator dtype (fp32):
``4 * (u + sum (n_i + m_i) * R_i)`` where u counts uncompressed elements and ``R_i =
min(R, n_i, m_i)``. This rank's decoded share, for error feedback, is ``P P^T M``: its
projection on the agreed subspace, whose mean over ranks is exactly ``P Q^T / W``.
The initial Q comes from a private generator seeded by ``(seed, bucket index)``, equal on all
ranks; if a bucket index's layout changes (DDP rebuilds buckets after its first step), Q restarts.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from gradsync.compression._wire import (
    accumulator_dtype,
    derive_seed,
    generator,
    record_sent,
    world_and_rank,
)
from gradsync.compression.base import BucketLike, Compressor


@dataclass(slots=True)
class PowerSGDState:
    group: dist.ProcessGroup | None = None
    bytes_sent: int = 0
    matrix_rank: int = 1
    start_iter: int = 10
    min_compression_rate: float = 2.0
    seed: int = 0
    steps: dict[int, int] = field(default_factory=dict)
    #: per bucket index: every compressed matrix's summed Q, concatenated (the warm start).
    q: dict[int, torch.Tensor] = field(default_factory=dict)
    #: per bucket index: the parameter shapes Q was built for.
    layouts: dict[int, list[list[int]]] = field(default_factory=dict)
    sent: dict[int, torch.Tensor] | None = field(default=None, repr=False)

    def state_dict(self) -> dict[str, Any]:
        return {
            "matrix_rank": self.matrix_rank,
            "start_iter": self.start_iter,
            "min_compression_rate": self.min_compression_rate,
            "seed": self.seed,
            "steps": dict(self.steps),
            "q": dict(self.q),
            "layouts": {k: [list(s) for s in v] for k, v in self.layouts.items()},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.matrix_rank = int(state["matrix_rank"])
        self.start_iter = int(state["start_iter"])
        self.min_compression_rate = float(state["min_compression_rate"])
        self.seed = int(state["seed"])
        self.steps = {int(k): int(v) for k, v in state["steps"].items()}
        self.q = {int(k): v for k, v in state["q"].items()}
        self.layouts = {int(k): [list(s) for s in v] for k, v in state["layouts"].items()}


@dataclass(frozen=True, slots=True)
class Plan:
    """Where a bucket's matrices are: ``(offset, rows, cols, rank)``; the rest goes plain."""

    matrices: tuple[tuple[int, int, int, int], ...]
    plain: tuple[tuple[int, int], ...]
    layout: list[list[int]]


def plan_bucket(bucket: BucketLike, matrix_rank: int, min_rate: float) -> Plan:
    numel = bucket.buffer().numel()
    shapes = [list(p.shape) for p in bucket.parameters()]
    if sum(_prod(s) for s in shapes) != numel:
        shapes = [[numel]]  # parameters do not describe the buffer: treat it as one vector
    return plan_shapes(shapes, matrix_rank, min_rate)


def plan_shapes(shapes: list[list[int]], matrix_rank: int, min_rate: float) -> Plan:
    """Which of the flat, concatenated ``shapes`` go low-rank and which go plain (pure)."""
    matrices: list[tuple[int, int, int, int]] = []
    plain: list[tuple[int, int]] = []
    offset = 0
    for shape in shapes:
        size = _prod(shape)
        rows = shape[0] if len(shape) >= 2 else 0
        cols = size // rows if rows else 0
        rank = min(matrix_rank, rows, cols)
        if rank > 0 and rows * cols >= min_rate * (rows + cols) * rank:
            matrices.append((offset, rows, cols, rank))
        elif plain and plain[-1][1] == offset:
            plain[-1] = (plain[-1][0], offset + size)
        elif size:
            plain.append((offset, offset + size))
        offset += size
    return Plan(tuple(matrices), tuple(plain), shapes)


def _prod(shape: list[int]) -> int:
    out = 1
    for d in shape:
        out *= d
    return out


def _orthonormalize(p: torch.Tensor) -> None:
    p.copy_(torch.linalg.qr(p).Q)


def _warm_q(
    state: PowerSGDState, index: int, plan: Plan, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    total = sum(cols * rank for _, _, cols, rank in plan.matrices)
    q = state.q.get(index)
    fresh = q is None or q.numel() != total or state.layouts.get(index) != plan.layout
    if fresh:
        # Same seed on every rank: P = M Q is only summable if all ranks use the same Q.
        gen = generator(derive_seed(state.seed, index), torch.device("cpu"))
        q = torch.randn(total, generator=gen)
        state.layouts[index] = plan.layout
    assert q is not None
    q = q.to(device=device, dtype=dtype)
    state.q[index] = q
    views = _factor_views(q, [(cols, rank) for _, _, cols, rank in plan.matrices])
    if fresh:
        for v in views:
            _orthonormalize(v)
    return views


def _plain_mean(state: PowerSGDState, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    world, _ = world_and_rank(state.group)
    record_sent(state, bucket.index(), buf.to(accumulator_dtype(buf.dtype), copy=True))
    state.bytes_sent += buf.numel() * buf.element_size()
    work = dist.all_reduce(buf, group=state.group, async_op=True)
    assert work is not None
    return work.get_future().then(lambda fut: fut.value()[0].div_(world))


def powersgd_hook(state: PowerSGDState, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    """Mean over ranks: low-rank for the bucket's matrices, exact for everything else."""
    buf, index = bucket.buffer(), bucket.index()
    step = state.steps.get(index, 0)
    state.steps[index] = step + 1
    plan = plan_bucket(bucket, state.matrix_rank, state.min_compression_rate)
    if step < state.start_iter or not plan.matrices:
        return _plain_mean(state, bucket)
    world, _ = world_and_rank(state.group)
    acc = accumulator_dtype(buf.dtype)
    flat = buf.reshape(-1)
    mats = [flat[o : o + r * c].view(r, c).to(acc) for o, r, c, _ in plan.matrices]
    qs = _warm_q(state, index, plan, acc, buf.device)
    ps_flat = torch.empty(sum(r * k for _, r, _, k in plan.matrices), dtype=acc, device=buf.device)
    ps = _factor_views(ps_flat, [(r, k) for _, r, _, k in plan.matrices])
    for m, q, p in zip(mats, qs, ps, strict=True):
        torch.matmul(m, q, out=p)
    state.bytes_sent += ps_flat.numel() * ps_flat.element_size()
    # Waited here, not in a future callback: a collective issued from a callback starts on a
    # transport thread at a moment that differs per rank, so with two buckets in flight ranks
    # would issue collectives in different orders and gloo/NCCL would pair the wrong ones.
    p_work = dist.all_reduce(ps_flat, group=state.group, async_op=True)
    assert p_work is not None
    p_work.wait()
    for p, m, q in zip(ps, mats, qs, strict=True):
        _orthonormalize(p)
        torch.matmul(m.t(), p, out=q)
    if state.sent is not None:
        mine = flat.to(acc, copy=True)
        for (o, r, c, _), p, q in zip(plan.matrices, ps, qs, strict=True):
            mine[o : o + r * c].view(r, c).copy_(p @ q.t())
        record_sent(state, index, mine)
    # The uncompressed elements ride with Q, so the blocking all-reduce above stays small.
    n_plain = sum(b - a for a, b in plan.plain)
    second = torch.cat([flat[a:b].to(acc) for a, b in plan.plain] + [state.q[index]])
    state.bytes_sent += second.numel() * second.element_size()
    q_work = dist.all_reduce(second, group=state.group, async_op=True)
    assert q_work is not None

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0]
        state.q[index].copy_(reduced[n_plain:])  # the summed Q is next step's warm start
        for (o, r, c, _), p, q in zip(plan.matrices, ps, qs, strict=True):
            flat[o : o + r * c].view(r, c).copy_(torch.mm(p, q.t()).div_(world))
        start = 0
        for a, b in plan.plain:
            flat[a:b].copy_(reduced[start : start + b - a].div(world))
            start += b - a
        return buf

    return q_work.get_future().then(finish)


def _factor_views(flat: torch.Tensor, shapes: list[tuple[int, int]]) -> list[torch.Tensor]:
    out, offset = [], 0
    for rows, cols in shapes:
        out.append(flat[offset : offset + rows * cols].view(rows, cols))
        offset += rows * cols
    return out


def powersgd(
    rank: int, start_iter: int = 10, min_compression_rate: float = 2.0, seed: int = 0
) -> Compressor:
    """PowerSGD without error feedback (``parse_compression("powersgd:R")`` adds it)."""
    if rank < 1:
        raise ValueError(f"powersgd rank must be >= 1, got {rank}")
    if start_iter < 0:
        raise ValueError(f"powersgd start_iter must be >= 0, got {start_iter}")
    return Compressor(
        spec=f"powersgd:{rank}",
        make_state=functools.partial(
            PowerSGDState,
            matrix_rank=rank,
            start_iter=start_iter,
            min_compression_rate=min_compression_rate,
            seed=seed,
        ),
        hook=powersgd_hook,
        nominal_ratio=None,
    )
