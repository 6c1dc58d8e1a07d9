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
projection on the agreed subspace, whose mean over ranks is exactly ``P Q^T / W``; it is
recorded as its factors (:class:`Projection`), which the error-feedback wrapper subtracts from
the corrected gradient in place.

The products (``_lowrank``) are written in the layouts one-thread MKL runs fastest, which
makes ``powersgd:4`` step faster than DDP with torch's ``powerSGD_hook`` (BENCHMARKS.md).
The initial Q comes from a private generator seeded by ``(seed, bucket index)``, equal on all
ranks; if a bucket index's layout changes (DDP rebuilds buckets after its first step), Q restarts.

**The push codec** (:class:`PowerSGDCodec`, for parameter-server pushes) runs the same power
iteration, with the same helpers (:class:`Plan` and its factor views, :func:`compute_p`,
:func:`compute_q`, :func:`orthonormalize`), but in one shot: the worker computes P from its own
M and warm Q, orthonormalizes it, computes Q, and sends both P and Q with the uncompressed
elements in one message, so the server decodes ``P Q^T`` with no state of its own. The hook
cannot do that: its P must be the *sum over ranks* before it is orthonormalized, so that every
rank projects onto the same subspace and the mean of the ranks' ``P Q_r^T`` is exact. That
needs a collective between the two halves of the iteration, hence two all-reduce rounds (and a
Q shared by all ranks as the warm start). A push has one sender and no such agreement to reach,
so one message suffices; it also has no ``start_iter`` phase, whose plain steps would change
the payload size the server expects.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import torch

from gradsync import exit_safety
from gradsync.compression._lowrank import (
    compute_p,
    compute_q,
    orthonormalize,
    subtract_outer,
    write_outer,
)
from gradsync.compression._wire import (
    accumulator_dtype,
    all_reduce_async,
    derive_seed,
    generator,
    record_sent,
    world_and_rank,
)
from gradsync.compression.base import BucketLike, Compressor, Group, Layout
from gradsync.errors import UsageError
from gradsync.flat import views


@dataclass(slots=True)
class PowerSGDState:
    group: Group = None
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

    @property
    def p_numel(self) -> int:
        return sum(rows * rank for _, rows, _, rank in self.matrices)

    @property
    def q_numel(self) -> int:
        return sum(cols * rank for _, _, cols, rank in self.matrices)

    @property
    def plain_numel(self) -> int:
        return sum(b - a for a, b in self.plain)

    def matrix_views(self, flat: torch.Tensor) -> list[torch.Tensor]:
        """Each compressed matrix (rows x cols), as a view into the flat bucket."""
        return [flat[o : o + r * c].view(r, c) for o, r, c, _ in self.matrices]

    def p_views(self, p_flat: torch.Tensor) -> list[torch.Tensor]:
        """Each matrix's P factor (rows x rank), as views into ``p_flat`` (``p_numel`` long)."""
        return views(p_flat, [torch.Size((r, k)) for _, r, _, k in self.matrices])

    def q_views(self, q_flat: torch.Tensor) -> list[torch.Tensor]:
        """Each matrix's Q factor (cols x rank), as views into ``q_flat`` (``q_numel`` long)."""
        return views(q_flat, [torch.Size((c, k)) for _, _, c, k in self.matrices])


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


def _warm_q(
    state: PowerSGDState, index: int, plan: Plan, dtype: torch.dtype, device: torch.device
) -> list[torch.Tensor]:
    total = plan.q_numel
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
    qs = plan.q_views(q)
    if fresh:
        for v in qs:
            orthonormalize(v)
    return qs


def _plain_mean(state: PowerSGDState, bucket: BucketLike) -> torch.futures.Future[torch.Tensor]:
    buf = bucket.buffer()
    world, _ = world_and_rank(state.group)
    record_sent(state, bucket.index(), buf.to(accumulator_dtype(buf.dtype), copy=True))
    state.bytes_sent += buf.numel() * buf.element_size()
    work = all_reduce_async(buf, state.group)
    return exit_safety.then(work.get_future(), lambda fut: fut.value()[0].div_(world))


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
    mats = [m.to(acc) for m in plan.matrix_views(flat)]
    qs = _warm_q(state, index, plan, acc, buf.device)
    ps_flat = torch.empty(plan.p_numel, dtype=acc, device=buf.device)
    ps = plan.p_views(ps_flat)
    compute_p(mats, qs, ps)
    state.bytes_sent += ps_flat.numel() * ps_flat.element_size()
    # Waited here, not in a future callback: a collective issued from a callback starts on a
    # transport thread at a moment that differs per rank, so with two buckets in flight ranks
    # would issue collectives in different orders and gloo/NCCL would pair the wrong ones.
    p_work = all_reduce_async(ps_flat, state.group)
    p_work.wait()
    compute_q(mats, ps, qs)
    if state.sent is not None:
        # Q is overwritten by the summed Q when the exchange completes: keep this rank's.
        mine = Projection(plan, ps, plan.q_views(state.q[index].clone()))
        record_sent(state, index, mine)
    # The uncompressed elements ride with Q, so the blocking all-reduce above stays small.
    n_plain = plan.plain_numel
    second = torch.cat([flat[a:b].to(acc) for a, b in plan.plain] + [state.q[index]])
    state.bytes_sent += second.numel() * second.element_size()
    q_work = all_reduce_async(second, state.group)

    def finish(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
        reduced = fut.value()[0]
        state.q[index].copy_(reduced[n_plain:])  # the summed Q is next step's warm start
        write_mean(plan, flat, ps, qs, reduced[:n_plain], world)
        return buf

    return exit_safety.then(q_work.get_future(), finish)


def write_mean(
    plan: Plan,
    flat: torch.Tensor,
    ps: list[torch.Tensor],
    qs: list[torch.Tensor],
    plain_sum: torch.Tensor,
    world: int,
) -> None:
    """Write the mean into the bucket: ``P (Q / W)^T`` per matrix, the plain sums over W."""
    for view, p, q in zip(plan.matrix_views(flat), ps, qs, strict=True):
        # Dividing Q (cols x R) instead of the product saves a pass over the n x m result;
        # the matmul writes straight into the bucket where the dtypes allow.
        q_mean = q.div(world)
        if view.dtype == p.dtype:
            write_outer(view, p, q_mean)
        else:
            mean = torch.empty(view.shape, dtype=p.dtype, device=p.device)
            write_outer(mean, p, q_mean)
            view.copy_(mean)
    start = 0
    for a, b in plan.plain:
        flat[a:b].copy_(plain_sum[start : start + b - a].div(world))
        start += b - a


class Projection:
    """This rank's share ``P P^T M = P Q^T`` (Q = M^T P, before the sum), kept as factors.

    ``subtract_from`` turns the corrected gradient into the residual in place: ``M - P Q^T``
    per matrix (:func:`subtract_outer`) and zero, exactly, for what went uncompressed.
    Materializing ``P Q^T`` first, as a dense contribution, cost a copy of the bucket, a pass
    per matrix and one more to subtract it.
    """

    __slots__ = ("plan", "ps", "qs")

    def __init__(self, plan: Plan, ps: list[torch.Tensor], qs: list[torch.Tensor]) -> None:
        self.plan, self.ps, self.qs = plan, ps, qs

    def subtract_from(self, corrected: torch.Tensor) -> torch.Tensor:
        flat = corrected.view(-1)
        for view, p, q in zip(self.plan.matrix_views(flat), self.ps, self.qs, strict=True):
            subtract_outer(view, p, q)
        for a, b in self.plan.plain:
            flat[a:b].sub_(flat[a:b])  # sent as is: 0, or NaN where the input was not finite
        return corrected


class PowerSGDCodec:
    """Every matrix's P (rows x R), then its Q (cols x R), in the accumulator dtype, then the
    uncompressed elements in ``wire``: one local power iteration per encode, warm-started from
    the previous encode's Q, so the decode ``P Q^T`` is stateless (see the module docstring)."""

    __slots__ = ("acc", "layout", "numel", "plan", "q", "seed", "wire")

    def __init__(
        self, numel: int, plan: Plan, seed: int, wire: torch.dtype, acc: torch.dtype
    ) -> None:
        self.numel, self.plan, self.seed, self.wire, self.acc = numel, plan, seed, wire, acc
        #: every matrix's Q (cols x R), concatenated: the warm start of the next encode.
        self.q: torch.Tensor | None = None
        self.layout: Layout = ((acc, plan.p_numel), (acc, plan.q_numel), (wire, plan.plain_numel))

    def _warm_q(self, device: torch.device) -> list[torch.Tensor]:
        if self.q is None:
            gen = generator(self.seed, torch.device("cpu"))
            self.q = torch.randn(self.plan.q_numel, generator=gen, dtype=self.acc)
            for view in self.plan.q_views(self.q):
                orthonormalize(view)
        return self.plan.q_views(self.q.to(device))

    def encode(self, x: torch.Tensor, step: int) -> list[torch.Tensor]:
        warm = self._warm_q(x.device)
        p_flat = torch.empty(self.plan.p_numel, dtype=self.acc, device=x.device)
        q_flat = torch.empty(self.plan.q_numel, dtype=self.acc, device=x.device)
        ps, qs = self.plan.p_views(p_flat), self.plan.q_views(q_flat)
        mats = self.plan.matrix_views(x)
        compute_p(mats, warm, ps)
        compute_q(mats, ps, qs)
        # A new tensor, never written again: a state_dict taken earlier stays valid.
        self.q = q_flat
        plain = [x[a:b] for a, b in self.plan.plain]
        rest = torch.cat(plain).to(self.wire) if plain else x.new_empty(0, dtype=self.wire)
        return [p_flat, q_flat, rest]

    def decode(self, parts: list[torch.Tensor], step: int) -> torch.Tensor:
        p_flat, q_flat, rest = parts
        # Where the shapes cover every element (as push codecs check), each is written below:
        # no zero fill first.
        covered = sum(r * c for _, r, c, _ in self.plan.matrices) + self.plan.plain_numel
        make = torch.empty if covered == self.numel else torch.zeros
        out = make(self.numel, dtype=self.acc, device=p_flat.device)
        ps, qs = self.plan.p_views(p_flat), self.plan.q_views(q_flat)
        for view, p, q in zip(self.plan.matrix_views(out), ps, qs, strict=True):
            write_outer(view, p, q)
        start = 0
        for a, b in self.plan.plain:
            out[a:b] = rest[start : start + b - a]
            start += b - a
        return out

    def state_dict(self) -> dict[str, Any]:
        return {"q": self.q}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        q = state["q"]
        if q is not None and q.numel() != self.plan.q_numel:
            raise UsageError(
                f"the saved state has {q.numel()} Q elements, this codec's shapes need "
                f"{self.plan.q_numel}"
            )
        self.q = None if q is None else q.to(self.acc, copy=True)


def powersgd_codec(
    numel: int,
    dtype: torch.dtype,
    shapes: list[list[int]],
    stream: int,
    *,
    rank: int,
    min_compression_rate: float,
    seed: int,
) -> PowerSGDCodec:
    """``Compressor.codec`` for PowerSGD: the matrix-shaped entries of ``shapes`` go low-rank."""
    plan = plan_shapes(shapes, rank, min_compression_rate)
    return PowerSGDCodec(numel, plan, derive_seed(seed, stream), dtype, accumulator_dtype(dtype))


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
        codec=functools.partial(
            powersgd_codec, rank=rank, min_compression_rate=min_compression_rate, seed=seed
        ),
    )
