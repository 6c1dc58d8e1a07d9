"""ZeRO stages 1 and 2 (``zero:1``, ``zero:2``): BSP's trajectory, with the optimizer state
(stage 1), then the gradient too (stage 2), held 1/N per rank.

What a rank "owns" depends on the layout (``layout=``): its rows of every parameter tensor
(``zero_rows``: the default for element-wise optimizers, SGD, Adam, AdamW and kin), or whole
tensors dealt by size (``zero_shards.OwnerLayout``: other optimizers, or ``layout="whole"``).
Below, "the tensors it owns" means either; ``zero_rows`` says what changes by rows.

- ``zero:1``: the gradient is exchanged exactly as under ``bsp`` (the same bucketed, overlapped
  all-reduce, so every compressor works as it does there); each rank then steps the optimizer on
  the parameter tensors it owns, and one exchange brings every rank's updated tensors to every
  rank (an all-gather on NCCL, one broadcast per owner on gloo), in bucket-sized rounds. Every
  rank holds the whole mean gradient, as under ``bsp``.
- ``zero:2``: as the backward pass finishes each tensor's gradient (its last micro-batch),
  every round (``zero_shards.plan_rounds``: half a bucket's slice of every owner's chunk)
  whose tensors are all finished is scaled into a kept round buffer and summed so that each
  rank receives only its own tensors' part (a reduce-scatter on NCCL, a ring of send/receive
  pairs on gloo), and the gradients no later round needs are freed, while backward goes on;
  the rounds go in one fixed order on every rank, so a rank whose gradients finish in
  another order only sends later. Either way each rank sends (N - 1)/N of the gradient's
  bytes, half of what an all-reduce sends; the others' gradients are freed (their ``p.grad``
  is None), then the same shard step and exchange of the update. Memory: between steps a
  rank holds its chunk of the gradient plus two round buffers (one bucket in all, shared by
  the gradient's way out and the parameters' way back, never in use together); during
  backward, the gradients of the rounds not yet sent (a round needs every owner's tensor at
  its offset, so typically one whole gradient per owner): a finished gradient whose last round
  waits for another owner's later one keeps only that round's part (``_keep_tails``). No step
  allocates a buffer of the model's size (issue 47).

Both follow one process on the global batch (tested in float64 to 1e-10 on 2 and 3 ranks, SGD
with momentum and AdamW, with micro-batches and uneven shards) and leave every replica with
the same parameters after every step. Ownership and the update (the user's optimizer itself,
stepped on the owned tensors only) are in ``zero_shards``, which says why that keeps the
user's optimizer, param groups and schedulers unchanged.

Why not torch's own pieces: ``ZeroRedundancyOptimizer`` *is* an optimizer, built from a class
and defaults: the user's optimizer object would stop being the one that steps, so the schedulers
attached to it, its ``state_dict()`` in checkpoints and the Synchronizer's count of its steps
would no longer mean anything; it has no stage 2 (it expects whole gradients, as DDP leaves
them), it brings the update back tensor by tensor (one broadcast per parameter) rather than in
one flat buffer per rank, and its ``state_dict()`` is a collective consolidation on one rank,
where gradsync writes one file per rank without a collective. Its partition rule (whole tensors,
largest to the least loaded rank) is the one used here. FSDP2's ``fully_shard`` replaces the
module's parameters by sharded DTensors, so it must run before the optimizer is built (the
user's optimizer would hold the old tensors), the divergence check would compare shards, and it
gathers parameters in the forward pass: that is stage 3, the candidate for ``zero:3``.

The gradient-ready point (``s.synchronize()``): under ``zero:1`` ``p.grad`` holds the mean
gradient, as under ``bsp``, so anything done there (``clip_grad_norm_``, ``scaler.unscale_``)
works as there. Under ``zero:2`` it holds the mean gradient of this rank's tensors only, and
the others' ``p.grad`` is None (freeing them is the point of the stage; a script that reads
another rank's part there must use ``zero:1``). A norm needs every rank's part, so clipping
must take it from ``grad_norm`` (one all-reduce of the shards' sums): ``clip_grad_norm(
sync.strategy, params, max_norm)`` from ``gradsync.strategies``, which the step handle's
``s.clip_grad_norm_`` calls. ``torch.nn.utils.clip_grad_norm_(model.parameters(), ...)``
there would clip each shard by its own norm, so it is refused (``zero_shards.LocalClipGuard``
says how it is recognised). ``scaler.unscale_(optimizer)`` there works (each rank unscales its
shard; the skip decision is agreed in the update).

Under both stages ``optimizer.state_dict()`` holds this rank's shard of the optimizer state:
called from the user's code (a DDP script's rank-0 checkpoint) it is refused, naming
``sync.full_state_dict()``, which gathers the whole state to rank 0 (``owned_full_state``);
``sync.load_full_state_dict`` deals a whole state out as a resume on another world size does.

Non-finite gradients skip the step on every rank together: under ``zero:1`` as under ``bsp``
(every rank holds the same reduced bits); under ``zero:2`` each rank checks its shard and one
one-element all-reduce (MAX) tells every rank. With a fused optimizer (``device_verdict``) the
all-reduced flag stays on the device once an update was applied and is the ``found_inf`` every
rank's update of its shard skips on, so no host waits for it (issue 44). With a GradScaler,
the scaler decides (see ``ShardedUpdate._unscale``). ``--balance`` works: each rank's
gradient is weighted by its share on its way into the exchange, as under ``bsp``, so the mean
stays the global batch's.

Compression: ``zero:1`` takes every compressor (its exchange is BSP's). ``zero:2`` refuses them:
gradsync's compressors are all-reduce hooks (a bucket in, the whole mean out, identical on
every rank) and cannot return a shard.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.distributed as dist

from gradsync import compat, runtime
from gradsync.compression.allreduce import ALLREDUCE
from gradsync.errors import UsageError
from gradsync.row_shards import join_saved, layout_of, rows_of
from gradsync.spec import GRADIENT_COMPRESSION_FORMS
from gradsync.strategies.base import (
    Membership,
    StepOutcome,
    StepPlan,
    Strategy,
    SyncContext,
    commit_or_skip,
    device_verdict,
    own_optimizer_state,
    total_norm,
)
from gradsync.strategies.bsp import BSP, late_gradient
from gradsync.strategies.passes import wrong_passes
from gradsync.strategies.zero_rows import RowLayout, check_layout, choose_layout, make_layout
from gradsync.strategies.zero_shards import (
    POINT_TO_POINT,
    FlatGroup,
    LocalClipGuard,
    OwnerLayout,
    ShardedUpdate,
    Tail,
    agreed_nonfinite,
    check_exchange,
    gather_to_first,
    on_cpu,
    pack_round,
    reduce_scatter_flat,
    refuse_partial_state,
    ring_reduce_scatter,
    updated_by,
)
from gradsync.telemetry.records import Span


def refuse_compression(stage: int, compression: str) -> None:
    """``UsageError`` when ``zero:<stage>`` cannot exchange its gradient with ``compression``
    (a compression spec), saying why and what is valid."""
    if stage != 1 and compression != "none":
        raise _compression_error(stage, compression)


def _compression_error(stage: int, compression: str) -> UsageError:
    return UsageError(
        f"zero:{stage} cannot compress its gradient exchange (compression {compression}): it "
        "reduce-scatters the gradient so that each rank receives only its own shard, and "
        "gradsync's compressors are all-reduce hooks that return the whole mean gradient. "
        f"Use zero:{stage} without compression, or zero:1, which exchanges the gradient as "
        f"bsp does and takes every gradient compressor ({GRADIENT_COMPRESSION_FORMS})"
    )


def _check_scaler(ctx: SyncContext, name: str) -> None:
    if ctx.scaling and compat.scaler_unscaled(ctx.scaler, ctx.optimizer) is None:
        raise UsageError(
            f"{name} cannot use this torch's GradScaler: it must see whether the gradient was "
            "unscaled already and agree on the scaler's inf/NaN check across ranks, and this "
            "torch hides both. Use bsp with scaler=, or bf16 autocast (no scaler)"
        )


class ZeroStage1(BSP):
    """``zero:1``: BSP's exchange, a sharded optimizer step, one all-gather of the update.
    ``exchange``: how the update travels ("auto", "point-to-point", "collective");
    ``layout``: "auto" (rows for element-wise optimizers), "rows" or "whole"."""

    name = "zero:1"
    #: each rank's file holds its own shard of the optimizer state (``reshard`` re-deals it)
    resizable = False
    lockstep = True
    reshardable = True

    def __init__(self, exchange: str = "auto", layout: str = "auto") -> None:
        super().__init__()
        #: how the update travels (``zero_shards.EXCHANGES``; "auto": by the group's backend)
        self.exchange = check_exchange(exchange)
        #: how the optimizer state is cut (``zero_rows.LAYOUTS``; "auto": by rows where the
        #: optimizer's update is element by element, else whole tensors)
        self.layout = check_layout(layout)
        self._shards: ShardedUpdate | None = None
        self._partial_state: Any = None

    def setup(self, ctx: SyncContext) -> None:
        _check_scaler(ctx, self.name)
        params = [p for p in ctx.model.parameters() if p.requires_grad]
        world = runtime.world_size(ctx.group)
        names = {id(p): n for n, p in ctx.model.named_parameters()}
        kind = choose_layout(self.layout, ctx.optimizer, params, world, self.name, names)
        layout = make_layout(params, world, ctx.rank, ctx.optimizer, kind)
        try:
            layout.check(updated_by(ctx.optimizer), self.name)
            super().setup(ctx)
            self._shards = ShardedUpdate(ctx, layout, self.name, self.exchange)
        except BaseException:
            layout.close()  # the user's optimizer as it was: a retry builds on it again
            raise
        self._partial_state = refuse_partial_state(ctx.optimizer, self.name)

    @property
    def shards(self) -> ShardedUpdate:
        assert self._shards is not None, "setup() has not run"
        return self._shards

    def full_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        return owned_full_state(self.shards, model, optimizer)

    def load_full_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        load_layout(self.shards, model, optimizer, state)

    def close(self) -> None:
        if self._partial_state is not None:
            self._partial_state.remove()
        if self._shards is not None:
            self._shards.layout.close()
        super().close()

    def update(self, step: int, outcome: StepOutcome) -> StepOutcome:
        if self.reducer.late_gradient:
            raise late_gradient(step)
        # zero:1 inside each replica group: every rank of the group skips a step not committed
        # (their Managers agree on it), so the shards' exchange below is skipped together
        commit_or_skip(self._membership, step, self.shards.ctx.optimizer, outcome)
        if outcome.skipped:
            return outcome
        outcome.bytes_sent += self.shards.apply(step, outcome, full_grads=True)
        outcome.spans.extend(self.shards.take_spans())
        return outcome

    def reshard(self, saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return reshard_layout(saved, self.shards)

    def relayout(self, saved: dict[str, Any] | None) -> dict[str, Any] | None:
        return relayout_record(saved, self.shards)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), **self.shards.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.shards.load_state_dict(state)
        super().load_state_dict(state)


def owned_full_state(
    shards: ShardedUpdate, model: torch.nn.Module, optimizer: torch.optim.Optimizer
) -> dict[str, Any] | None:
    """``zero:1`` / ``zero:2``'s ``full_state_dict``: the model is whole on every rank (rank
    0's is taken), the optimizer state of each tensor is on its owner's rank (gathered)."""
    parts = gather_to_first(
        shards.ctx,
        on_cpu(own_optimizer_state(optimizer)),
        lambda what, run: shards.collective(None, what, run),
        shards.name,
    )
    if parts is None:
        return None
    return {"model": on_cpu(model.state_dict()), "optimizer": shards.layout.join(parts)}


def load_layout(
    shards: ShardedUpdate,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    state: dict[str, Any],
) -> None:
    """Load a whole state (``full_state_dict``'s, or a DDP script's checkpoint) under
    ``zero:1`` / ``zero:2``: the model whole, this rank's part of the optimizer state."""
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(shards.layout.part_of(state["optimizer"], optimizer))


def relayout_record(saved: dict[str, Any] | None, shards: ShardedUpdate) -> dict[str, Any] | None:
    """A ``zero:1`` / ``zero:2`` checkpoint of as many ranks cut otherwise (rows, or whole
    tensors: a checkpoint written before the rows layout records none and was whole): its
    strategy state with this run's layout record, so that ``reshard`` deals it out anew. A
    resume from such a checkpoint was refused, and ``--strategy zero:1`` has no way to ask
    for whole tensors (a reviewer's finding)."""
    if not isinstance(saved, dict) or "owners" not in saved:
        return None
    if layout_of(saved) == shards.layout.kind:
        return None
    return {**saved, **shards.state_dict()}


def reshard_layout(saved: Sequence[dict[str, Any]], shards: ShardedUpdate) -> dict[str, Any]:
    """``zero:1`` / ``zero:2`` state for another world size from every rank's saved file:
    the optimizer state joined by the layout the files record, then this rank's part of it
    by this run's layout."""
    records = [s.get("sync", {}).get("strategy") for s in saved]
    whole = join_saved([s["optimizer"] for s in saved], records)
    part = shards.layout.part_of(whole, shards.ctx.optimizer)
    return {"model": saved[0]["model"], "optimizer": part}


class _BackwardPasses:
    """Counts the backward passes of a step (post-accumulate-grad hooks), hands each parameter
    to ``on_last`` once its gradient has accumulated the step's last pass, and notices a pass
    that comes after the gradient-ready point."""

    def __init__(
        self, params: Sequence[torch.Tensor], on_last: Callable[[torch.Tensor], None]
    ) -> None:
        self.armed = False
        #: a gradient arrived after the exchange, before the update
        self.late = False
        self._seen: dict[int, int] = {}
        self._passes = 1
        self._on_last = on_last
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    def arm(self, passes: int) -> None:
        self.armed, self.late, self._seen, self._passes = True, False, {}, passes

    def disarm(self) -> None:
        self.armed, self.late = False, False

    def count(self) -> int:
        return max(self._seen.values(), default=0)

    def _on_grad(self, param: torch.Tensor) -> None:
        if not self.armed:
            self.late = True
            return
        seen = self._seen[id(param)] = self._seen.get(id(param), 0) + 1
        if seen == self._passes:
            self._on_last(param)

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []


class ZeroStage2(Strategy):
    """``zero:2``: one reduce-scatter of the gradient, a sharded step, one all-gather.
    ``exchange`` and ``layout`` as ``ZeroStage1``'s."""

    name = "zero:2"
    barrier_free = False
    #: the update is the mean over the global batch, so shards may be balanced (--balance)
    weights_samples = True
    #: each rank's file holds its own shard of the optimizer state (``reshard`` re-deals it)
    resizable = False
    lockstep = True
    reshardable = True
    replicates_every_step = True
    gate_ahead = True

    def __init__(self, exchange: str = "auto", layout: str = "auto") -> None:
        #: how the gradient and the update travel (``zero_shards.EXCHANGES``)
        self.exchange = check_exchange(exchange)
        #: how the gradient and the optimizer state are cut (``zero_rows.LAYOUTS``; "auto":
        #: by rows where the optimizer's update is element by element, else whole tensors)
        self.layout = check_layout(layout)
        self._ctx: SyncContext | None = None
        self._layout: OwnerLayout | RowLayout | None = None
        self._shards: ShardedUpdate | None = None
        self._passes: _BackwardPasses | None = None
        #: this rank's part of the reduced gradient, one buffer per flat group
        self._received: list[torch.Tensor] = []
        #: the rounds (flat group, round) in the order every rank exchanges them
        self._order: list[tuple[int, int]] = []
        #: each round's tensors (indices in its flat group), and each tensor's rounds
        self._members: dict[tuple[int, int], set[int]] = {}
        self._rounds_of: dict[int, list[tuple[int, int]]] = {}
        #: where each round's piece of each of its tensors starts (round -> index -> element)
        self._starts: dict[tuple[int, int], dict[int, int]] = {}
        #: per flat group: the most elements of one gradient kept as a tail (one round's part)
        self._tail_cap: list[int] = []
        #: this step: finished gradients whose last rounds wait, kept as tails (by id(param))
        self._tails: dict[int, Tail] = {}
        #: this step: tensors each round still waits for, rounds each tensor is still in,
        #: the next round in ``_order`` to exchange, and the exchanges' time and bytes
        self._waiting: dict[tuple[int, int], int] = {}
        self._left: dict[int, int] = {}
        self._next = 0
        self._step = 0
        self._sent: list[tuple[float, float, int]] = []
        #: seconds this step's rounds held backward (sent from its hooks)
        self._in_backward = 0.0
        self._in_flight: list[Any] = []
        self._micro_batches = 1
        self._scale = 1.0
        #: refuses torch's clip of this rank's part of the gradient (``LocalClipGuard``)
        self._clip_guard = LocalClipGuard(self.name)
        #: by rows: each cut parameter's ``p.grad`` from the gradient-ready point to the update
        self._placeholders: dict[int, torch.Tensor] = {}
        self._late_hooks: list[Any] = []
        #: from the gradient-ready point to the update (``_open_window``)
        self._window = False
        #: by rows: each piece's rounds (by id), each parameter's pieces (with their index in
        #: their flat group), and this step's rounds each piece is still in
        self._unit_rounds: dict[int, list[tuple[int, int]]] = {}
        self._units_of: dict[int, list[tuple[torch.Tensor, int]]] = {}
        self._unit_left: dict[int, int] = {}
        self._partial_state: Any = None
        #: live membership's quorum (None: ``ctx.group`` holds every replica)
        self._membership: Membership | None = None

    def setup(self, ctx: SyncContext) -> None:
        if ctx.compressor is not ALLREDUCE:  # a Compressor object too, whatever its spec
            raise _compression_error(2, ctx.compressor.spec)
        self._membership = ctx.membership
        _check_scaler(ctx, self.name)
        params = [p for p in ctx.model.parameters() if p.requires_grad]
        world = runtime.world_size(ctx.group)
        names = {id(p): n for n, p in ctx.model.named_parameters()}
        kind = choose_layout(self.layout, ctx.optimizer, params, world, self.name, names)
        layout = self._layout = make_layout(params, world, ctx.rank, ctx.optimizer, kind)
        try:
            layout.check(updated_by(ctx.optimizer), self.name)
        except BaseException:
            layout.close()
            raise
        self._ctx = ctx
        self._shards = ShardedUpdate(ctx, layout, self.name, self.exchange)
        self._passes = _BackwardPasses(params, self._pack_one)
        self._received = [g.empty(1) for g in layout.groups]
        shards = self._shards
        # The rounds go in one fixed order on every rank (so that every rank posts the same
        # collectives in the same order, whatever order its gradients finish in): each flat
        # group's first round first, which holds the tensors backward usually finishes first
        # (each owner's chunk lists its tensors from the last registered, ``_flat_groups``).
        self._order = [(k, j) for k, rounds in enumerate(shards.rounds) for j in range(len(rounds))]
        self._members = {(k, j): shards.rounds[k][j].members() for k, j in self._order}
        # By the parameter each unit is of (backward's hooks name parameters): under rows a
        # parameter's pieces are several units, each counted in its round.
        # By rows also each piece's rounds, and each parameter's pieces (``_keep_row_tails``).
        rows = isinstance(layout, RowLayout)
        rounds_of: dict[int, list[tuple[int, int]]] = {}
        for (k, j), members in self._members.items():
            for i in members:
                unit = layout.groups[k].params[i]
                source = layout.source(unit)
                rounds_of.setdefault(id(source), []).append((k, j))
                if rows:
                    self._unit_rounds.setdefault(id(unit), []).append((k, j))
                    units = self._units_of.setdefault(id(source), [])
                    if all(u is not unit for u, _ in units):
                        units.append((unit, i))
        self._rounds_of = rounds_of
        self._starts = {
            (k, j): {pc.index: pc.start for owner in rnd.pieces for pc in owner}
            for k, rounds in enumerate(shards.rounds)
            for j, rnd in enumerate(rounds)
        }
        self._tail_cap = [max((r.size for r in rounds), default=0) for rounds in shards.rounds]
        self._partial_state = refuse_partial_state(ctx.optimizer, self.name)
        if isinstance(layout, RowLayout):  # one element each, read by nothing (``_open_window``)
            self._placeholders = {
                id(p): torch.full((), math.nan, dtype=p.dtype, device=p.device).expand(p.shape)
                for p in layout.cut
            }
            self._late_hooks = [p.register_hook(self._late) for p in layout.cut]

    @property
    def shards(self) -> ShardedUpdate:
        assert self._shards is not None, "setup() has not run"
        return self._shards

    def _parts(self) -> tuple[SyncContext, OwnerLayout | RowLayout, ShardedUpdate, _BackwardPasses]:
        assert self._ctx and self._layout and self._shards and self._passes, "setup() has not run"
        return self._ctx, self._layout, self._shards, self._passes

    def begin_step(self, plan: StepPlan) -> None:
        _, layout, _, passes = self._parts()
        if self._membership is not None:
            # Before anything of the step: a replacement heals here (each rank from the same
            # rank of a live group: its shard of the optimizer state is this rank's own).
            self._membership.start_step(plan.step)
        # Released, not zeroed: backward then hands every parameter a fresh gradient tensor,
        # which is copied once into the exchange's buffer and freed (as under bsp).
        self._close_window()
        for p in layout.params:
            p.grad = None
        for p in layout.reals:
            p.grad = None
        self._micro_batches = plan.micro_batches
        # The mean over ranks and micro-batches (and the balancing weight) rides on the copy
        # into the exchange's buffer, so the reduce-scatter is a plain sum.
        self._scale = plan.sample_weight / (layout.world * plan.average_over)
        self._step = plan.step
        self._waiting = {kj: len(m) for kj, m in self._members.items()}
        self._left = {key: len(v) for key, v in self._rounds_of.items()}
        self._unit_left = {key: len(v) for key, v in self._unit_rounds.items()}
        self._next, self._sent, self._in_backward = 0, [], 0.0
        self._tails = {}
        self.shards.ctx.found_inf = None  # a verdict a raising update left behind
        passes.arm(plan.micro_batches)

    def gradients_ready(self, step: int) -> StepOutcome:
        _, _, _, passes = self._parts()
        count = passes.count()
        if count != self._micro_batches:
            passes.disarm()
            raise wrong_passes(self._micro_batches, count)
        return self._exchange(step, poison=False)

    def abandon(self, step: int) -> StepOutcome:
        """This rank's block raised: send NaN for the whole gradient, so every owner finds its
        shard non-finite and every rank skips the step (the guard, or the GradScaler)."""
        ctx, _, _, passes = self._parts()
        if not passes.armed:
            return StepOutcome(skipped=True)
        if not (ctx.skip_nonfinite or ctx.scaling):
            # Nothing would make the peers skip a NaN: leave them to time out, naming this rank.
            passes.disarm()
            return StepOutcome(skipped=True)
        return self._exchange(step, poison=True)

    def _exchange(self, step: int, poison: bool) -> StepOutcome:
        """The rounds backward has not sent yet (a tensor without a gradient on this rank: zero;
        with ``poison``, NaN), then this rank's part of the mean gradient as its ``p.grad``."""
        ctx, layout, _, passes = self._parts()
        passes.disarm()
        while self._next < len(self._order):
            self._send_round(self._order[self._next], poison, draining=True)
            self._next += 1
        self._finish_in_flight()
        self._tails = {}
        if poison:  # this rank's own check fails too, whatever the rounds sent before it
            for received in self._received:
                received.fill_(float("nan"))
        nbytes = sum(n for _, _, n in self._sent)
        if self._membership is not None:
            nbytes += self._quorum_mean(self._membership)
        spans = []
        if ctx.record_spans and self._sent:
            wall0, seconds = self._sent[0][0], sum(d for _, d, _ in self._sent)
            args = {"bytes": nbytes}
            spans.append(Span(-1, -1, "reduce_scatter", wall0, seconds, "comm", args))
        for g, received in zip(layout.groups, self._received, strict=True):
            for i in g.owned(layout.rank):
                g.params[i].grad = g.view(received, i, base=layout.rank * g.chunk)
        outcome = StepOutcome(bytes_sent=nbytes, spans=spans, comm_in_block=self._in_backward)
        if self.verdict_on_device(step):
            # The agreed flag stays on the device and gates every rank's fused update of its
            # shard (``ShardedUpdate.apply``): every rank skips alike, no host waits for it.
            ctx.found_inf = outcome.found_inf = self._agreed_flag(step)
        elif ctx.skip_nonfinite and not ctx.scaling and self._agreed_flag(step).item() != 0.0:
            ctx.optimizer.zero_grad(set_to_none=True)
            self._release_parts()
            outcome.skipped = True
            return outcome
        if not poison:  # the user's code may now read p.grad: this rank's part only
            self._open_window()
        return outcome

    def _open_window(self) -> None:
        """From the gradient-ready point to the update. Whole tensors: ``p.grad`` is this
        rank's tensors' mean gradient (None for the others'). By rows: the optimizer holds
        this rank's pieces, whose ``.grad`` are its rows of the mean gradient (what a
        GradScaler's ``unscale_(optimizer)`` acts on), and each cut parameter's ``p.grad`` a
        placeholder that any use refuses (``LocalClipGuard``), so that torch's clip over
        ``model.parameters()`` fails loudly rather than clipping nothing."""
        _, layout, _, _ = self._parts()
        placeholders: list[torch.Tensor] = []
        if isinstance(layout, RowLayout):
            for p in layout.cut:
                p.grad = self._placeholders[id(p)]
            placeholders = [self._placeholders[id(p)] for p in layout.cut]
            layout.show(pieces=True)
        mine = (p.grad for p in layout.mine if p.grad is not None)
        self._clip_guard.arm(mine, placeholders)
        self._window = True

    def _release_parts(self) -> None:
        """A skipped step's gradient goes, this rank's pieces' too (the optimizer's
        ``zero_grad`` releases the parameters' only): a clip after it clips nothing."""
        layout = self._layout
        if isinstance(layout, RowLayout):
            for unit in layout.mine:
                unit.grad = None

    def _late(self, grad: torch.Tensor) -> torch.Tensor:
        """By rows, a gradient reaching a parameter between the gradient-ready point and the
        update: gradsync's refusal, where accumulating into the placeholder would fail with
        torch's "more than one element of the written-to tensor" error."""
        if self._window:
            raise late_gradient(self._step)
        return grad

    def interrupted(self) -> None:
        """By rows, the optimizer holds this rank's pieces and each cut parameter's ``p.grad``
        a placeholder from the gradient-ready point to the update: a KeyboardInterrupt caught
        in between left them there (torch's clip then refused, ``param_groups`` held the
        pieces) until the next step's start."""
        self._close_window()

    def _close_window(self) -> None:
        self._window = False
        self._clip_guard.disarm()
        layout = self._layout
        if isinstance(layout, RowLayout):
            layout.show(pieces=False)
            for p in layout.cut:
                if p.grad is self._placeholders.get(id(p)):
                    p.grad = None

    def _quorum_mean(self, membership: Membership) -> int:
        """Under live membership: this rank's part of the group's mean gradient, averaged
        with the same rank's part in every group of the quorum (HSDP's shape: the
        reduce-scatter inside the group, the all-reduce of each shard across groups); the
        bytes sent. A failed exchange leaves garbage that the step's commit then refuses."""
        launched = [membership.allreduce(received) for received in self._received]
        for done in launched:
            done.wait()
        return sum(r.numel() * r.element_size() for r in self._received)

    def _pack_one(self, param: torch.Tensor) -> None:
        """The backward pass has finished ``param``'s gradient for this step: send every round
        now complete, in the fixed order, so that each gradient is freed once its rounds are
        sent and the whole gradient never exists at once (nor a buffer of its size)."""
        # A parameter with no elements is in no round (nothing to send): .get, not [].
        for kj in self._rounds_of.get(id(param), ()):
            self._waiting[kj] -= 1
        if self._next == len(self._order) or self._waiting[self._order[self._next]]:
            return  # the next round in the order still waits for gradients
        # The step gate's wait first, outside the time below: the Synchronizer counts it as
        # sync, and it must not count it twice.
        self._parts()[0].before_collective()
        t0 = time.perf_counter()
        while self._next < len(self._order) and self._waiting[self._order[self._next]] == 0:
            self._send_round(self._order[self._next], poison=False)
            self._next += 1
        # inside the user's block, where the Synchronizer's clock says compute: it is sync
        self._in_backward += time.perf_counter() - t0

    def _send_round(self, kj: tuple[int, int], poison: bool, draining: bool = False) -> None:
        """Scale round ``kj``'s gradients into a kept round buffer, reduce-scatter it into this
        rank's part of the mean gradient (a ring of send/receive pairs on gloo), and free the
        gradients no later round needs; from backward's hooks (not ``draining``), keep only
        the tails of those whose last rounds wait (``_keep_tails``)."""
        ctx, layout, shards, _ = self._parts()
        k, j = kj
        g, rnd = layout.groups[k], shards.rounds[k][j]
        if len(self._in_flight) == 2:  # the buffer about to be packed is the oldest's
            self._in_flight.pop(0).wait()
        buf = shards.round_buffer(k, len(self._sent), rnd)
        if poison:
            buf.fill_(float("nan"))
        else:
            pack_round(buf, g, rnd, range(layout.world), self._gradient_of(g), self._scale)
        received = self._received[k][rnd.lo : rnd.lo + rnd.size]
        ring = shards.exchange == POINT_TO_POINT
        wall0, t0 = time.time(), time.perf_counter()

        def run() -> None:
            if ring:
                bound = None if ctx.watch is None else ctx.watch.timeout_s
                ring_reduce_scatter(received, buf, layout.rank, layout.world, ctx.group, bound)
            else:
                work = reduce_scatter_flat(received, buf, group=ctx.group, async_op=True)
                self._in_flight.append(work)

        kind = "ring reduce-scatter (send/receive)" if ring else "reduce-scatter"
        shards.collective(self._step, f"zero:2 gradient {kind}, round {j + 1} of group {k}", run)
        self._sent.append((wall0, time.perf_counter() - t0, buf.numel() * buf.element_size()))
        for i in self._members[kj]:
            unit = g.params[i]
            p = layout.source(unit)
            self._left[id(p)] -= 1
            if self._left[id(p)] == 0:
                p.grad = None
                self._tails.pop(id(p), None)
            if unit is not p:  # a piece of rows: its own tail goes with its last round
                self._unit_left[id(unit)] -= 1
                if self._unit_left[id(unit)] == 0:
                    self._tails.pop(id(unit), None)
        if not (poison or draining):
            if isinstance(layout, RowLayout):
                self._keep_row_tails(kj, layout)
            else:
                self._keep_tails(kj)

    def _gradient_of(self, g: FlatGroup) -> Callable[[int], torch.Tensor | Tail | None]:
        """What a round packs of ``g.params[i]``: its kept tail, else its gradient."""

        layout = self._layout
        if isinstance(layout, RowLayout):  # a piece's kept tail, else its rows of the gradient

            def piece(i: int) -> torch.Tensor | Tail | None:
                tail = self._tails.get(id(g.params[i]))
                return tail if tail is not None else layout.gradient_of(g.params[i])

            return piece

        def source(i: int) -> torch.Tensor | Tail | None:
            p = g.params[i]
            return self._tails.get(id(p), p.grad)

        return source

    def _keep_tails(self, kj: tuple[int, int]) -> None:
        """Round ``kj`` is sent, so its tensors' gradients are final: where what a tensor still
        has to send is at most one round's part, copy that tail out and free the gradient.
        A round carries the same slice of every owner's chunk, so a gradient whose chunk ends
        past a round boundary waits for whatever another owner has there, often the last
        gradient backward makes: without this, on 6 Linear(4096, 4096) at 4 ranks every
        gradient lived until the end of backward (issue 47)."""
        _, layout, _, _ = self._parts()
        k = kj[0]
        g = layout.groups[k]
        for i in self._members[kj]:
            p = g.params[i]
            left, grad = self._left[id(p)], p.grad
            if left == 0 or grad is None:
                continue
            rounds = self._rounds_of[id(p)]
            start = self._starts[rounds[len(rounds) - left]][i]
            if p.numel() - start <= self._tail_cap[k]:
                self._tails[id(p)] = Tail(start, grad.reshape(-1)[start:].clone())
                p.grad = None

    def _keep_row_tails(self, kj: tuple[int, int], layout: RowLayout) -> None:
        """By rows, the ``_keep_tails`` of whole tensors: a round carries consecutive tensors,
        so a gradient whose rows end inside round ``kj``'s successor waits there for the next
        tensor backward makes. Where what is left of it, over every rank's rows, is at most
        one round's, copy each piece's rest out and free the gradient: without this two
        64 MiB gradients lived at once on the issue's model."""
        g = layout.groups[kj[0]]
        for i in self._members[kj]:
            p = layout.source(g.params[i])
            if p.grad is None or self._left[id(p)] == 0:
                continue
            rest = []
            for unit, index in self._units_of[id(p)]:
                left = self._unit_left[id(unit)]
                if left:
                    rounds = self._unit_rounds[id(unit)]
                    rest.append((unit, self._starts[rounds[len(rounds) - left]][index]))
            if (
                sum(unit.numel() - start for unit, start in rest)
                > self._tail_cap[kj[0]] * layout.world
            ):
                continue
            for unit, start in rest:
                part = layout.gradient_of(unit)
                assert part is not None
                self._tails[id(unit)] = Tail(start, part.reshape(-1)[start:].clone())
            p.grad = None

    def _finish_in_flight(self) -> None:
        _, _, shards, _ = self._parts()

        def wait() -> None:
            while self._in_flight:
                self._in_flight.pop(0).wait()

        if self._in_flight:
            shards.collective(self._step, "zero:2 gradient reduce-scatter (wait)", wait)

    def verdict_on_device(self, step: int) -> bool:
        """Whether step ``step``'s non-finite verdict stays on the device (``device_verdict``:
        once an update was applied, on every rank alike): a skipped step then keeps each
        rank's shard of the gradient as ``p.grad``, where the host path releases it."""
        ctx, _, _, _ = self._parts()
        return device_verdict(ctx)

    def _agreed_flag(self, step: int) -> torch.Tensor:
        """Whether some rank's shard of the mean gradient is not finite: a 0-d flag on the
        device (1.0: not finite), one one-element all-reduce (``agreed_nonfinite``)."""
        _, _, shards, _ = self._parts()
        return agreed_nonfinite(
            self._received,
            lambda what, run: shards.collective(step, what, run),
            "zero:2 non-finite check (all-reduce of a flag)",
            shards.ctx.group,
        )

    def gradient_holders(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` holds this rank's part of ``params``' mean gradient at
        the gradient-ready point: the tensors it owns, or by rows its pieces of every one."""
        _, layout, _, _ = self._parts()
        return [u for u in (layout.part(p) for p in params) if u is not None]

    def gradient_part(self, p: torch.Tensor) -> torch.Tensor | None:
        """This rank's part of ``p``'s mean gradient after the exchange (None: it holds none):
        the whole gradient of a tensor it owns, or its rows of every tensor."""
        _, layout, _, _ = self._parts()
        unit = layout.part(p)
        return None if unit is None else unit.grad

    def set_gradient_part(self, p: torch.Tensor, grad: torch.Tensor | None) -> None:
        """Make ``grad`` this rank's part of ``p``'s gradient for the update: what the front
        door's loop left in place of the gradient it was shown (its local part, a plain
        gradient, or None: then ``p`` is not stepped, as under DDP)."""
        _, layout, _, _ = self._parts()
        unit = layout.part(p)
        if unit is None:  # another rank's tensor: nothing of it here
            return
        if grad is not None and unit is not p and grad.shape == p.shape:
            start, stop = rows_of(p.shape, layout.world, layout.rank)
            grad = grad[start:stop]  # a whole plain gradient: this rank's rows of it
        unit.grad = grad

    def show_parameters(self) -> None:
        """The optimizer holds the parameters themselves (its pieces while gradsync steps it):
        for the front door, whose loop's GradScaler checks the gradients it is shown."""
        layout = self._layout
        if isinstance(layout, RowLayout):
            layout.show(pieces=False)

    def grad_norm(self, params: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The norm of the whole mean gradient: each rank's shard's, combined over the ranks by
        one all-reduce (of norm^p, or the max for the infinity norm). Collective. ``params``:
        the tensors that hold this rank's part (``gradient_holders``)."""
        ctx, layout, shards, _ = self._parts()
        norm_type = float(norm_type)
        holders = self.gradient_holders(params)  # by rows: the pieces, not the placeholders
        with self._clip_guard.exempt():
            local = total_norm([p.grad for p in holders if p.grad is not None], norm_type)
        # float64 on every rank: ranks whose shards differ in dtype must post the same
        # collective, and the sum of powers loses nothing before the root
        local = local.to(runtime.device(), torch.float64)
        inf = norm_type == math.inf
        part = local.clone() if inf else local.pow(norm_type)

        def combine() -> None:
            op = dist.ReduceOp.MAX if inf else dist.ReduceOp.SUM
            dist.all_reduce(part, op=op, group=ctx.group)

        shards.collective(None, "zero:2 gradient norm (all-reduce)", combine)
        total = part if inf else part.pow(1.0 / norm_type)
        return total.to(layout.params[0].dtype)  # the same dtype on every rank

    def update(self, step: int, outcome: StepOutcome) -> StepOutcome:
        self._close_window()
        ctx, _, shards, passes = self._parts()
        if passes.late:
            raise late_gradient(step)
        commit_or_skip(self._membership, step, ctx.optimizer, outcome)
        if outcome.skipped:
            self._release_parts()
            return outcome
        outcome.bytes_sent += shards.apply(step, outcome, full_grads=False)
        outcome.spans.extend(shards.take_spans())
        return outcome

    def reshard(self, saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
        return reshard_layout(saved, self.shards)

    def relayout(self, saved: dict[str, Any] | None) -> dict[str, Any] | None:
        return relayout_record(saved, self.shards)

    def full_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        return owned_full_state(self.shards, model, optimizer)

    def load_full_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        load_layout(self.shards, model, optimizer, state)

    def state_dict(self) -> dict[str, Any]:
        _, _, shards, _ = self._parts()
        return shards.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _, _, shards, _ = self._parts()
        shards.load_state_dict(state)

    def close(self) -> None:
        self._close_window()
        if self._partial_state is not None:
            self._partial_state.remove()
        if self._passes is not None:
            self._passes.close()
        for hook in self._late_hooks:
            hook.remove()
        self._late_hooks = []
        if self._layout is not None:
            self._layout.close()
