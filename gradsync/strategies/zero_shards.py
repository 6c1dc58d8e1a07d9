"""What ``zero:1`` and ``zero:2`` share: which rank owns which parameter, the flat buffers laid
out by owner, and the sharded update (the user's optimizer on the owned tensors, then one
all-gather of the updated parameters).

Ownership is by whole tensor, balanced by size: largest first, each to the least loaded rank
(``ps_wire.shard_by_size``, the rule the parameter servers use and the one torch's
``ZeroRedundancyOptimizer`` uses). A whole tensor keeps every per-tensor optimizer rule exact
(AdamW's moments, momentum, weight decay), so the user's optimizer can step a shard unchanged;
shards are uneven by up to one tensor, and a model needs at least one tensor per rank.

The update is the user's optimizer itself, stepped with the ``.grad`` of every tensor this rank
does not own set to None: torch's optimizers skip such a parameter entirely (no step, no weight
decay, no state; the documented meaning of a None gradient, see ``Optimizer.zero_grad``) and
create a parameter's state at its first step, so each rank's optimizer holds the state of its
own shard only. The user's param groups, hyper-parameters and schedulers (lr or any other)
act on the step unchanged, the GradScaler steps it as usual, and the per-rank checkpoint files,
which already hold each rank's ``optimizer.state_dict()``, hold each rank's shard. An optimizer
whose step reads every parameter together (LBFGS's closure, a norm over all tensors) would see
only the shard: such optimizers do not fit ZeRO at all.

Each stage lays its tensors out as flat buffers of ``world`` equal chunks, one per (dtype,
device): rank r's tensors from ``r * chunk`` (from the last registered, the order backward
usually finishes them), padded with zeros to the largest shard. That layout is never
allocated whole (issue 47: a kept buffer of one copy of the parameters' bytes made the peak
of ``zero:1`` no lower than ``bsp``'s). The exchanges go in rounds (``plan_rounds``): each
round carries the same slice of every owner's chunk, half a gradient bucket in all, through
one of two round buffers kept between steps (allocating a fresh buffer each time cost more
than a copy into a kept one on the benchmark's machine), so that one round is on the wire
while the next is packed: a rank's exchange buffers are one bucket, whatever the model's size.
A round keeps every element at the chunk index it had in the whole layout, so a ring sums it
in the same order and the results are bitwise those of one whole-buffer exchange. The
parameters never alias the buffers (the gathered tensors are copied out), so overwriting
them at the next round changes nothing the user holds.

How the buffers travel depends on the backend (``choose_exchange``): NCCL (and any backend but
gloo) takes the flat collectives, an in-place ``all_gather_into_tensor`` per round and, under
``zero:2``, a ``reduce_scatter_tensor`` per round. Gloo's versions of those are slow on CPU: for the
benchmark's 76 MB on 2 ranks the flat all-gather took 168-200 ms where one broadcast from each
rank of its own chunk took 31-44 ms (the same bytes), and the reduce-scatter 187-220 ms where an
all-reduce took 91-100 ms and a ring of send/receive pairs 69 ms. So on gloo the parameters
come back by one broadcast per owner and round, straight into a round buffer, and the
gradient goes by that ring (``ring_reduce_scatter``): each rank sends (N - 1)/N of the
gradient, as a reduce-scatter does (an all-reduce would send twice that), and receives into its
own shard's buffer only.
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

import torch
import torch.distributed as dist
from torch.overrides import TorchFunctionMode

from gradsync import compat, runtime
from gradsync.checks.guards import nonfinite_flag
from gradsync.errors import UsageError
from gradsync.row_shards import ROWS, WHOLE, join_whole, layout_of
from gradsync.spec import default_bucket_mb
from gradsync.strategies.base import (
    StepOutcome,
    SyncContext,
    reading_own_state,
    step_verdict,
    wait_each,
)
from gradsync.strategies.ps_wire import shard_by_size
from gradsync.telemetry.records import Span

T = TypeVar("T")

# torch 2.13 renamed the flat collectives (the old names warn); torch >= 2.4 has the old ones.
all_gather_flat: Any = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
reduce_scatter_flat: Any = (
    getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
)

#: the ways of carrying the stages' buffers: broadcasts and a send/receive ring (gloo's fast
#: path), or the flat all-gather and reduce-scatter (NCCL's natural one)
POINT_TO_POINT, COLLECTIVE = "point-to-point", "collective"
EXCHANGES = ("auto", POINT_TO_POINT, COLLECTIVE)


def check_exchange(exchange: str) -> str:
    if exchange not in EXCHANGES:
        raise ValueError(f"exchange must be one of {', '.join(EXCHANGES)}; got {exchange!r}")
    return exchange


def gloo_carries(backend: str, device_type: str) -> bool:
    """Whether gloo carries tensors of ``device_type`` over a group whose backend is
    ``backend`` (as ``dist.get_backend`` names it: ``"gloo"``, ``"nccl"``,
    ``"cpu:gloo,cuda:nccl"``)."""
    if ":" in backend:
        per_device = dict(part.split(":", 1) for part in backend.split(","))
        backend = per_device.get(device_type, "")
    return backend.strip().lower() == "gloo"


def choose_exchange(backend: str, device_type: str) -> str:
    """How to carry tensors of ``device_type`` over a group whose backend is ``backend``: point
    to point where gloo carries them, the flat collectives everywhere else."""
    return POINT_TO_POINT if gloo_carries(backend, device_type) else COLLECTIVE


def _peer(group: dist.ProcessGroup | None, rank: int) -> int:
    """``rank`` of ``group`` as the point-to-point calls name it (the default group's rank)."""
    return rank if group is None else dist.get_global_rank(group, rank)


def ring_reduce_scatter(
    received: torch.Tensor,
    send: torch.Tensor,
    rank: int,
    world: int,
    group: Any = None,
    timeout_s: float | None = None,
) -> None:
    """Sum ``send`` (``world`` chunks, one per rank) over the ranks so that ``received`` gets
    the sum of chunk ``rank``: ``world - 1`` rounds in which each rank passes a partial sum to
    the next and adds the one it receives into ``send`` (which it overwrites). ``received``
    doubles as the landing place of every round, so nothing else is allocated. ``timeout_s``
    bounds each wait (``wait_each``)."""
    chunk = received.numel()

    def part(r: int) -> torch.Tensor:
        return send[r * chunk : (r + 1) * chunk]

    if world == 1:
        received.copy_(part(0))
        return
    if send.device.type != "cpu" and gloo_carries(str(dist.get_backend(group)), send.device.type):
        # gloo's send and receive read and write host memory only (given a CUDA tensor they
        # fail with "Bad address"), while its broadcasts and all-reduces copy device tensors
        # through the host themselves: do the same here.
        on_host = torch.empty(received.shape, dtype=received.dtype)
        ring_reduce_scatter(on_host, send.cpu(), rank, world, group, timeout_s)
        received.copy_(on_host)
        return
    right, left = _peer(group, (rank + 1) % world), _peer(group, (rank - 1) % world)
    for s in range(world - 1):
        # round s passes on chunk rank-s-1 (summed over s+1 ranks so far) and receives chunk
        # rank-s-2 from the left; the last round's is this rank's own chunk
        ops = [
            dist.P2POp(dist.isend, part((rank - s - 1) % world), right, group),
            dist.P2POp(dist.irecv, received, left, group),
        ]
        wait_each(dist.batch_isend_irecv(ops), timeout_s)
        if s < world - 2:
            part((rank - s - 2) % world).add_(received)
    received.add_(part(rank))


@dataclass(frozen=True, slots=True)
class FlatGroup:
    """The parameters of one dtype and device, laid out by owner in ``world`` chunks of
    ``chunk`` elements; ``offsets[i]`` is where ``params[i]`` starts in the whole buffer."""

    params: tuple[torch.Tensor, ...]
    owners: tuple[int, ...]
    offsets: tuple[int, ...]
    #: elements of each rank's tensors (its chunk holds ``chunk - loads[r]`` of padding)
    loads: tuple[int, ...]
    chunk: int
    world: int
    #: per rank: the stretches of its chunk that hold no tensor (``[start, stop)`` in the
    #: chunk), zeroed before a collective carries them: the tail past ``loads[r]``, and under
    #: the rows layout (``zero_rows``) the slots of the pieces shorter than their slot
    gaps: tuple[tuple[tuple[int, int], ...], ...] = ()

    def empty(self, chunks: int) -> torch.Tensor:
        return self.buffer(chunks * self.chunk)

    def buffer(self, numel: int) -> torch.Tensor:
        p = self.params[0]
        return torch.empty(numel, dtype=p.dtype, device=p.device)

    def view(self, flat: torch.Tensor, i: int, base: int = 0) -> torch.Tensor:
        """``params[i]``'s place in ``flat``, a buffer that starts at element ``base``."""
        p = self.params[i]
        start = self.offsets[i] - base
        return flat[start : start + p.numel()].view_as(p)

    def owned(self, rank: int) -> list[int]:
        return [i for i, o in enumerate(self.owners) if o == rank]

    def zero_padding(self, flat: torch.Tensor, ranks: Sequence[int], base: int = 0) -> None:
        """Zero the padding of ``ranks``' chunks in ``flat`` (which starts at element ``base``),
        so that what a collective carries there is deterministic."""
        for r in ranks:
            for start, stop in self.gaps[r]:
                flat[r * self.chunk + start - base : r * self.chunk + stop - base].zero_()


def _flat_groups(params: list[torch.Tensor], owners: list[int], world: int) -> list[FlatGroup]:
    kinds: dict[tuple[torch.dtype, torch.device], list[int]] = {}
    for i, p in enumerate(params):
        kinds.setdefault((p.dtype, p.device), []).append(i)
    groups = []
    for members in kinds.values():
        # Each owner's tensors in the order backward usually finishes them (the last
        # registered first), so that ``zero:2``'s first rounds hold the gradients that are
        # ready first and can go, and free them, while backward goes on.
        members.sort(key=lambda i: (owners[i], -i))
        load = [0] * world
        for i in members:
            load[owners[i]] += params[i].numel()
        chunk = max(load)
        offsets, filled = [], [r * chunk for r in range(world)]
        for i in members:
            offsets.append(filled[owners[i]])
            filled[owners[i]] += params[i].numel()
        groups.append(
            FlatGroup(
                params=tuple(params[i] for i in members),
                owners=tuple(owners[i] for i in members),
                offsets=tuple(offsets),
                loads=tuple(load),
                chunk=chunk,
                world=world,
                gaps=tuple(((n, chunk),) if n < chunk else () for n in load),
            )
        )
    return groups


@dataclass(frozen=True, slots=True)
class Piece:
    """The part of ``params[index]`` (of a flat group) that one round carries: its elements
    ``start`` to ``start + length``, at ``at`` in its owner's part of the round."""

    index: int
    start: int
    length: int
    at: int


@dataclass(frozen=True, slots=True)
class Round:
    """One bucket-sized exchange of a flat group: elements ``lo`` to ``lo + size`` of every
    owner's chunk, laid out in a round buffer of ``world * size`` elements (owner r's part at
    ``r * size``); ``pieces[r]``: the tensors of owner r that part holds, or parts of them."""

    lo: int
    size: int
    pieces: tuple[tuple[Piece, ...], ...]

    def members(self) -> set[int]:
        return {pc.index for owner in self.pieces for pc in owner}


def plan_rounds(group: FlatGroup, per_owner: int) -> list[Round]:
    """``group``'s chunks cut into rounds of ``per_owner`` elements of each owner's chunk: the
    exchanges that replace one of the whole flat buffer. A tensor may straddle rounds. Each
    round puts every owner's elements at the same chunk index as the whole buffer did, so a
    ring sums every element in the same order, and the result is bitwise the same."""
    per_owner = max(1, per_owner)
    streams: list[list[tuple[int, int, int]]] = [[] for _ in range(group.world)]
    for i, (o, off) in enumerate(zip(group.owners, group.offsets, strict=True)):
        streams[o].append((i, off - o * group.chunk, group.params[i].numel()))
    rounds = []
    cursor = [0] * group.world  # per owner: its first tensor not wholly before this round
    for lo in range(0, group.chunk, per_owner):
        size = min(per_owner, group.chunk - lo)
        pieces = []
        for r, stream in enumerate(streams):
            mine = []
            k = cursor[r]
            while k < len(stream) and stream[k][1] < lo + size:
                i, a, n = stream[k]
                first, last = max(a, lo), min(a + n, lo + size)
                if first < last:
                    mine.append(Piece(i, first - a, last - first, first - lo))
                if a + n <= lo + size:
                    cursor[r] = k + 1
                k += 1
            pieces.append(tuple(mine))
        rounds.append(Round(lo, size, tuple(pieces)))
    return rounds


def _flat_view(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in order: a view when contiguous (parameters and their gradients
    nearly always are), else a copy, good for reading only."""
    return t.view(-1) if t.is_contiguous() else t.reshape(-1)


@dataclass(frozen=True, slots=True)
class Tail:
    """A tensor's elements from ``start`` on, flat: what ``zero:2`` keeps of a finished
    gradient whose last rounds wait for another owner's later gradient, in place of the whole
    gradient (``ZeroStage2._keep_tails``)."""

    start: int
    flat: torch.Tensor


def pack_round(
    buf: torch.Tensor,
    group: FlatGroup,
    rnd: Round,
    owners: Iterable[int],
    source: Callable[[int], torch.Tensor | Tail | None],
    scale: float | None = None,
) -> None:
    """Fill ``owners``' parts of round buffer ``buf`` from ``source(index)`` (a tensor of the
    group's ``params[index]`` shape, or a ``Tail`` of one that holds every element the round
    takes; None: zeros), times ``scale`` when given, and zero their padding, so that what a
    collective carries there is deterministic."""
    for r in owners:
        part = buf[r * rnd.size : (r + 1) * rnd.size]
        for pc in rnd.pieces[r]:
            dst = part[pc.at : pc.at + pc.length]
            t = source(pc.index)
            if t is None:
                dst.zero_()
                continue
            if isinstance(t, Tail):
                src = t.flat[pc.start - t.start : pc.start - t.start + pc.length]
            else:
                src = _flat_view(t)[pc.start : pc.start + pc.length]
            if scale is None:
                dst.copy_(src)
            else:
                torch.mul(src, scale, out=dst)
        for start, stop in group.gaps[r]:
            first, last = max(start, rnd.lo), min(stop, rnd.lo + rnd.size)
            if first < last:
                part[first - rnd.lo : last - rnd.lo].zero_()


def unpack_round(buf: torch.Tensor, group: FlatGroup, rnd: Round, owner: int) -> None:
    """Copy ``owner``'s part of round buffer ``buf`` into its parameters."""
    part = buf[owner * rnd.size : (owner + 1) * rnd.size]
    for pc in rnd.pieces[owner]:
        p = group.params[pc.index]
        src = part[pc.at : pc.at + pc.length]
        if p.is_contiguous():
            p.view(-1)[pc.start : pc.start + pc.length].copy_(src)
        else:
            whole = p.reshape(-1).clone()
            whole[pc.start : pc.start + pc.length].copy_(src)
            p.copy_(whole.view(p.shape))


class Layout(Protocol):
    """Which rank steps which elements, and the flat groups that carry them: whole tensors by
    owner (``OwnerLayout``) or every tensor's rows (``zero_rows.RowLayout``)."""

    kind: str
    world: int
    rank: int
    #: the units each rank steps (whole tensors, or pieces of rows) and their owners
    params: list[torch.Tensor]
    owners: list[int]
    mine: list[torch.Tensor]
    others: list[torch.Tensor]
    groups: list[FlatGroup]

    def check(self, updated: Sequence[torch.Tensor], name: str) -> None: ...

    def numel(self, rank: int) -> int: ...

    def grads_for_step(self, full_grads: bool) -> AbstractContextManager[None]: ...

    def state_record(self) -> dict[str, Any]: ...

    def close(self) -> None: ...

    def source(self, unit: torch.Tensor) -> torch.Tensor: ...

    def part(self, p: torch.Tensor) -> torch.Tensor | None: ...

    def join(self, parts: Sequence[dict[str, Any]]) -> dict[str, Any]: ...

    def part_of(
        self, whole: dict[str, Any], optimizer: torch.optim.Optimizer
    ) -> dict[str, Any]: ...


def round_elements(ctx: SyncContext, layout: Layout) -> int:
    """Elements of each owner's chunk one round carries: half the gradient bucket
    (``bucket_mb``, or the default plan for this model, as under ``bsp``) split over the
    ranks, so that the two round buffers together are one bucket, whatever the model's size."""
    total = sum(p.numel() * p.element_size() for p in layout.params)
    mb = ctx.bucket_mb if isinstance(ctx.bucket_mb, int | float) else None
    if mb is None:
        mb = default_bucket_mb(total / 1e6)
    size = max(p.element_size() for p in layout.params)
    # half a bucket a round: two rounds are in flight, so the two kept buffers make one bucket
    return max(1, int(mb * 1e6) // (2 * size * layout.world))


class OwnerLayout:
    """Who owns which trainable parameter (the same on every rank), and the flat groups."""

    kind = WHOLE

    def __init__(self, params: Sequence[torch.Tensor], world: int, rank: int) -> None:
        self.params = list(params)
        #: the parameters the units are of: the units themselves
        self.reals = self.params
        self.world, self.rank = world, rank
        self.owners = [0] * len(self.params)
        for owner, shard in enumerate(shard_by_size([p.numel() for p in self.params], world)):
            for i in shard:
                self.owners[i] = owner
        self.mine = [p for p, o in zip(self.params, self.owners, strict=True) if o == rank]
        self.others = [p for p, o in zip(self.params, self.owners, strict=True) if o != rank]
        self._mine_ids = {id(p) for p in self.mine}
        self.groups = _flat_groups(self.params, self.owners, world)

    def check(self, updated: Sequence[torch.Tensor], name: str) -> None:
        """``UsageError`` unless every rank owns one of the tensors the optimizer ``updated``
        (a rank without one would have nothing to step, and a GradScaler nothing to check)."""
        ids = {id(p) for p in updated}
        stepped = [id(p) in ids for p in self.params]
        for r in range(self.world):
            if not any(s and o == r for s, o in zip(stepped, self.owners, strict=True)):
                raise UsageError(
                    f"{name} gives each rank whole parameter tensors to update, but with "
                    f"{self.world} ranks rank {r} would get none of those the optimizer "
                    f"updates (the model has {len(self.params)} trainable tensor(s), "
                    f"{sum(stepped)} of them in the optimizer's param groups): run {name} on "
                    f"at most {sum(stepped)} rank(s), or use bsp"
                )

    def numel(self, rank: int) -> int:
        """Elements of the parameters ``rank`` owns (its share of the optimizer state)."""
        return sum(p.numel() for p, o in zip(self.params, self.owners, strict=True) if o == rank)

    @contextmanager
    def grads_for_step(self, full_grads: bool) -> Iterator[None]:
        """The optimizer's step sees the gradients of this rank's tensors only. ``full_grads``
        (``zero:1``, which holds every gradient): the others' are hidden for the step only, so
        that after the block ``p.grad`` is the mean gradient as under ``bsp``."""
        hidden = [(p, p.grad) for p in self.others] if full_grads else []
        for p, _ in hidden:
            p.grad = None
        try:
            yield
        finally:
            for p, g in hidden:
                p.grad = g

    def state_record(self) -> dict[str, Any]:
        """What a checkpoint records of the layout (``ShardedUpdate.load_state_dict`` compares
        it)."""
        return {"owners": list(self.owners), "layout": WHOLE}

    def close(self) -> None:
        """Nothing to undo: the optimizer steps the parameters themselves."""

    def source(self, unit: torch.Tensor) -> torch.Tensor:
        """The parameter a unit is of: whole tensors are their own."""
        return unit

    def part(self, p: torch.Tensor) -> torch.Tensor | None:
        """This rank's unit of parameter ``p``: ``p`` itself where it owns it, else None."""
        return p if id(p) in self._mine_ids else None

    def join(self, parts: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """The whole optimizer state dict from every rank's part (``full_state_dict``)."""
        return join_whole(parts)

    def part_of(self, whole: dict[str, Any], optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's part of a whole optimizer state dict: the state of the tensors it owns
        (the same indices as ``optimizer``'s)."""
        params = updated_by(optimizer)
        state = {i: e for i, e in whole["state"].items() if id(params[int(i)]) in self._mine_ids}
        return {**whole, "state": state}


def updated_by(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    """The tensors ``optimizer`` steps: those of its param groups."""
    return [p for group in optimizer.param_groups for p in group["params"]]


def agreed_nonfinite(
    tensors: Sequence[torch.Tensor],
    collective: Callable[[str, Callable[[], None]], None],
    what: str,
    group: dist.ProcessGroup | None,
) -> torch.Tensor:
    """Whether any rank's part of the gradient is not finite, as a 0-d float32 flag on the
    communication device (1.0: some rank's part is), left there: this rank's
    ``nonfinite_flag`` all-reduced with MAX (``collective`` runs it). MAX, not a sum: a fused
    optimizer subtracts ``found_inf`` from its step count, so the flag must be 0 or 1. Under
    ``zero:2`` and ``zero:3`` each rank steps only its own shard, so each rank must skip on
    the global verdict, not its shard's: this is it, and no host reads it."""
    device = runtime.device()
    parts = [t for t in tensors if t.numel()]
    flag = (
        nonfinite_flag(parts).to(device).reshape(1)
        if parts
        else torch.zeros(1, dtype=torch.float32, device=device)
    )

    def agree() -> None:
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)

    collective(what, agree)
    return flag.reshape(())


def unscale_agreed(
    ctx: SyncContext,
    collective: Callable[[str, Callable[[], None]], None],
    name: str,
    full_grads: bool,
) -> None:
    """Make the GradScaler's skip decision the whole gradient's on every rank. Unscaling
    here (unless the user did at the gradient-ready point) while ``zero:1`` still holds
    every gradient makes its inf/NaN check the global one; under ``zero:2`` and ``zero:3``
    the ranks each check their shard, so their counts are summed over ranks (``collective``
    runs the all-reduce), as FSDP's ShardedGradScaler does, but with MAX: a fused optimizer
    skips its update only where ``found_inf`` is exactly 1 (and subtracts it from its step
    count), so a sum of 2 when two ranks' shards are not finite (a raising block poisons
    every shard) applied a NaN update."""
    if not compat.scaler_unscaled(ctx.scaler, ctx.optimizer):
        ctx.scaler.unscale_(ctx.optimizer)
    if full_grads:
        return
    counts = compat.scaler_found_inf(ctx.scaler, ctx.optimizer)
    total = torch.zeros(1, dtype=torch.float32, device=runtime.device())
    for c in counts:
        total += c.to(total.device).reshape(1)
    total.clamp_(max=1.0)  # several devices of this rank: still one verdict

    def agree() -> None:
        dist.all_reduce(total, op=dist.ReduceOp.MAX, group=ctx.group)

    collective(f"{name} GradScaler inf/NaN count (all-reduce)", agree)
    for c in counts:
        c.copy_(total.reshape(c.shape).to(c.device))


class ShardedUpdate:
    """The update of both stages: the user's optimizer on this rank's tensors (through the
    GradScaler when there is one), then every rank's updated tensors gathered everywhere."""

    def __init__(self, ctx: SyncContext, layout: Layout, name: str, exchange: str = "auto") -> None:
        self.ctx, self.layout, self.name = ctx, layout, name
        self.spans: list[Span] = []
        if check_exchange(exchange) == "auto":
            device = layout.params[0].device.type
            exchange = choose_exchange(str(dist.get_backend(ctx.group)), device)
        #: how the buffers travel: POINT_TO_POINT or COLLECTIVE
        self.exchange = exchange
        #: each flat group's exchanges, one bucket-sized round at a time (``plan_rounds``)
        per_owner = round_elements(ctx, layout)
        self.rounds = [plan_rounds(g, per_owner) for g in layout.groups]
        #: two round buffers per flat group, kept between steps (the module's docstring says
        #: why), so that one round is on the wire while the next is packed; untouched pages
        #: cost nothing (zero:1 on one rank never touches them)
        self.buffers = [
            [g.buffer(layout.world * min(per_owner, g.chunk)) for _ in range(2)]
            for g in layout.groups
        ]

    def collective(self, step: int | None, what: str, run: Callable[[], T]) -> T:
        """``run`` (collectives and their waits) through the hang diagnosis, when there is one
        (``step`` None: the step of the latest wait)."""
        self.ctx.before_collective()
        watch = self.ctx.watch
        return run() if watch is None else watch.run(step, what, run)

    def apply(self, step: int, outcome: StepOutcome, *, full_grads: bool) -> int:
        """Step the owned tensors, then gather; the verdict goes into ``outcome``
        (``step_verdict``); returns the bytes sent. ``full_grads``: every rank holds the whole
        mean gradient (``zero:1``), else only its shard's."""
        ctx = self.ctx
        if ctx.scaling and full_grads:  # every gradient whole: the scaler's check is global
            self._unscale(step, full_grads)
        wall0, t0 = time.time(), time.perf_counter()
        with self.layout.grads_for_step(full_grads):
            if ctx.scaling and not full_grads:  # the tensors the optimizer steps: this rank's
                self._unscale(step, full_grads)
            applied = step_verdict(ctx, outcome)
        if ctx.record_spans:
            self.spans.append(Span(-1, -1, "optimizer", wall0, time.perf_counter() - t0, "step"))
        # Every rank decided alike (the same gradient, or the scaler's agreed counts), so
        # either every rank gathers or none does (every rank, where the device decided).
        return self.gather(step) if applied else 0

    def _unscale(self, step: int, full_grads: bool) -> None:
        unscale_agreed(
            self.ctx, lambda what, run: self.collective(step, what, run), self.name, full_grads
        )

    def gather(self, step: int) -> int:
        """Every rank's updated tensors to every rank, one bucket-sized round at a time through
        the kept round buffers: an in-place all-gather per round, or on gloo one broadcast per
        owner's part."""
        layout, ctx = self.layout, self.ctx
        if layout.world == 1:  # the optimizer updated every tensor in place: nothing to send
            return 0
        wall0, t0 = time.time(), time.perf_counter()
        nbytes = sum(
            r.size * g.params[0].element_size()
            for g, rounds in zip(layout.groups, self.rounds, strict=True)
            for r in rounds
        )
        what = f"{self.name} parameter {self._gather_name()} ({self._count()} round(s))"
        with torch.no_grad():
            self.collective(step, what, self._gather_rounds)
        if ctx.record_spans:
            args = {"bytes": nbytes}
            self.spans.append(
                Span(-1, -1, "allgather", wall0, time.perf_counter() - t0, "comm", args)
            )
        return nbytes

    def _count(self) -> int:
        return sum(len(r) for r in self.rounds)

    def _gather_name(self) -> str:
        return "broadcasts" if self.exchange == POINT_TO_POINT else "all-gather"

    def round_buffer(self, k: int, n: int, rnd: Round) -> torch.Tensor:
        """The kept buffer the ``n``-th exchange of a step uses for round ``rnd`` of group
        ``k``: the two alternate, so one can be on the wire while the other is packed."""
        return self.buffers[k][n % 2][: self.layout.world * rnd.size]

    def _gather_rounds(self) -> None:
        """Post each round's gather as soon as this rank's part is packed, with at most two
        in flight (one per kept buffer); each owner's part is copied out as it lands."""
        layout = self.layout
        pending: deque[tuple[FlatGroup, Round, torch.Tensor, list[tuple[int, Any]]]] = deque()
        n = 0
        for k, g in enumerate(layout.groups):
            for rnd in self.rounds[k]:
                if len(pending) == 2:  # the buffer about to be packed is the oldest's
                    self._land(*pending.popleft())
                buf = self.round_buffer(k, n, rnd)
                n += 1
                pack_round(buf, g, rnd, [layout.rank], g.params.__getitem__)
                pending.append((g, rnd, buf, self._post_gather(buf, rnd)))
        while pending:
            self._land(*pending.popleft())

    def _post_gather(self, buf: torch.Tensor, rnd: Round) -> list[tuple[int, Any]]:
        """Start filling ``buf`` from every owner: (owner, its work) per owner on gloo's
        broadcasts; one all-gather (owner -1: every owner) on the flat collectives."""
        group, rank = self.ctx.group, self.layout.rank
        if self.exchange == COLLECTIVE:
            own = buf[rank * rnd.size : (rank + 1) * rnd.size]
            return [(-1, all_gather_flat(buf, own, group=group, async_op=True))]
        return [
            (
                owner,
                dist.broadcast(
                    buf[owner * rnd.size : (owner + 1) * rnd.size],
                    src=_peer(group, owner),
                    group=group,
                    async_op=True,
                ),
            )
            for owner in range(self.layout.world)
        ]

    def _land(
        self, g: FlatGroup, rnd: Round, buf: torch.Tensor, works: list[tuple[int, Any]]
    ) -> None:
        rank = self.layout.rank
        for owner, work in works:
            work.wait()
            for o in range(self.layout.world) if owner < 0 else [owner]:
                if o != rank:
                    unpack_round(buf, g, rnd, o)

    def take_spans(self) -> list[Span]:
        spans, self.spans = self.spans, []
        return spans

    def state_dict(self) -> dict[str, Any]:
        return self.layout.state_record()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Refuse a checkpoint sharded otherwise: each rank's file holds the optimizer state of
        the tensors it owned, which another owner would silently start from zero."""
        saved_layout = layout_of(state)
        if "owners" in state and saved_layout != self.layout.kind:
            raise UsageError(
                f"this {self.name} checkpoint was sharded by {saved_layout} (each rank's file "
                f"holds its {'rows of every tensor' if saved_layout == ROWS else 'own tensors'}"
                f"), and this run shards by {self.layout.kind}: load it through sync.load, "
                f"which deals it out anew, or build {self.name} with the same layout (its "
                "layout= argument; 'auto' shards by rows for element-wise optimizers)"
            )
        saved = state.get("owners")
        if saved is not None and list(saved) != self.layout.owners:
            raise UsageError(
                f"this {self.name} checkpoint was sharded differently (owners of the "
                f"parameter tensors by index: {list(saved)}; this run: {self.layout.owners}): "
                "each rank's file holds the optimizer state of the tensors it owned. Resume "
                "with the same model and number of ranks"
            )


# -- what a script outside gradsync must not be handed silently: a shard taken for the whole --


def refuse_partial_state(optimizer: torch.optim.Optimizer, name: str) -> Any:
    """Make ``optimizer.state_dict()`` called by the user's code raise: under ZeRO it holds
    this rank's shard of the optimizer state only, and a rank-0 checkpoint of it resumes
    silently with the rest missing (AdamW restarts the other tensors' moments from zero).
    Gathering it there instead would hide a collective in a call DDP scripts make on rank 0
    alone, which would hang; so the call is refused, naming the collective that gathers.
    Returns the hook's handle (removed at ``close``: after training the optimizer is the
    user's to inspect)."""

    def refuse(_: torch.optim.Optimizer) -> None:
        if reading_own_state():  # gradsync's checkpoint or gather: this rank's shard, on purpose
            return
        raise UsageError(
            f"optimizer.state_dict() under {name} holds only this rank's shard of the "
            "optimizer state, and a checkpoint of it would resume with the other ranks' state "
            "missing. Call sync.full_state_dict() (model.sync.full_state_dict() through "
            "gs.DistributedDataParallel) on every rank: rank 0 gets "
            '{"model": ..., "optimizer": ...} whole (plain tensors, on the CPU), which '
            "model.load_state_dict / optimizer.load_state_dict load in a DDP-style script and "
            "sync.load_full_state_dict(state) loads under gradsync; or sync.save(dir) / "
            "sync.load(dir) for gradsync's own per-rank checkpoints"
        )

    return optimizer.register_state_dict_pre_hook(refuse)


def on_cpu(state: Any) -> Any:
    """``state`` (nested dicts, lists and tuples) with every tensor copied to the CPU: what is
    gathered to rank 0 (a rank's GPU tensors would arrive on rank 0 as tensors of a device it
    may not use) and what a rank-0 checkpoint holds."""
    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: on_cpu(v) for k, v in state.items()}
    if isinstance(state, list | tuple):
        return type(state)(on_cpu(v) for v in state)
    return state


def gather_to_first(
    ctx: SyncContext, part: Any, collective: Callable[[str, Callable[[], None]], None], name: str
) -> list[Any] | None:
    """Every rank's ``part`` (plain objects, CPU tensors), in rank order, on the group's first
    rank; None on the others. Collective."""
    world = runtime.world_size(ctx.group)
    if world == 1:
        return [part]
    parts: list[Any] | None = [None] * world if ctx.rank == 0 else None
    first = dist.get_global_rank(ctx.group, 0) if ctx.group is not None else 0

    def gather() -> None:
        dist.gather_object(part, parts, dst=first, group=ctx.group)

    collective(f"{name} full state dict (gather to rank 0)", gather)
    return parts


class LocalClipGuard(TorchFunctionMode):
    """Refuses a clip of the gradient by a norm of this rank's shard alone, such as torch's
    ``clip_grad_norm_`` at the gradient-ready point of ``zero:2`` / ``zero:3``.

    There each rank holds part of the gradient (``zero:2``: its own tensors'; ``zero:3``: its
    rows of every tensor, the tensors its optimizer steps), so torch's clip takes the norm of
    that part and each rank scales by its own factor: a silently wrong update. Making torch's
    clip global would need a collective inside it, which would hang when a script clips a
    subset of the parameters that some rank holds none of; so it is refused, naming
    ``s.clip_grad_norm_``, which takes the whole gradient's norm.

    How it is told apart from anything else done with the gradient: while armed (from the
    gradient-ready point to the update) it follows what is computed from the shard's
    gradients: scalars reduced from them (norms), and anything computed from those (the
    stacked norms, their norm, the clip factor). An in-place change of a gradient by such a
    value is a rescale by the shard's norm and is refused, even where the value came from that
    one tensor: a rank may own a single tensor (under ``zero:2`` the largest often sits alone
    on one), and its clip then looks exactly like normalizing a tensor by its own norm, which
    is refused with it. Reading, logging and unscaling (the GradScaler's factor is not taken
    from the shard) pass."""

    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name
        self._armed = False
        self._exempt = False
        self._grads: dict[int, weakref.ref[torch.Tensor]] = {}
        self._placeholders: dict[int, weakref.ref[torch.Tensor]] = {}
        #: values computed from the gradients: id -> (the tensor, the gradients it came from)
        self._derived: dict[int, tuple[weakref.ref[torch.Tensor], frozenset[int]]] = {}

    def arm(self, grads: Iterable[torch.Tensor], placeholders: Iterable[torch.Tensor] = ()) -> None:
        """Follow ``grads`` (this rank's part of the gradient); refuse any use of
        ``placeholders`` (``zero:2`` by rows: the parameters' ``p.grad``, which hold nothing)."""
        self.disarm()
        if compat.in_backward_pass():
            # gs.DistributedDataParallel finishes the exchange in an end-of-backward callback,
            # and the engine drops a mode entered there when the pass returns (exiting it
            # later would pop another): the front door has torch's clip take the whole norm
            # instead (ddp.py: zero:2's DTensor view; zero:3's FSDP2 DTensors).
            return
        self._grads = {id(g): weakref.ref(g) for g in grads}
        self._derived = {}
        self._placeholders = {id(t): weakref.ref(t) for t in placeholders}
        self.__enter__()
        self._armed = True

    def disarm(self) -> None:
        if self._armed:
            self._armed = False
            self.__exit__(None, None, None)
        self._grads, self._derived, self._placeholders = {}, {}, {}

    @contextmanager
    def exempt(self) -> Iterator[None]:
        """gradsync's own clip (``grad_norm``), which combines the shards' norms."""
        self._exempt = True
        try:
            yield
        finally:
            self._exempt = False

    def _sources(self, t: torch.Tensor) -> tuple[bool, frozenset[int]]:
        """Whether ``t`` is one of the gradients, and the gradients a derived ``t`` came from."""
        grad = self._grads.get(id(t))
        if grad is not None and grad() is t:
            return True, frozenset()
        derived = self._derived.get(id(t))
        if derived is not None and derived[0]() is t:
            return False, derived[1]
        return False, frozenset()

    def __torch_function__(
        self, func: Any, types: Any, args: Sequence[Any] = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if self._exempt:
            return func(*args, **kwargs)
        grads: set[int] = set()
        sources: frozenset[int] = frozenset()
        for t in _tensors_in([*args, *kwargs.values()]):
            held = self._placeholders.get(id(t))
            if held is not None and held() is t and _name_of(func) not in _METADATA:
                raise self._placeholder_refusal()
            is_grad, came_from = self._sources(t)
            if is_grad:
                grads.add(id(t))
            sources |= came_from
        in_place = _in_place(str(getattr(func, "__name__", "")))
        if grads and sources and in_place:
            raise self._refusal()
        result = func(*args, **kwargs)
        if grads or sources:
            for out in _tensors_in([result]):
                if sources or out.dim() == 0:  # from a gradient: its reductions only
                    self._derived[id(out)] = (weakref.ref(out), sources | grads)
        return result

    def _placeholder_refusal(self) -> UsageError:
        return UsageError(
            f"p.grad of a model parameter holds no values here under {self.name} by rows: "
            "each rank holds its rows of every tensor's mean gradient, as the .grad of the "
            "optimizer's tensors, not a whole gradient, so torch's clip_grad_norm_ over "
            "model.parameters() (or any read of p.grad) would see nothing. Clip with "
            "s.clip_grad_norm_(max_norm) inside the step block (the whole gradient's norm); "
            "scaler.unscale_(optimizer) works; gs.ZeroStage2(layout='whole') gives each rank "
            "whole tensors' gradients in p.grad, and zero:1 the whole mean gradient"
        )

    def _refusal(self) -> UsageError:
        return UsageError(
            f"a gradient under {self.name} is being scaled by a norm of this rank's part of "
            "the gradient only, as torch.nn.utils.clip_grad_norm_ does here: each rank holds "
            "part of the gradient (zero:2: its own tensors'; zero:3: its rows of every tensor), "
            "so each would clip by a different, wrong factor. Clip with s.clip_grad_norm_("
            "max_norm) inside the step block (the whole gradient's norm, combined over the "
            "ranks: call it on every rank); under zero:3, torch's clip over "
            "model.parameters() (FSDP2's DTensors) also takes the whole norm; under zero:1 "
            "every rank holds the whole gradient, and torch's clip works as under bsp"
        )


#: the operators that change their left operand in place (``g *= c``, ``g[...] = c``)
_IN_PLACE_OPERATORS = frozenset(
    {"__iadd__", "__isub__", "__imul__", "__itruediv__", "__idiv__", "__setitem__"}
)


#: what a placeholder gradient answers (its shape, not its values): a script may check them
_METADATA = frozenset(
    {
        "shape", "dtype", "device", "layout", "ndim", "is_cuda", "is_sparse", "requires_grad",
        "size", "dim", "numel", "nelement", "stride", "element_size", "is_contiguous",
        "is_floating_point", "__len__",
    }
)  # fmt: skip


def _name_of(func: Any) -> str:
    """A torch function's name; a property's (``Tensor.shape``'s getter) for its getter."""
    name = str(getattr(func, "__name__", ""))
    if name == "__get__":
        return str(getattr(getattr(func, "__self__", None), "__name__", name))
    return name


def _in_place(name: str) -> bool:
    """Whether the torch function or method named ``name`` changes a tensor in place: torch's
    trailing-underscore convention (``mul_``, its fused list form for torch's clip), or an
    in-place operator."""
    if name.startswith("__"):
        return name in _IN_PLACE_OPERATORS
    return name.endswith("_")


def _tensors_in(values: Iterable[Any]) -> Iterator[torch.Tensor]:
    """The tensors among ``values`` and in their lists and tuples (one level: how torch's
    fused list operations take them)."""
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, list | tuple):
            yield from (t for t in v if isinstance(t, torch.Tensor))
