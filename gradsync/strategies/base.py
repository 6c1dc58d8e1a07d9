"""The strategy protocol: every phase of a step, and everything else the ``Synchronizer``,
checkpointing and the CLI need from a strategy, as members. Nothing outside a strategy asks
what it is (no ``getattr``, no name checks): it asks the protocol.

A step, phase by phase (docs/architecture.md has the picture):

1. ``begin_step(plan)`` before the user's block: zero or release gradients, arm the hooks;
   ``plan`` carries the step, the micro-batch count and this rank's sample weight.
2. The user's block: forward and backward; exchanges may start from autograd hooks.
3. ``gradients_ready(step)``: the exchange has finished and ``p.grad`` holds the gradient the
   update will use (or the outcome says the step is skipped, on every rank that must agree).
   This is the point where a user may clip, unscale or log.
4. ``update(step, outcome)``: apply the update: the user's optimizer, or the strategy's own
   (a sharded step, a push to a server, a periodic average); returns the step's outcome.

Around the steps: ``setup(ctx)`` once, ``finalize()`` when training ends (a final average, the
last pull from the servers), ``replicas_identical`` for the divergence check,
``state_dict`` / ``load_state_dict`` for checkpoints (and ``CheckpointHooks``, registered in
``setup``, where a save needs more of the strategy, as parameter servers do), ``close()``.
Ranks that do not train (parameter servers) are declared by ``servers`` and run the
``ServerRole`` that ``server_role()`` gives them, through ``Synchronizer.serve()``.

``Strategy`` is a ``typing.Protocol`` with defaults: a class that subclasses it explicitly
inherits the no-op members and writes only what it does differently.
"""

from __future__ import annotations

import contextlib
import datetime
from collections.abc import Callable, Iterable, Sequence
from contextlib import AbstractContextManager
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

import torch
import torch.distributed as dist

from gradsync import compat
from gradsync.checks.guards import all_finite, nonfinite_flag
from gradsync.compression.allreduce import ALLREDUCE
from gradsync.compression.base import Compressor, Group, ReplicaExchange
from gradsync.compression.fp import CAST_WIRE
from gradsync.errors import UsageError
from gradsync.spec import STRATEGY_FORMS, StrategySpec, parse_strategy_spec
from gradsync.telemetry.records import Span


@dataclass(slots=True)
class StepOutcome:
    """What a strategy reports about one step, for telemetry."""

    bytes_sent: int = 0
    skipped: bool = False
    #: whether the step ended at a barrier with the other ranks (see telemetry.records)
    barrier: bool = True
    #: measured wait imposed by others, for steps without a barrier (SSP's bound)
    idle: float = 0.0
    #: seconds this rank spent blocked in the strategy's collectives inside the user's block
    #: (FSDP2's gathers under ``zero:3``): telemetry counts them as sync, not compute
    comm_in_block: float = 0.0
    spans: list[Span] = field(default_factory=list)
    #: the non-finite verdict left on the device (``device_verdict``): a 0-d float32 tensor,
    #: 1.0 where the update was skipped there. ``skipped`` then says only what the host knows
    #: (False), and the Synchronizer reads this one later, with others, in one batch
    found_inf: torch.Tensor | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class StepPlan:
    """What ``begin_step`` is told about the step about to run."""

    step: int
    micro_batches: int = 1
    #: ``"mean"``: the update averages the micro-batches' gradients; ``"sum"``: it adds them
    #: (the script divided each loss by the micro-batch count, as DDP scripts do)
    accumulation: Literal["mean", "sum"] = "mean"
    #: this rank's gradient weight, ``n_r * W / N`` when shards are balanced (1.0 otherwise),
    #: so the update stays the mean over the global batch; see ``Strategy.weights_samples``
    sample_weight: float = 1.0

    @property
    def average_over(self) -> int:
        """What the accumulated micro-batch gradients are divided by."""
        return self.micro_batches if self.accumulation == "mean" else 1


@dataclass(frozen=True, slots=True)
class Layout:
    """Which ranks train and which serve: the servers are the last ``servers`` ranks, so rank 0
    always trains (it writes the run's files)."""

    workers: int
    servers: int = 0

    @classmethod
    def of(cls, world_size: int, servers: int) -> Layout:
        if servers and world_size - servers < 1:
            raise UsageError(
                f"{servers} server(s) leave no worker in a group of {world_size} ranks; "
                "launch at least servers + 1 processes"
            )
        return cls(workers=world_size - servers, servers=servers)

    @property
    def world_size(self) -> int:
        return self.workers + self.servers

    def role(self, rank: int) -> Literal["worker", "server"]:
        return "server" if rank >= self.workers else "worker"


@dataclass(frozen=True, slots=True)
class CheckpointHooks:
    """What a strategy asks of each worker's checkpoints, registered in ``setup`` through
    ``SyncContext.register_checkpoint_hooks`` (parameter servers do: their servers snapshot
    when the workers ask). A strategy that registers none is saved as its ``state_dict``."""

    #: at the start of ``sync.save()`` on every worker, after ``step`` steps, before the
    #: snapshot; may refuse the save (``UsageError``)
    before_save: Callable[[int], None] | None = None
    #: once this rank's snapshot after ``step`` steps is with its writer, before waiting for it:
    #: ``(step, durable, directory_key)``. ``durable``: the save waits for the files;
    #: ``directory_key``: on rank 0 with servers, a number for the save's directory and keep
    #: that changes when they do, else 0. A rank that dies from then on leaves this step's
    #: snapshot to its writer, so every rank holds a step in common.
    handed_over: Callable[[int, bool, int], None] | None = None
    #: before a worker waits for its checkpoints (``wait_for_checkpoints``, ``close``, a save
    #: into another directory): ranks that never save themselves (servers) write their newest
    flush: Callable[[], None] | None = None
    #: though not ``Strategy.lockstep``, ranks' newest checkpoints still differ by at most one
    #: step when every step saves, and ``flush`` makes every rank write its newest: the
    #: writers may hold snapshots as under a lockstep strategy
    holds_snapshots: bool = False


def _nothing() -> None:
    return None


def _always() -> bool:
    return True


def _no_hooks(hooks: CheckpointHooks) -> None:
    return None


class Membership(Protocol):
    """Live membership (``Synchronizer(membership="torchft")``, ``gradsync.membership``): the
    replicas training now are a quorum that changes between steps, and every cross-replica
    exchange goes through it. A strategy that takes one (BSP) joins the quorum at the start of
    each step, sends its gradient through ``allreduce`` and applies the update only where
    ``commit`` says so: a step not committed is skipped on this replica, as a non-finite one
    is, and the quorum heals the replica at a later step if its peers went on."""

    def start_step(self, step: int) -> None:
        """Join this step's quorum; a replacement takes a live peer's state here."""
        ...

    def allreduce(
        self,
        tensor: torch.Tensor,
        wire: torch.dtype | None = None,
        after: Callable[[], object] | None = None,
    ) -> torch.futures.Future[torch.Tensor]:
        """The mean of ``tensor`` over this step's participants, in place; sent as ``wire``
        (fp16 or bf16, each participant's share cast to it) where given; started once
        ``after`` returns (the replica group's own all-reduce, in a group of several ranks)."""
        ...

    @property
    def replicas(self) -> ReplicaExchange:
        """The quorum's participants as a compressor's group (``compression.base.Group``): a
        compressed exchange's all-gathers and all-reduces run on them."""
        ...

    def exchange(
        self,
        run: Callable[[], torch.futures.Future[torch.Tensor]],
        tensor: torch.Tensor,
        after: Callable[[], object] | None = None,
    ) -> torch.futures.Future[torch.Tensor]:
        """``run()`` (a compressor's hook on a state whose group is ``replicas``) once
        ``after`` returns, on the thread that waits for the exchanges: its result, or
        ``tensor`` where it failed, which the quorum then does not commit."""
        ...

    def commit(self, step: int) -> bool:
        """Called once per step after the exchange: whether this replica applies it."""
        ...


@dataclass(slots=True, kw_only=True)
class SyncContext:
    """The runtime objects a strategy works on (config lives in the strategy itself)."""

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    group: dist.ProcessGroup | None
    compressor: Compressor
    bucket_mb: (
        float | str | None
    )  # None: the default plan (``spec.default_bucket_mb``); "auto": timed (``bucket_autotune``)
    record_spans: bool = False
    #: skip (on every rank together) a step whose mean gradient is not finite
    skip_nonfinite: bool = True
    #: turns a failed wait into an error naming the ranks that never arrived
    watch: Any = None
    #: the ranks' roles (``Layout.of(world, strategy.servers)``)
    layout: Layout = field(default_factory=lambda: Layout(workers=1))
    rank: int = 0
    #: the user's ``torch.amp.GradScaler``: it steps the optimizer and decides the skips
    scaler: Any = None
    #: a ``StepGate`` to pass (``gate.ensure(step, what)``) before a collective that follows
    #: the user's code, such as a periodic average; None where ranks are not gated
    gate: Any = None
    #: ``allreduce="hierarchical"``: the ``gradsync.topology.Hierarchy`` that sums across
    #: hosts through one leader each (None: a flat all-reduce over ``group``)
    hierarchy: Any = None
    #: give the checkpoints ``CheckpointHooks`` (once, in ``setup``)
    register_checkpoint_hooks: Callable[[CheckpointHooks], None] = _no_hooks
    #: to call before each collective of a step (a strategy with ``gate_ahead``): ends the
    #: step gate's wait begun at the block's entry, raising its error if it failed
    before_collective: Callable[[], None] = _nothing
    #: whether ``before_collective`` would return at once (the gate has opened, or there is
    #: none): a collective that may wait is posted later rather than waited for here
    collective_ready: Callable[[], bool] = _always
    #: ``membership="torchft"``: the quorum every cross-replica exchange goes through (None:
    #: the group is every replica, for the whole run)
    membership: Membership | None = None
    #: ``find_unused_parameters=True``: a parameter no rank used keeps ``grad`` None, as under
    #: DDP (where the strategy ``drops_unused_gradients``)
    find_unused_parameters: bool = False
    #: the non-finite verdict of the step under way, on the device (``device_verdict``):
    #: ``optimizer_step`` hands it to the optimizer as its ``found_inf`` and clears it
    found_inf: torch.Tensor | None = None
    #: an update has been applied with the host's verdict (``optimizer_step`` without a
    #: device flag): the first one makes the optimizer's state (``device_verdict`` waits for
    #: it). Under a lockstep strategy every rank reads the same verdicts on that path, so
    #: every rank sets it at the same step, whatever state its own optimizer holds.
    applied_once: bool = False

    @property
    def scaling(self) -> bool:
        """Whether an enabled GradScaler owns the step and the non-finite decision."""
        return self.scaler is not None and bool(self.scaler.is_enabled())


#: set while gradsync reads an optimizer's state for itself (``own_optimizer_state``)
_READING_OWN_STATE: ContextVar[bool] = ContextVar("gradsync_reading_own_state", default=False)


def own_optimizer_state(optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """``optimizer.state_dict()`` as gradsync's own checkpoints and gathers read it: under ZeRO
    this rank's shard of the state, on purpose (each rank writes its own file, or the shards
    are gathered), where the same call from a script is refused (``reading_own_state``,
    ``zero_shards.refuse_partial_state``). A context variable says who reads, rather than a
    look at the caller's frames: it is set exactly around gradsync's own calls."""
    token = _READING_OWN_STATE.set(True)
    try:
        return optimizer.state_dict()
    finally:
        _READING_OWN_STATE.reset(token)


def reading_own_state() -> bool:
    """Whether the ``optimizer.state_dict()`` under way is gradsync's own
    (``own_optimizer_state``)."""
    return _READING_OWN_STATE.get()


def device_verdict(ctx: SyncContext) -> bool:
    """Whether this step's non-finite verdict can stay on the device: the guard is on, no
    GradScaler owns the decision, and the user's optimizer skips its own update on a
    ``found_inf`` tensor (torch's fused optimizers, ``compat.takes_found_inf``), so the host
    never has to know whether to call it.

    Not before an update was applied (``ctx.applied_once``): fused SGD with momentum
    allocates its buffers uninitialised on its first step and fills them only if that step is
    applied, so a first step skipped on the device would leave them holding garbage, added
    into every later update. "From the second step on" was not enough: where the first steps
    are all non-finite, the optimizer's first step comes later. Not "once this rank's
    optimizer has state" either: ``zero:1``'s ranks hold the state of their own tensors only,
    one may hold none, and ranks that chose differently would hang (whether the update
    gathers follows the choice). The host path reads each verdict anyway, so every rank knows
    the first applied step at no extra read. (Fused Adam/AdamW make zeroed state and take
    back their step count where ``found_inf`` is set: a skipped first step is harmless there,
    but one rule is kept for all.)"""
    return (
        ctx.skip_nonfinite
        and not ctx.scaling
        and ctx.applied_once
        and compat.takes_found_inf(ctx.optimizer)
    )


def scaler_on_device(ctx: SyncContext) -> bool:
    """Whether a GradScaler's skip can stay on the device: it owns the step, and the user's
    optimizer takes the scaler's ``found_inf`` tensor itself (``compat.takes_found_inf``), so
    ``GradScaler.step`` reads nothing on the host (for any other optimizer it reads its inf
    count with ``.item()`` to decide whether to call ``step()``), and torch shows the counts
    it recorded (``compat.scaler_found_inf``), from which ``step_verdict`` takes the verdict
    instead of comparing ``get_scale()`` (a host read) before and after."""
    return (
        ctx.scaling
        and compat.takes_found_inf(ctx.optimizer)
        and compat.scaler_unscaled(ctx.scaler, ctx.optimizer) is not None
    )


def local_gradient(
    params: Sequence[torch.Tensor], ctx: SyncContext, average_over: int, on_device: bool = False
) -> StepOutcome:
    """``gradients_ready`` for strategies whose update starts from this rank's own gradient
    (local steps, parameter-server pushes): the mean over micro-batches, or a skipped step
    when it is not finite, which is this rank's alone (unless a GradScaler decides that).
    ``on_device``: the strategy's update is the user's optimizer through ``optimizer_step``,
    so where ``device_verdict`` allows, the verdict stays on the device (``ctx.found_inf``)."""
    grads = [p.grad for p in params if p.grad is not None]
    if on_device and grads and device_verdict(ctx):
        ctx.found_inf = nonfinite_flag(grads)
        if average_over > 1:
            for g in grads:
                g.div_(average_over)
        return StepOutcome(barrier=False, found_inf=ctx.found_inf)
    if ctx.skip_nonfinite and not ctx.scaling and not all_finite(grads):
        return StepOutcome(barrier=False, skipped=True)
    if average_over > 1:
        for g in grads:
            g.div_(average_over)
    return StepOutcome(barrier=False)


def total_norm(grads: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
    """The ``norm_type`` norm of ``grads`` taken together, as ``clip_grad_norm_`` computes it
    (torch's own function where this torch has it, so BSP's clip stays bitwise DDP's)."""
    get_total_norm = getattr(torch.nn.utils, "get_total_norm", None)
    if get_total_norm is not None:
        return get_total_norm(list(grads), norm_type)
    if not grads:  # torch < 2.6: the same formula, per tensor then over the tensors
        return torch.tensor(0.0)
    norms = [torch.linalg.vector_norm(g, norm_type) for g in grads]
    return torch.linalg.vector_norm(torch.stack(norms), norm_type)


def clip_grad_norm(
    strategy: Strategy, params: Iterable[torch.Tensor], max_norm: float, norm_type: float = 2.0
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` over the gradient the update will use, with the total
    norm from ``strategy.grad_norm`` (the whole gradient's, also where each rank holds a part
    of it, as under ``zero:2``); returns that norm. Call it at the gradient-ready point, on
    every rank: it is collective when ``grad_norm`` is."""
    params = strategy.gradient_holders(list(params))
    total = strategy.grad_norm(params, norm_type)
    grads = [p.grad for p in params if p.grad is not None]
    clip = getattr(torch.nn.utils, "clip_grads_with_norm_", None)
    if clip is not None:
        clip([p for p in params if p.grad is not None], max_norm, total)
    else:  # torch < 2.6: its formula
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))
    return total


def optimizer_step(ctx: SyncContext) -> bool:
    """The user's optimizer step, through their GradScaler when there is one; returns whether
    the update was applied. The scaler skips a step whose unscaled gradient is not finite and
    then lowers its scale (``backoff_factor`` < 1), so a lower scale means a skipped step. A
    verdict left on the device (``ctx.found_inf``) goes to the optimizer instead, which skips
    on it there: True is then only the host's view."""
    found_inf, ctx.found_inf = ctx.found_inf, None
    if not ctx.scaling and found_inf is not None:
        # Applied or not is decided on the device: "applied" here is the host's view only.
        compat.step_with_found_inf(ctx.optimizer, found_inf)
        return True
    if not ctx.scaling:
        ctx.optimizer.step()
        ctx.applied_once = True
        return True
    before = ctx.scaler.get_scale()
    ctx.scaler.step(ctx.optimizer)
    ctx.scaler.update()
    return bool(ctx.scaler.get_scale() >= before)


def step_verdict(ctx: SyncContext, outcome: StepOutcome) -> bool:
    """``optimizer_step`` for a strategy that can take the verdict on the device, recorded in
    ``outcome``: ``skipped`` where the host knows it, else ``found_inf`` (already there when
    the strategy handed the optimizer its own flag). Returns whether the host must treat the
    update as made (True where the device decides: a skipped update leaves the parameters
    as they were on every rank, so an exchange of them after it is harmless).

    A GradScaler with a fused optimizer (``scaler_on_device``): its ``step()`` hands the
    optimizer ``found_inf`` on the device, and the verdict is that same count (non-zero:
    skipped, when ``update()`` lowers the scale), copied before ``update()`` clears it."""
    if ctx.found_inf is None and scaler_on_device(ctx):
        assert ctx.scaler is not None
        ctx.scaler.step(ctx.optimizer)
        counts = compat.scaler_found_inf(ctx.scaler, ctx.optimizer)
        device = counts[0].device
        total = torch.stack([c.to(device).reshape(()) for c in counts]).sum()
        outcome.found_inf = (total > 0).to(torch.float32)
        ctx.scaler.update()
        return True
    outcome.skipped = not optimizer_step(ctx)
    return not outcome.skipped


#: what a server role hands its state to when the workers ask for a checkpoint:
#: ``sink(state)``; ``durable=True`` when a worker's save waits for its files, ``where=``
#: rank 0's number for the save's directory (``CheckpointHooks.handed_over``) where known. The
#: state is live (the role's own tensors, and its optimizer object where it has one, whose
#: ``state_dict()`` the sink takes): snapshot it within the call.
CheckpointSink = Callable[..., None]


class ServerRole(Protocol):
    """What a rank that serves instead of training runs (``Synchronizer.serve()``)."""

    def restore(self, state: dict[str, Any]) -> None:
        """Start the next ``serve()`` from a checkpointed state: as handed to the checkpoint
        sink, with its tensors copied and its optimizer given as its ``state_dict()`` (what
        ``Checkpointer.save_server`` writes)."""
        ...

    def serve(self, checkpoint: CheckpointSink) -> Any:
        """Serve until every worker is done; hand ``checkpoint`` this server's state whenever
        the workers save. Returns the server's statistics. A role whose ``serve`` also takes
        ``flush`` (a callable) is given one: call it when a worker waits for its checkpoints
        (``CheckpointHooks.flush``), to write the newest state handed over."""
        ...


@runtime_checkable
class Strategy(Protocol):
    name: str
    #: True when ranks must not be made to wait for each other outside the strategy's own
    #: exchanges (asynchronous strategies): telemetry then gathers only at the end.
    barrier_free: bool = False
    #: how many ranks (the last ones) serve instead of training; see ``Layout``
    servers: int = 0
    #: whether the strategy applies ``StepPlan.sample_weight``, i.e. averages one global batch
    #: per step, so shards of different sizes can be balanced across ranks
    weights_samples: bool = False
    #: whether its checkpointed state means the same at another world size (rank 0's file can
    #: then seed every rank of a resized job)
    resizable: bool = False
    #: whether replicas agree after every step: buffers (BatchNorm statistics) are then kept
    #: in agreement too, from rank 0 at the start of every step, as DDP's broadcast_buffers
    replicates_every_step: bool = False
    #: whether it takes a model whose parameters FSDP2 already sharded (DTensors)
    takes_sharded_models: bool = False
    #: whether its collectives run inside the user's block (FSDP2's under ``zero:3``): a
    #: failed one there is then diagnosed as a failed wait, naming the ranks that never came
    collectives_in_block: bool = False
    #: whether every collective it posts inside a step goes after
    #: ``SyncContext.before_collective()``: the step gate can then be waited on a thread from
    #: the block's entry and joined there (``gradsync.checks.gate_ahead``)
    gate_ahead: bool = False
    #: whether it sums its gradient through ``SyncContext.hierarchy`` when one is given
    #: (``allreduce="hierarchical"``); the others refuse it
    takes_hierarchy: bool = False
    #: whether it honours ``SyncContext.find_unused_parameters`` (DDP's: a parameter no rank
    #: used keeps ``grad`` None); the others give it a zero gradient, and the Synchronizer warns
    drops_unused_gradients: bool = False
    #: whether ``reshard`` can split every rank's saved state anew for another world size
    #: (a strategy that is not ``resizable`` resumes on the saved world size otherwise)
    reshardable: bool = False
    #: whether no rank can finish a step before every rank has finished the one before (a
    #: collective every step): ranks' newest checkpoints then differ by at most one step, so
    #: the background writer may hold most snapshots in memory and write every 64th, and a
    #: dying rank's writer writes the newest two (``writer_process.FILES_EVERY``)
    lockstep: bool = False

    def setup(self, ctx: SyncContext) -> None: ...

    def settings_spec(self) -> str | None:
        """The canonical spec of its settings where ``name`` does not say them all (a built-in
        periodic strategy: ``local:4``, ``diloco:8:2:1``, ``gossip:2``, ``noloco:4``), as
        ``str(parse_strategy_spec(...))`` writes it. Checkpoints record it, and a load under
        other settings is refused (``checkpoint.settings``). None where the name is the whole
        spec, and for a strategy of the user's own."""
        return None

    def begin_step(self, plan: StepPlan) -> None: ...

    def gradients_ready(self, step: int) -> StepOutcome:
        """Finish the exchange: afterwards ``p.grad`` holds the gradient the update will use,
        unless the outcome is ``skipped``."""
        return StepOutcome()

    def update(self, step: int, outcome: StepOutcome) -> StepOutcome:
        """Apply the update (unless ``outcome.skipped``); returns the step's final outcome."""
        ...

    def gradient_holders(self, params: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        """The tensors whose ``.grad`` holds this rank's part of ``params``' gradient at the
        gradient-ready point (what a clip scales): the parameters themselves, unless a
        strategy keeps it elsewhere (``zero:2`` by rows: this rank's pieces)."""
        return list(params)

    def grad_norm(self, params: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """After ``gradients_ready``: the total ``norm_type`` norm of the gradient the update
        will use, over ``params`` (what ``StepHandle.clip_grad_norm_`` clips to). The default
        reads this rank's ``p.grad``, which holds the whole of it; a strategy whose ranks each
        hold a part (``zero:2``) combines the parts, so every rank gets the same global norm
        (a collective there: call it on every rank)."""
        return total_norm([p.grad for p in params if p.grad is not None], norm_type)

    def abandon(self, step: int) -> StepOutcome:
        """The user's block raised on this rank before the gradient-ready point: finish what
        the peers expect of this step's exchange, with a contribution that makes every rank
        skip it where that can be done; ``update`` then runs with the outcome as usual (and
        the exception propagates). The default suits strategies that exchange nothing inside
        the block."""
        return StepOutcome(skipped=True)

    def interrupted(self) -> None:
        """A KeyboardInterrupt or SystemExit left the step's block on this rank: put back,
        locally, what the user's code sees of the strategy mid-step (no collective: the peers
        may be gone), so that a script or notebook that catches it finds its model and
        optimizer as between steps. Must not raise. Nothing to do by default."""
        return None

    def finalize(self) -> None:
        """Training ends (``report()``): leave every replica identical (a final average, the
        last pull); called once, before the final divergence check."""
        return None

    def replicas_identical(self, step: int, final: bool) -> bool:
        """Whether replicas must match after ``step`` (the same answer on every rank)."""
        return True

    def gate_at(self, step: int) -> str | None:
        """With ``gate_ahead``: what ``step``'s collectives are called in the gate's messages,
        or None where the step posts none (the same answer on every rank); the gate is armed
        at the block's entry of the steps named. Every step by default ("the step"); a
        periodic strategy's exchange steps only."""
        return "the step"

    def server_role(self) -> ServerRole | None:
        """The role of this rank if it is a server (after ``setup``); None on workers."""
        return None

    def trainable(self) -> list[torch.Tensor] | None:
        """After ``setup``: the tensors the user's optimizer steps, where they are no longer
        the model's parameters (``zero:3``: this rank's shards); None keeps the model's."""
        return None

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        """The model's part of this rank's checkpoint (plain tensors: ``zero:3`` gives this
        rank's shards where ``model.state_dict()`` would give DTensors)."""
        return model.state_dict()

    def load_model_state_dict(self, model: torch.nn.Module, state: dict[str, Any]) -> None:
        """Restore what ``model_state_dict`` saved."""
        model.load_state_dict(state)

    def unsharded(self) -> AbstractContextManager[None]:
        """``sync.unsharded()``: a context in which this rank holds every parameter whole, so
        that a forward on some ranks only needs no peer (entered on every rank: collective on
        entry where the parameters are sharded, ``zero:3``). Elsewhere every rank holds them
        whole already: nothing to do."""
        return contextlib.nullcontext()

    def forward_between_steps(self, *, training: bool) -> AbstractContextManager[None]:
        """Around a forward of ``gs.DistributedDataParallel`` outside a step block (a
        ``no_sync()`` micro-batch when ``training``, an evaluation otherwise), its buffer
        broadcast included: where such a forward is a collective (``zero:3``), one gate before
        it, named for what it is, so that a rank evaluating alone meets no peer's training
        forward. Elsewhere nothing: the forward posts no collective a peer could mistake."""
        del training
        return contextlib.nullcontext()

    def full_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        """``sync.full_state_dict()``, collective: ``{"model": ..., "optimizer": ...}`` as one
        process would hold them, on the group's first rank (None or anything elsewhere). The
        default is this rank's own, whole where every replica holds the whole state
        (``bsp``; rank 0's replica under ``local:H`` / ``diloco:H``)."""
        if self.servers:
            raise UsageError(
                f"{self.name} keeps the parameters and the optimizer state on its server "
                "ranks: there is no full state dict on a worker. Use sync.save(dir) and "
                "gradsync export (docs/checkpoints.md) for a checkpoint"
            )
        return {"model": model.state_dict(), "optimizer": own_optimizer_state(optimizer)}

    def load_full_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """``sync.load_full_state_dict(state)`` on every rank, with the same whole ``state``:
        each rank takes what it holds of it."""
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])

    def summary(self) -> dict[str, Any]:
        """After ``finalize``: what the strategy itself measured over the run, plain values for
        report.json (hogwild: updates applied and their staleness); empty for most."""
        return {}

    def relayout(self, saved: dict[str, Any] | None) -> dict[str, Any] | None:
        """Where this strategy's state in a checkpoint of as many ranks (``saved``, its
        ``state_dict()`` then) is cut otherwise than this run cuts it (ZeRO's rows or whole
        tensors): that state re-recorded for this run, and the checkpoint is dealt out anew by
        ``reshard``; None (the default): loaded as it is."""
        return None

    def reshard(self, saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """When ``reshardable``: this rank's ``"model"`` and ``"optimizer"`` state at the
        current world size, from every saved rank's checkpoint (``saved[r]`` is rank r's)."""
        raise UsageError(f"{self.name} cannot reshard its checkpoints for another world size")

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        return None

    def close(self) -> None:
        return None


def compressor_state_dict(state: Any) -> dict[str, Any]:
    """The ``{"compressor": ...}`` part of a strategy's state dict (residuals, factors)."""
    return {"compressor": state.state_dict() if state is not None else {}}


def load_compressor_state(state: Any, saved: dict[str, Any]) -> None:
    if state is not None:
        state.load_state_dict(saved.get("compressor", {}))


def live_exchange(ctx: SyncContext, group: Group) -> tuple[torch.dtype | None, Group]:
    """Under live membership, how a strategy's compressed exchange crosses the quorum: the
    16-bit type each replica's share is cast to (fp16/bf16, through the Manager's all-reduce),
    or None, and the group the compressor's state exchanges over: ``group`` as given, or the
    quorum's participants for any other compressor, whose own collectives run on them
    (``Membership.exchange``). Without membership or compression: None and ``group``."""
    if ctx.membership is None or ctx.compressor is ALLREDUCE:
        return None, group
    wire = CAST_WIRE.get(ctx.compressor.spec)
    return wire, group if wire is not None else ctx.membership.replicas


def wait_each(works: Iterable[Any], timeout_s: float | None) -> None:
    """Wait for each point-to-point request, ``timeout_s`` bounding each (None: the group's own
    timeout): gloo's send and receive waits keep the timeout the group was made with, not the
    ``timeout_s`` gradsync sets on it for its collectives, so a partner asleep in its block held
    a rank for as long as it slept (60 s of a --timeout 4 run, a user tester's)."""
    bound = None if timeout_s is None else datetime.timedelta(seconds=timeout_s)
    for work in works:
        if bound is None:
            work.wait()
        else:
            work.wait(timeout=bound)


def commit_or_skip(
    membership: Membership | None, step: int, optimizer: torch.optim.Optimizer, outcome: StepOutcome
) -> None:
    """Under live membership, asked every step (skipped or not: the quorum counts the steps
    it decided on): a step the quorum does not commit (a participant lost mid-exchange, or
    too few took part) is skipped on this replica, its gradient released; a later quorum
    heals the replica if its peers went on."""
    if membership is not None and not membership.commit(step):
        optimizer.zero_grad(set_to_none=True)
        outcome.skipped = True


__all__ = [
    "CheckpointHooks",
    "commit_or_skip",
    "wait_each",
    "live_exchange",
    "STRATEGY_FORMS",
    "CheckpointSink",
    "Layout",
    "ServerRole",
    "StepOutcome",
    "StepPlan",
    "Strategy",
    "StrategySpec",
    "SyncContext",
    "clip_grad_norm",
    "compressor_state_dict",
    "device_verdict",
    "scaler_on_device",
    "step_verdict",
    "load_compressor_state",
    "local_gradient",
    "own_optimizer_state",
    "reading_own_state",
    "optimizer_step",
    "parse_strategy_spec",
    "total_norm",
]
