"""ZeRO stage 3 (``zero:3``): parameters, gradients and optimizer state each held 1/N per rank,
by FSDP2's ``fully_shard``, with the user's optimizer still the one that steps.

What FSDP2 does here: ``fully_shard`` replaces each wrapped module's parameters by DTensors
sharded along their first dimension (uneven shards allowed), all-gathers a module's
parameters before its forward and again before its backward (freeing them after each, with
the next module's gather prefetched) and reduce-scatters its gradients as the backward pass
finishes them, so each rank receives only its shard of the mean gradient. That is stage 3
exactly, maintained in torch and tested on NCCL and gloo: gradsync wraps it rather than writing
its own (hooks that free and regather parameters around autograd are the part that is hard to
get right). Wrapping: each outermost element of an ``nn.Sequential`` or ``nn.ModuleList``
(a transformer's blocks, an MLP's layers) is one FSDP unit, gathered on its own, and the root
holds the rest; a model that shares a parameter between modules is wrapped at the root only
(FSDP2 needs a shared parameter inside one unit). Units of whole blocks rather than of every
module that owns a parameter: on the 2-layer ``charlm`` the latter made 14 gathers a pass and
the step 6x slower than ``bsp`` on gloo. A model the user already sharded with
``fully_shard`` is taken as it is, whatever their wrapping.

What gradsync adds: the user's optimizer keeps stepping. FSDP2 expects the optimizer to be
built after ``fully_shard``, over the DTensors; gradsync instead points each parameter the
optimizer holds at this rank's shard (``param.data`` becomes the local tensor FSDP2 gathers
from), and hands it this rank's shard of the gradient at the gradient-ready point. The
optimizer object, its param groups, hyper-parameters and schedulers are the user's, unchanged,
and it steps plain tensors (no DTensor dispatch per operation). For a pre-sharded model, whose
optimizer holds the DTensors, each is replaced in its param group by a plain parameter on the
same shard. Around that, the protocol's usual pieces: the mean over micro-batches (FSDP2
reduce-scatters every micro-batch's gradient and accumulates the shards, so no rank ever holds
the whole gradient), the non-finite skip agreed by one all-reduce of a flag (with a fused
optimizer left on the device as its ``found_inf``: the optimizer steps plain tensors, this
rank's rows, so it takes the flag as under ``zero:2``, and every rank skips on the global
one), the global gradient norm for clipping (the shards' sums combined), the GradScaler's
inf/NaN counts agreed as under ``zero:2``, checkpoints of this rank's shards (plain tensors).

Telemetry: FSDP2's collectives run inside the user's forward and backward, where the
Synchronizer's clock says compute. gradsync hands every FSDP2 module timed collectives through
FSDP2's public ``set_custom_all_gather`` / ``set_custom_reduce_scatter``, each wrapping the
collective the module had (FSDP2's default, or a user's own), so the memory and the call stay
FSDP2's or the user's. Each measures the wall time the calling thread spends in the call and
in the ``wait()`` of an asynchronous one (where FSDP2 blocks for it): the time the training
thread was held by communication, waiting for the slowest peer included. The step reports it
as ``comm_in_block``, which the Synchronizer counts as sync instead of compute, so ``idle``
(the wait for a slower rank, which under ``zero:3`` happens inside FSDP2's first gather), the
barrier tax and the straggler findings mean what they mean under ``bsp``. ``bytes_sent`` is
counted from the tensors FSDP2 hands the collectives: (N - 1)/N of the gathered output or of
the reduce-scatter's input, what each rank sends on a ring, FSDP2's padding included. On CUDA
with NCCL a collective returns once queued on FSDP2's stream, so the time measured is the
queuing (the GPU-side wait shows where the thread next synchronizes, as under every strategy).
Where torch has no custom collectives (before 2.9) or FSDP2 refuses them (a module with more
than one parameter group), nothing is wrapped: the collectives count as compute and
``bytes_sent`` is the schedule's (``_bytes_per_pass``).

Limits: the gradient exchange is FSDP2's, so compression is refused (as for ``zero:2``) and so
is ``balance`` (FSDP2 divides every gradient by the world size).

Between steps: a forward is a collective (FSDP2's gathers), so a DDP script's evaluation on
rank 0 alone would leave rank 0 in an all-gather and its peers at the next step's gate. Each
forward between steps first passes a gate of its own (``StepGate.before_user_collective``):
run on every rank it costs two store round trips; run on rank 0 alone every rank fails within
seconds, naming ``sync.unsharded()``, which gathers every parameter once on every rank so that
rank 0 can then evaluate alone. Every step and every forward between steps starts from the
shards on every rank (``_reshard``), since FSDP2 leaves the root gathered after a forward and
``model.state_dict()`` shards it again on the calling rank only. ``sync.full_state_dict()``
gathers every rank's shards of the model and of the optimizer state to rank 0 and puts them
together by rows; ``optimizer.state_dict()`` from the user's code (this rank's rows) and
torch's clip over the optimizer's tensors (their norm alone) are refused, naming the fix.

Checkpoints: each rank writes its shards of the parameters and of the optimizer state, as
plain tensors, in gradsync's own files (atomic, checksummed, written in the background, see
``gradsync.checkpoint``). Resuming on another number of ranks (``reshard``) reads every saved rank's
file and takes this rank's rows of each tensor put back together. Why not DCP: its save plans
every checkpoint with collectives, where gradsync's are written without any (a checkpoint
every step costs the training thread a copy), and FSDP2's row shards are put back together by
a concatenation; DCP would earn its place for layouts that are not rows of whole tensors
(tensor parallelism), which gradsync does not run.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed as dist

from gradsync import compat, runtime
from gradsync.checks.diagnose import BETWEEN
from gradsync.errors import UsageError
from gradsync.strategies.base import (
    StepOutcome,
    StepPlan,
    Strategy,
    SyncContext,
    device_verdict,
    own_optimizer_state,
    step_verdict,
)
from gradsync.strategies.passes import wrong_passes
from gradsync.strategies.zero_shards import (
    LocalClipGuard,
    agreed_nonfinite,
    gather_to_first,
    gloo_carries,
    on_cpu,
    refuse_partial_state,
    unscale_agreed,
)
from gradsync.telemetry.records import Span

__all__ = [
    "FORWARD_BETWEEN_STEPS",
    "TRAINING_FORWARD_BETWEEN_STEPS",
    "ZeroStage3",
    "shard_model",
]

#: the gate before a forward of the sharded model between steps, as every rank's message says
#: (the raw module's, in either form, or the front door's without gradients: both hints)
FORWARD_BETWEEN_STEPS = (
    "a forward of the zero:3 model between steps, a collective (FSDP2 gathers its parameters "
    "from every rank): every rank must run it. To evaluate on some ranks only, enter "
    "`with sync.unsharded():` (through gs.DistributedDataParallel: "
    "`with model.sync.unsharded():`) on every rank and evaluate inside it"
)

#: the gate before a training forward of ``gs.DistributedDataParallel`` outside a step block:
#: a step's first forward, whose buffers the wrapper broadcasts from rank 0 first (as DDP
#: does), or a ``no_sync()`` micro-batch's. Named apart from an evaluation's, so that the two
#: never meet
TRAINING_FORWARD_BETWEEN_STEPS = (
    "a training forward of the zero:3 model through gs.DistributedDataParallel before its "
    "step's exchange (the step's first forward, which broadcasts rank 0's buffers as DDP "
    "does, or a no_sync() micro-batch's), a collective every rank must run at the same point "
    "of its loop. To evaluate on some ranks only, enter `with model.sync.unsharded():` on "
    "every rank and evaluate inside it"
)


def _fsdp2() -> tuple[Any, Any, Any]:
    found = compat.fsdp2()
    if found is None:
        raise UsageError(
            f"zero:3 needs FSDP2 (fully_shard), which torch {torch.__version__} does not "
            "have; use zero:1 or zero:2, or torch >= 2.4"
        )
    return found


def _units(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The modules to wrap before the root: the outermost elements of an ``nn.Sequential`` or
    ``nn.ModuleList`` that hold parameters (a transformer's blocks, an MLP's layers), each one
    gather; none when a parameter is shared between modules (the root then holds everything)."""
    every = list(model.named_parameters(remove_duplicate=False))
    if len({id(p) for _, p in every}) != len(every):
        return []
    units: list[torch.nn.Module] = []

    def visit(module: torch.nn.Module) -> None:
        listed = isinstance(module, torch.nn.Sequential | torch.nn.ModuleList)
        for child in module.children():
            if listed and next(child.parameters(), None) is not None:
                units.append(child)
            else:
                visit(child)

    visit(model)
    return units


def refuse_gloo_off_host(backend: str, device_type: str) -> None:
    """FSDP2 exchanges through the flat all-gather and reduce-scatter, which gloo carries for
    host tensors only: refuse a model on a GPU over gloo (``backend`` as ``dist.get_backend``
    names it, ``"cpu:gloo,cuda:nccl"`` included) before FSDP2 fails inside a step."""
    if device_type != "cpu" and gloo_carries(backend, device_type):
        raise UsageError(
            f"zero:3 shards the model with FSDP2, whose collectives gloo does not carry for "
            f"{device_type} tensors, and this model is on {device_type} with a gloo group: use "
            "NCCL (gs.init() picks it where a GPU is visible), or zero:1 / zero:2, which run "
            "over gloo with the model on the GPU"
        )


def shard_model(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, group: dist.ProcessGroup | None
) -> list[tuple[torch.nn.Parameter, Any]]:
    """Shard ``model`` with FSDP2 (unless it is already) and point ``optimizer`` at this rank's
    shards; returns (the optimizer's parameter, the module's DTensor) per parameter."""
    fully_shard, dtensor, mesh_cls = _fsdp2()
    names = [n for n, _ in model.named_parameters()]
    if any(isinstance(p, dtensor) for p in model.parameters()):
        sharded = dict(model.named_parameters())
        return [(_repoint(optimizer, sharded[n]), sharded[n]) for n in names]
    empty = [n for n, p in model.named_parameters() if p.numel() == 0]
    if empty:  # FSDP2 fails on them inside the first step (_chunk_cat of no elements)
        raise UsageError(
            f"zero:3 cannot shard a parameter with no elements: {', '.join(map(repr, empty))}; "
            "remove it or register it as a buffer, or use zero:2, which takes it"
        )
    if any(optimizer.state.values()):
        raise UsageError(
            "zero:3 shards the parameters the optimizer holds, and this optimizer has state "
            "already (it stepped, or a state dict was loaded into it): build the Synchronizer "
            "before the first optimizer step, and restore checkpoints through sync.load()"
        )
    # The mesh is where the parameters are; a model on the CPU (or meta) goes where the
    # backend works, as FSDP2 moves it there (under NCCL, to this rank's GPU).
    device_type = next((p.device.type for p in model.parameters()), "cpu")
    if device_type in ("cpu", "meta"):
        device_type = runtime.device().type
    refuse_gloo_off_host(str(dist.get_backend(group)), device_type)
    mesh = mesh_cls.from_group(group or dist.group.WORLD, device_type)
    before = dict(model.named_parameters())
    for unit in _units(model):
        fully_shard(unit, mesh=mesh)
    fully_shard(model, mesh=mesh)
    after: dict[str, Any] = dict(model.named_parameters())
    pairs = []
    for n in names:
        mine, shard = before[n], after[n]
        with torch.no_grad():
            mine.data = shard.to_local()
        pairs.append((mine, shard))
    return pairs


def _repoint(optimizer: torch.optim.Optimizer, shard: Any) -> torch.nn.Parameter:
    """A plain parameter on ``shard``'s local tensor, in its place in ``optimizer`` (with its
    state, as plain tensors) when the optimizer holds ``shard``."""
    with torch.no_grad():
        mine = torch.nn.Parameter(shard.to_local(), requires_grad=shard.requires_grad)
    for group in optimizer.param_groups:
        params = group["params"]
        for i, p in enumerate(params):
            if p is shard:
                params[i] = mine
                state = optimizer.state.pop(shard, None)
                if state:
                    optimizer.state[mine] = {
                        k: v.to_local() if compat.is_dtensor(v) else v for k, v in state.items()
                    }
    return mine


class _Meter:
    """FSDP2's collectives on this rank since the step began: the seconds the calling thread
    was blocked in them, the bytes a ring sends for them, and (with spans on) one span each."""

    def __init__(self) -> None:
        #: whether FSDP2 calls the timed collectives (see ``_instrument``)
        self.active = False
        self.record_spans = False
        # The backward pass may run on autograd's device threads (CUDA), not the caller's.
        self._lock = threading.Lock()
        self.seconds, self.nbytes, self.spans = 0.0, 0, list[Span]()
        #: reduce-scatters per FSDP2 module (by its wrapper's id): one per backward pass that
        #: gave the module's parameters a gradient, so the most of them is the step's passes
        self.scatters: dict[int, int] = {}

    def reset(self) -> None:
        with self._lock:
            self.seconds, self.nbytes, self.spans = 0.0, 0, []
            self.scatters = {}

    def scattered(self, key: int) -> None:
        with self._lock:
            self.scatters[key] = self.scatters.get(key, 0) + 1

    def backward_passes(self) -> int:
        return max(self.scatters.values(), default=0)

    def add(self, name: str, wall0: float, seconds: float, nbytes: int) -> None:
        with self._lock:
            self.seconds += seconds
            self.nbytes += nbytes
            if self.record_spans:
                args = {"bytes": nbytes} if nbytes else None
                self.spans.append(Span(-1, -1, name, wall0, seconds, "comm", args))


class _TimedWork(dist.Work):
    """An asynchronous collective's handle, whose ``wait()`` (where FSDP2 blocks for it) is
    timed; FSDP2 checks for a ``Work``, hence the subclass."""

    def __init__(self, inner: dist.Work, meter: _Meter, name: str) -> None:
        super().__init__()
        self._inner, self._meter, self._name = inner, meter, name

    def wait(self, *args: Any, **kwargs: Any) -> bool:
        wall0, t0 = time.time(), time.perf_counter()
        try:
            return bool(self._inner.wait(*args, **kwargs))
        finally:
            self._meter.add(f"{self._name} wait", wall0, time.perf_counter() - t0, 0)

    def is_completed(self) -> bool:
        return bool(self._inner.is_completed())

    def get_future(self) -> Any:
        return self._inner.get_future()


class _TimedComm:
    """One of an FSDP2 module's collectives (``inner``: FSDP2's default or the user's own),
    timed and counted into ``meter``; allocating its buffers stays ``inner``'s."""

    name = "collective"

    def __init__(self, inner: Any, meter: _Meter) -> None:
        # A model handed to a second Synchronizer: wrap what the user had, not our wrapper.
        self.inner: Any = inner.inner if isinstance(inner, _TimedComm) else inner
        self.meter = meter

    def allocate(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        return self.inner.allocate(*args, **kwargs)  # type: ignore[no-any-return]

    def _timed(self, full: torch.Tensor, group: dist.ProcessGroup, run: Callable[[], Any]) -> Any:
        """``run()`` timed; ``full`` is the collective's whole buffer (the gathered output, the
        reduce-scatter's input), of which each rank sends (N - 1)/N on a ring."""
        world = group.size()
        nbytes = full.numel() * full.element_size() * (world - 1) // world
        wall0, t0 = time.time(), time.perf_counter()
        work = run()
        self.meter.add(self.name, wall0, time.perf_counter() - t0, nbytes)
        return _TimedWork(work, self.meter, self.name) if isinstance(work, dist.Work) else work


class _TimedAllGather(_TimedComm):
    name = "allgather"

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        async_op: bool = False,
    ) -> Any:
        def run() -> Any:
            return self.inner(
                output_tensor=output_tensor,
                input_tensor=input_tensor,
                group=group,
                async_op=async_op,
            )

        return self._timed(output_tensor, group, run)


class _TimedReduceScatter(_TimedComm):
    name = "reduce_scatter"

    def __call__(
        self,
        output_tensor: torch.Tensor,
        input_tensor: torch.Tensor,
        group: dist.ProcessGroup,
        op: Any,
        async_op: bool = False,
    ) -> Any:
        def run() -> Any:
            return self.inner(
                output_tensor=output_tensor,
                input_tensor=input_tensor,
                group=group,
                op=op,
                async_op=async_op,
            )

        self.meter.scattered(id(self))
        return self._timed(input_tensor, group, run)


def _instrument(model: torch.nn.Module, meter: _Meter) -> bool:
    """Have every FSDP2 module of ``model`` call timed collectives wrapping its own. All or
    nothing, so that no step reports some of FSDP2's traffic as communication and the rest as
    compute: False, with nothing changed, where this torch cannot replace them or a module has
    several parameter groups (FSDP2 refuses custom collectives there)."""
    found: list[tuple[Any, Any, Any]] = []
    for module in model.modules():
        if not compat.is_fsdp_module(module):
            continue
        comms = compat.fsdp_comms(module)
        if comms is None or len(comms) > 1:
            return False
        found.extend((module, gather, scatter) for gather, scatter in comms)
    for module, gather, scatter in found:
        module.set_custom_all_gather(_TimedAllGather(gather, meter))
        module.set_custom_reduce_scatter(_TimedReduceScatter(scatter, meter))
    return bool(found)


class ZeroStage3(Strategy):
    """``zero:3``: FSDP2's sharded forward and backward, the user's optimizer on the shards."""

    name = "zero:3"
    #: each rank's file holds its own shards, which ``reshard`` splits anew for another size
    resizable = False
    lockstep = True
    reshardable = True
    takes_sharded_models = True
    #: every step ends with the ranks in step (FSDP2's collectives): gated at the block's entry,
    #: and buffers (not sharded) kept in agreement from rank 0, as under ``bsp``
    replicates_every_step = True
    collectives_in_block = True

    def __init__(self) -> None:
        self._ctx: SyncContext | None = None
        self._pairs: list[tuple[torch.nn.Parameter, Any]] = []
        self._average_over = 1
        self._passes = 1
        self._meter = _Meter()
        self._counts_passes = False  # the backward passes checked (gradients_ready)
        #: refuses torch's clip of this rank's shards by their own norm (``LocalClipGuard``)
        self._clip_guard = LocalClipGuard(self.name)
        self._hooks: list[Any] = []
        #: the FSDP2 modules of the model (its blocks, then the root), listed once
        self._modules: list[Any] = []
        #: inside ``sync.unsharded()``: every parameter is gathered on this rank
        self._unsharded = False
        #: the front door's forward passed its gate already (``forward_between_steps``)
        self._forward_gated = False
        #: ``model.state_dict()`` ran inside it, and put this rank's parameters back to shards
        self._resharded_inside = False

    def setup(self, ctx: SyncContext) -> None:
        if ctx.compressor.spec != "none":
            from gradsync.strategies.zero import refuse_compression

            refuse_compression(3, ctx.compressor.spec)
        if ctx.scaling and compat.scaler_unscaled(ctx.scaler, ctx.optimizer) is None:
            raise UsageError(
                "zero:3 cannot use this torch's GradScaler (it hides the state needed to agree "
                "on the inf/NaN check across ranks); use bf16 autocast (no scaler)"
            )
        self._ctx = ctx
        self._pairs = shard_model(ctx.model, ctx.optimizer, ctx.group)
        self._meter.active = _instrument(ctx.model, self._meter)
        self._counts_passes = self._meter.active and runtime.world_size(ctx.group) > 1
        self._meter.record_spans = ctx.record_spans
        self._modules = [m for m in ctx.model.modules() if compat.is_fsdp_module(m)]
        self._hooks = [
            # before FSDP2's own pre-forward (prepend), which would post the first all-gather
            ctx.model.register_forward_pre_hook(self._before_forward, prepend=True),
            ctx.model.register_state_dict_pre_hook(self._on_state_dict),
            refuse_partial_state(ctx.optimizer, self.name),
        ]

    def _reshard(self) -> None:
        """Every FSDP2 module back to its shards (local: frees the gathered parameters). FSDP2
        leaves the root's parameters gathered after a forward (for the backward that usually
        follows), and ``model.state_dict()`` shards them again on the rank that calls it: the
        ranks' next forwards would then differ by one all-gather and wait in different
        collectives. Every rank starts each step, and each forward between steps, sharded."""
        for module in self._modules:
            module.reshard()

    def _before_forward(self, module: torch.nn.Module, args: Any) -> None:
        """A forward between steps posts FSDP2's all-gathers, which every rank must join: pass
        a gate first, so that a forward on rank 0 alone (an evaluation) is reported at once,
        naming ``sync.unsharded()``, on every rank, instead of leaving rank 0 in an all-gather
        while its peers wait for the next step (``StepGate.before_user_collective``)."""
        if self._unsharded and self._resharded_inside:
            raise UsageError(
                "a forward inside sync.unsharded() after model.state_dict(): FSDP2 put this "
                "rank's parameters back to shards for the state dict, so this forward would "
                "gather them again, a collective the other ranks are not in. Take the state "
                "dict after the forwards (or sync.full_state_dict() on every rank, outside; "
                "model.sync.full_state_dict() through gs.DistributedDataParallel)"
            )
        if not self._forward_gated:
            self._gate_forward(FORWARD_BETWEEN_STEPS)

    def _gate_forward(self, what: str) -> bool:
        """Between steps, outside ``sync.unsharded()``: shard every module and pass a gate
        named ``what`` before the forward's collectives. Whether it did."""
        ctx = self._ctx
        if ctx is None or self._unsharded or ctx.watch is None:
            return False
        phase, step, _ = ctx.watch.phase
        if phase != BETWEEN:  # inside a step block (or a gradsync call): in step already
            return False
        self._reshard()
        # FSDP2's record of the forwards since the last backward (its backward prefetch) as
        # begin_step leaves it: after sync.unsharded(), a no_sync() micro-batch's backward on
        # rank 0 prefetched an all-gather its peer never posted (the front-door tester's hang)
        compat.fsdp_forget_forwards(self._modules)
        if ctx.gate is not None:
            ctx.gate.before_user_collective(step + 1, what)
        return True

    @contextmanager
    def forward_between_steps(self, *, training: bool) -> Iterator[None]:
        """The front door's forward outside a step block, its buffer broadcast included, under
        one gate (``Strategy.forward_between_steps``): a ``no_sync()`` micro-batch's gate is
        named apart from an evaluation's, so a rank evaluating alone (the raw module, or the
        wrapper without gradients) and a peer training never pair their collectives; both
        fail within seconds naming ``sync.unsharded()``."""
        what = TRAINING_FORWARD_BETWEEN_STEPS if training else FORWARD_BETWEEN_STEPS
        self._forward_gated = self._gate_forward(what)
        try:
            yield
        finally:
            self._forward_gated = False

    def _on_state_dict(self, *_: Any) -> None:
        if self._unsharded:
            self._resharded_inside = True

    @contextmanager
    def unsharded(self) -> Iterator[None]:
        """Every FSDP2 module's parameters gathered on this rank (FSDP2's ``unshard()``: one
        all-gather per module, on every rank) and kept gathered through forwards (reshard after
        forward off) until exit, which frees them again on this rank alone (no collective). In
        between, a forward needs no peer: rank 0 may evaluate alone. Costs the whole model's
        parameters in memory on every rank for its duration."""
        if self._unsharded:
            raise UsageError("sync.unsharded() blocks cannot be nested")
        modules = self._modules
        root = self._ctx.model if self._ctx is not None else None
        for m in modules:
            m.set_reshard_after_forward(False, recurse=False)
        try:
            self._collective(
                None,
                "sync.unsharded() (all-gather of every parameter)",
                lambda: [m.unshard() for m in modules],
            )
            self._unsharded, self._resharded_inside = True, False
            yield
        finally:
            self._unsharded = False
            for m in modules:
                m.reshard()
                # FSDP2's defaults back: shards freed after each block's forward, the root's
                # kept for the backward that follows it
                m.set_reshard_after_forward(m is not root, recurse=False)

    def trainable(self) -> list[torch.Tensor] | None:
        return [mine for mine, shard in self._pairs if shard.requires_grad]

    def begin_step(self, plan: StepPlan) -> None:
        if self._unsharded:
            raise UsageError(
                "sync.step() inside sync.unsharded(): the step's forward and backward need the "
                "parameters sharded; leave the unsharded() block (every rank) before the step"
            )
        self._reshard()
        # A forward since the last backward (rank 0's evaluation inside sync.unsharded()) is
        # in FSDP2's forward order, which its backward prefetch follows: rank 0 would post an
        # all-gather its peers do not.
        compat.fsdp_forget_forwards(self._modules)
        self._average_over = plan.average_over
        self._passes = plan.micro_batches
        if self._ctx is not None:
            self._ctx.found_inf = None  # a verdict a raising update left behind
        self._meter.reset()  # collectives between steps (an evaluation forward) are not the step's
        # Released, as a DDP script's zero_grad(set_to_none=True): FSDP2 would add this step's
        # shards to the last ones, and the optimizer's parameter holds a view of the same
        # storage (gradients_ready), which kept last step's gradient shards (1/N of the model)
        # alive through this step's forward and backward, on top of the new ones (issue 47).
        for mine, shard in self._pairs:
            shard.grad = None
            mine.grad = None

    def gradients_ready(self, step: int) -> StepOutcome:
        ctx = self._ctx
        assert ctx is not None, "setup() has not run"
        # Counted from FSDP2's reduce-scatters where gradsync times them (``_instrument``):
        # the gradient is divided by the passes announced, so another count would scale the
        # update silently. (Unchecked where this torch cannot time them, and in a world of
        # one, where FSDP2 posts no reduce-scatter.)
        passes = self._meter.backward_passes() if self._counts_passes else self._passes
        if passes != self._passes:
            raise wrong_passes(self._passes, passes)
        grads = []
        with torch.no_grad():
            for mine, shard in self._pairs:
                # FSDP2 may re-allocate a shard (padding it, at its first forward): follow it.
                local = shard.to_local()
                if mine.data_ptr() != local.data_ptr() or mine.shape != local.shape:
                    mine.data = local
                mine.grad = None if shard.grad is None else shard.grad.to_local()
                if mine.grad is not None:
                    grads.append(mine.grad)
        # Measured bytes are added in update(), once every collective of the step has run.
        outcome = StepOutcome(
            bytes_sent=0 if self._meter.active else self._passes * self._bytes_per_pass()
        )
        if device_verdict(ctx):
            # Each rank steps its own rows: the agreed flag stays on the device and gates
            # every rank's fused update alike (``optimizer_step``), with no host read. Only
            # once an update was applied (``device_verdict``), known to every rank alike.
            ctx.found_inf = outcome.found_inf = self._agreed_flag(step, grads)
        elif ctx.skip_nonfinite and not ctx.scaling and self._agreed_flag(step, grads).item():
            outcome.skipped = True
            return outcome
        if self._average_over > 1:
            compat.foreach_div(grads, float(self._average_over))
        # The tensors the optimizer holds are this rank's rows: torch's clip over them would
        # take their norm alone. (Over model.parameters(), FSDP2's DTensors, it is global.)
        self._clip_guard.arm(grads)
        return outcome

    def _bytes_per_pass(self) -> int:
        """Bytes this rank sends per micro-batch: (N - 1)/N of the parameters' bytes for each
        of the forward gather, the backward gather and the gradient's reduce-scatter."""
        world = runtime.world_size(self._group())
        total = sum(s.numel() * s.element_size() for _, s in self._pairs)
        return 3 * total * (world - 1) // world

    def _group(self) -> dist.ProcessGroup | None:
        return self._ctx.group if self._ctx is not None else None

    def _collective(self, step: int | None, what: str, run: Any) -> None:
        watch = self._ctx.watch if self._ctx is not None else None
        run() if watch is None else watch.run(step, what, run)

    def _agreed_flag(self, step: int, grads: list[torch.Tensor]) -> torch.Tensor:
        """Whether some rank's shards of the gradient are not finite: a 0-d flag on the
        device (1.0: not finite), one all-reduce of a flag (``agreed_nonfinite``)."""
        return agreed_nonfinite(
            grads,
            lambda what, run: self._collective(step, what, run),
            "zero:3 non-finite check (all-reduce of a flag)",
            self._group(),
        )

    def grad_norm(self, params: Sequence[torch.Tensor], norm_type: float = 2.0) -> torch.Tensor:
        """The whole gradient's norm from every rank's shard: one all-reduce."""
        with self._clip_guard.exempt():
            return self._global_norm([p.grad for p in params if p.grad is not None], norm_type)

    def _global_norm(self, grads: list[torch.Tensor], norm_type: float) -> torch.Tensor:
        dtype = grads[0].dtype if grads else torch.float32
        device = runtime.device()
        if norm_type == float("inf"):
            part = max((g.abs().max() for g in grads if g.numel()), default=None)
            value = torch.zeros((), dtype=dtype, device=device) if part is None else part
            value = value.to(device).reshape(1).clone()
            op = dist.ReduceOp.MAX
        else:
            value = torch.zeros(1, dtype=dtype, device=device)
            for g in grads:
                value += torch.linalg.vector_norm(g, norm_type).to(device) ** norm_type
            op = dist.ReduceOp.SUM

        def combine() -> None:
            dist.all_reduce(value, op=op, group=self._group())

        self._collective(None, "zero:3 gradient norm (all-reduce)", combine)
        total = value.reshape(())
        return total if op == dist.ReduceOp.MAX else total ** (1.0 / norm_type)

    def update(self, step: int, outcome: StepOutcome) -> StepOutcome:
        self._clip_guard.disarm()
        ctx = self._ctx
        assert ctx is not None, "setup() has not run"
        self._account(outcome)
        if outcome.skipped:
            return outcome
        if ctx.scaling:
            unscale_agreed(
                ctx, lambda what, run: self._collective(step, what, run), self.name, False
            )
        wall0, t0 = time.time(), time.perf_counter()
        step_verdict(ctx, outcome)
        if ctx.record_spans:
            outcome.spans.append(Span(-1, -1, "optimizer", wall0, time.perf_counter() - t0, "step"))
        return outcome

    def _account(self, outcome: StepOutcome) -> None:
        """The step's FSDP2 collectives, as measured since ``begin_step``: their time is sync
        (the Synchronizer takes it out of compute), their bytes the step's."""
        meter = self._meter
        if not meter.active:
            return
        outcome.comm_in_block += meter.seconds
        outcome.bytes_sent += meter.nbytes
        outcome.spans.extend(meter.spans)

    def replicas_identical(self, step: int, final: bool) -> bool:
        # Each shard exists on one rank only: there are no replicas to compare.
        return False

    def model_state_dict(self, model: torch.nn.Module) -> dict[str, Any]:
        with torch.no_grad():
            return {
                k: v.to_local() if compat.is_dtensor(v) else v
                for k, v in model.state_dict().items()
            }

    def load_model_state_dict(self, model: torch.nn.Module, state: dict[str, Any]) -> None:
        current = model.state_dict()
        missing = sorted(set(current) - set(state))
        unexpected = sorted(set(state) - set(current))
        if missing or unexpected:
            raise UsageError(
                f"zero:3 checkpoint does not fit this model: missing {missing[:3]}, "
                f"unexpected {unexpected[:3]}"
            )
        with torch.no_grad():
            for k, v in current.items():
                target = v.to_local() if compat.is_dtensor(v) else v
                if target.shape != state[k].shape:
                    raise UsageError(
                        f"zero:3 checkpoint's shard of {k} is {tuple(state[k].shape)}, this "
                        f"rank's is {tuple(target.shape)}: the checkpoint is another model's"
                    )
                target.copy_(state[k])

    def full_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer
    ) -> dict[str, Any] | None:
        """Every rank's shards of the parameters and of the optimizer state, gathered to rank
        0 (CPU copies, one gather) and put together by rows, as ``reshard`` does for one rank."""
        mine = {"model": self.model_state_dict(model), "optimizer": own_optimizer_state(optimizer)}
        parts = gather_to_first(
            self._ctx_or_fail(),
            on_cpu(mine),
            lambda w, run: self._collective(None, w, run),
            "zero:3",
        )
        return None if parts is None else self._put_together(parts, 1, 0)

    def load_full_state_dict(
        self, model: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict[str, Any]
    ) -> None:
        """This rank's rows of a whole state (``full_state_dict``'s, or a DDP script's)."""
        part = self.reshard([state])
        self.load_model_state_dict(model, part["model"])
        optimizer.load_state_dict(part["optimizer"])

    def close(self) -> None:
        self._clip_guard.disarm()
        for hook in self._hooks:
            hook.remove()
        self._hooks = []

    def _ctx_or_fail(self) -> SyncContext:
        assert self._ctx is not None, "setup() has not run"
        return self._ctx

    def reshard(self, saved: Sequence[dict[str, Any]]) -> dict[str, Any]:
        """This rank's model and optimizer state on the current number of ranks from every
        saved rank's shards: FSDP2 splits each tensor by rows as ``torch.chunk`` does, so the
        saved shards end to end are the whole tensor, and this rank takes its rows of it. A
        state tensor of a parameter's shard shape (momentum, Adam's moments) is split as its
        parameter; one of another shape (Adam's step count) is the same on every rank."""
        ctx = self._ctx_or_fail()
        return self._put_together(saved, runtime.world_size(ctx.group), ctx.rank)

    def _put_together(
        self, saved: Sequence[dict[str, Any]], world: int, rank: int
    ) -> dict[str, Any]:
        """``rank``'s rows of every sharded tensor of ``saved`` (every rank's shards, in rank
        order) split over ``world`` ranks: this rank's part for ``reshard``; with one rank,
        the whole tensors (``full_state_dict``)."""
        ctx = self._ctx_or_fail()
        whole = world == 1
        current = self.model_state_dict(ctx.model)
        model = {
            k: _rows(
                torch.cat([s["model"][k] for s in saved]),
                world,
                rank,
                k,
                v.shape if whole else now.shape,
            )
            if compat.is_dtensor(v)
            else saved[0]["model"][k]
            for (k, now), v in zip(current.items(), ctx.model.state_dict().values(), strict=True)
        }
        full_shape = {id(mine): shard.shape for mine, shard in self._pairs}
        params = [p for group in ctx.optimizer.param_groups for p in group["params"]]
        first = saved[0]["optimizer"]
        state: dict[Any, Any] = {}
        for i, entry in first["state"].items():
            param = params[int(i)]
            shape = full_shape.get(id(param), param.shape) if whole else param.shape
            state[i] = {
                key: _rows(
                    torch.cat([s["optimizer"]["state"][i][key] for s in saved]),
                    world,
                    rank,
                    f"optimizer state {key!r} of parameter {i}",
                    shape,
                )
                if value.dim() > 0
                else value
                for key, value in entry.items()
            }
        return {"model": model, "optimizer": {**first, "state": state}}


def _rows(whole: torch.Tensor, world: int, rank: int, what: str, shape: Any) -> torch.Tensor:
    """``rank``'s rows of ``whole`` as FSDP2 splits it over ``world`` ranks (``torch.chunk``,
    ranks past the last chunk holding none), checked against the shard this rank holds."""
    chunks = torch.chunk(whole, world, dim=0)
    mine = chunks[rank] if rank < len(chunks) else whole[:0]
    if mine.shape != shape:
        raise UsageError(
            f"zero:3 cannot reshard {what}: the saved shards make a {tuple(whole.shape)} tensor, "
            f"whose rows for rank {rank} of {world} are {tuple(mine.shape)}, but this rank holds "
            f"{tuple(shape)}"
        )
    return mine.clone()
