"""``gs.DistributedDataParallel``: DDP's front door over the ``Synchronizer``.

A DDP script ports by changing its ``DistributedDataParallel(model)`` line (and the import)::

    from gradsync import DistributedDataParallel as DDP
    model = DDP(model, optimizer=optimizer)          # was: DDP(model)

and nothing else: ``no_sync()`` / ``require_backward_grad_sync`` for accumulation,
``loss.backward()``, ``scaler.scale / unscale_ / step / update``, ``clip_grad_norm_``,
``optimizer.step()``, ``zero_grad()``, ``model.module`` and ``state_dict()`` keep their DDP
meaning, and under ``bsp``, ``zero:1``, ``zero:2`` and ``zero:3`` the run ends where DDP's does
(bit for bit in the tests, fp32 on gloo).

Why this shape. The alternatives were a wrapped optimizer to use instead of the user's
(``model, optimizer = gs.wrap(model, optimizer)``, as torchft's ``OptimizerWrapper``) or an
explicit superstep (``with sync.step():``, the Synchronizer's own form). A wrapped optimizer
is a second object: LR schedulers and GradScalers built on the original one before the wrap
(both example scripts build their scheduler first) would then step a different object than
the one the loop steps, and the port touches two lines of the loop's set-up instead of one.
The explicit form re-indents the micro-step loop and moves the clip (49 changed lines in the
examples). Here the user's optimizer object stays the one everything holds; its ``step`` is
routed through this wrapper on that instance, the way torch's own LR schedulers route it
(``LRScheduler`` sets an instance ``step`` that counts calls), so a scheduler built before or
after the wrap still sees every step. Only ``optimizer=`` is new on the wrap line, because the
update is gradsync's to run (under ``zero:1`` each rank steps its own tensors, under
``local:H`` / ``diloco:H`` an average or outer step follows some steps).

How the DDP loop maps onto one ``sync.step()`` superstep (the Synchronizer's public API only):

- The block is entered at the forward pass whose backward synchronizes (gradients enabled,
  outside ``no_sync()``), with ``micro_batches=1``: the micro-batches run under ``no_sync()``
  before it only accumulate into ``p.grad``, locally, as under DDP. The block's entry releases
  ``p.grad`` (the Synchronizer zeroes gradients for its own form); the gradients accumulated
  so far are put back right after, so the last backward pass adds to them exactly as DDP's
  does, and the exchange carries their sum (DDP's arithmetic: the script divides by k).
- The exchange completes at the end of that backward pass, as DDP's does: the first gradient
  to arrive queues an autograd end-of-backward callback (``compat.queue_end_of_backward``)
  that calls ``s.synchronize()``. So when ``loss.backward()`` returns, ``p.grad`` holds the
  mean over ranks and the user's ``unscale_`` and ``clip_grad_norm_`` cannot race the
  exchange: there is nothing left in flight.
- ``optimizer.step()`` (directly, or from ``scaler.step(optimizer)`` when the scaler finds the
  gradient finite) exits the block; the block's exit calls ``optimizer.step()`` again, which
  this routing turns into the original step, once. So the strategy's update, and what follows
  it (``zero:1``'s gather, an average every H steps), run inside the user's call, and the
  Synchronizer's double-step check stays meaningful.
- A step the GradScaler skips never calls ``optimizer.step()``: the block is then closed,
  without an update, by the next forward pass (before any gradient of the next step exists).
- Buffers (BatchNorm statistics) are broadcast from rank 0 where DDP broadcasts them: at a
  forward pass that follows a synchronizing one, i.e. the first micro-batch of each step (the
  block starts at the last one, so the Synchronizer's own broadcast is turned off).

Non-finite gradients follow DDP too (``skip_nonfinite=False`` by default): an enabled
GradScaler sees them and skips, which it could not if gradsync dropped them first; without a
scaler pass ``skip_nonfinite=True`` to have gradsync skip such steps on every rank.

Sharded gradients (``zero:2``, ``zero:3``): after the exchange each rank holds a part of the
mean gradient, so torch's ``clip_grad_norm_`` over the loop's parameters must combine the
parts' norms, and the GradScaler's inf/NaN check must be the same on every rank (DDP's
all-reduce leaves a non-finite value on every rank; a reduce-scatter leaves it on its owner
only, and a rank whose scaler skips while another steps would leave the replicas apart).

- ``zero:2``: from the end of backward to ``optimizer.step()``, ``p.grad`` of every parameter
  is a DTensor over the group sharded on dim 0, whose rows are all on the owner's rank (its
  local tensor the exchange's buffer, so in-place changes reach the update) and none on the
  others' (``_ShardView``). torch's clip of DTensor gradients takes the whole norm (one
  all-reduce), and DTensor reduces the GradScaler's ``found_inf`` over the group, as they do
  for FSDP2's gradients; every rank holds a DTensor for every parameter, so a clip of a subset
  (the same on every rank) posts the same collectives everywhere. ``optimizer.step()`` puts
  the plain gradients back (None for the others' tensors) before the sharded update.
- ``zero:3``: the module is FSDP2's after the wrap (``model.module`` holds its DTensors), whose
  gradients are DTensors already: torch's clip over ``model.parameters()`` takes the whole
  norm by itself. The optimizer's tensors are this rank's shards, plain, so the scaler's check
  on them is local: at the end of backward one one-element all-reduce tells every rank whether
  any shard is non-finite, and if so every rank's shards become NaN (DDP's outcome: every
  rank's scaler skips). ``no_sync()`` is FSDP2's ``set_requires_gradient_sync(False)``:
  unsharded gradients accumulate locally, as under DDP, and the last micro-batch's
  reduce-scatter carries their sum. FSDP2's sharded parameters never accumulate a gradient
  (FSDP2 assigns their shards), so the end of backward is found from hooks on the forward's
  outputs, and the exchange's end is queued behind FSDP2's own end-of-backward callback.
  torch's clip over the optimizer's tensors (this rank's shards) would take their norm alone:
  clip ``model.parameters()``. gradsync's ``LocalClipGuard``, which refuses that in the
  explicit form, cannot work here: a torch function mode entered in an end-of-backward
  callback does not outlive the backward pass.

Refused at construction, naming the explicit ``sync.step()`` form instead: the
parameter-server strategies (servers run ``sync.serve()`` on ranks of their own) and
``hogwild``.
"""

from __future__ import annotations

import contextlib
import functools
import math
import sys
import types
import warnings
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync import compat, runtime
from gradsync.attached_run import called_as
from gradsync.checks.guards import all_finite
from gradsync.errors import UsageError
from gradsync.flat import copy_into, flatten
from gradsync.strategies import parse_strategy
from gradsync.synchronizer import StepHandle, Synchronizer, finish_exchange, steps_none_of

#: strategies whose update fits DDP's loop: the whole mean gradient (or this rank's own, for
#: the periodic ones) in ``p.grad`` at the end of backward, the update in ``optimizer.step()``
SUPPORTED = ("bsp", "zero:1", "zero:2", "zero:3", "local", "diloco", "gossip", "noloco")

#: why each other strategy is refused, and what to use
REFUSED = {
    "ssp": "parameter servers run sync.serve() on ranks of their own and step the optimizer there",
    "async": "parameter servers run sync.serve() on ranks of their own and step the optimizer "
    "there",
    "hogwild": "its workers update shared parameters without any exchange to wait for",
}

#: Synchronizer options the front door decides itself, and why
OWN_OPTIONS = {
    "scaler": "keep calling scaler.scale / unscale_ / step / update in the loop, as under DDP: "
    "the front door routes the optimizer.step() the scaler makes",
    "accumulation": "gradients accumulate as under DDP: divide each micro-batch's loss by k "
    "and run the first k-1 backward passes under model.no_sync()",
}


def check_strategy(name: str) -> None:
    """``UsageError`` for a strategy (by its ``name``) the front door cannot drive, naming
    what to use instead."""
    kind = "ssp" if name.startswith("ssp") else name
    if kind in SUPPORTED:
        return
    why = REFUSED.get(kind, "it is not one the front door knows how to drive")
    raise UsageError(
        f"gs.DistributedDataParallel cannot run strategy {name!r}: {why}. It runs bsp, "
        f"zero:1, zero:2, zero:3, local:H, diloco:H, gossip:H and noloco:H; for {name} use the "
        "explicit form, "
        f"sync = gs.Synchronizer(model, optimizer, strategy={name!r}) with "
        "`with sync.step(micro_batches=k) as s:` (docs/porting.md)"
    )


@dataclass(slots=True)
class _Exit:
    """The block's exit in progress: whether the user's step asked for the update."""

    apply: bool
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    result: Any = None


class _OpenStep:
    """One ``sync.step()`` block held open across the user's calls, from the synchronizing
    forward pass to ``optimizer.step()``."""

    def __init__(self, sync: Synchronizer) -> None:
        self._block = sync.step(micro_batches=1)
        self.handle: StepHandle = self._block.__enter__()
        #: a gradient of the synchronizing backward pass arrived
        self.backward_seen = False
        #: s.synchronize() ran: p.grad holds the gradient the update will use
        self.synchronized = False

    def synchronize(self, verdict: bool = True) -> bool:
        """``s.synchronize()`` once: True when this call finished the exchange and the update
        will be applied (not when gradsync skips the step, ``skip_nonfinite``). Without
        ``verdict`` the skip is not asked (True all the same): where it is decided on the
        device (a fused optimizer), asking would make the host wait for the device."""
        if self.synchronized:
            return False
        self.synchronized = True
        if not verdict:
            finish_exchange(self.handle)
            return True
        return self.handle.synchronize()

    def close(self) -> None:
        self._block.__exit__(None, None, None)


class _ApartReplicas:
    """Under a strategy whose replicas differ between its averages (``local:H``, ``diloco:H``,
    ``gossip:H``, ``noloco:H``), the warnings of a script that never calls ``model.report()``
    (a DDP script has no such call), whose replicas would end apart without a word: one when
    the model's state is taken while they are apart (``model.state_dict()`` or
    ``model.module.state_dict()``, what scripts save as the final model), and one on every
    rank at the wrapper's collection or the interpreter's exit. Neither posts a collective:
    one there would hang wherever the ranks disagree (one of them failed, or saves alone)."""

    def __init__(self, sync: Synchronizer) -> None:
        self._sync = sync
        self._warned_state = False

    def apart(self) -> bool:
        """Whether the last step left the replicas apart and no ``report()`` has joined them
        since (the same answer on every rank)."""
        sync, steps = self._sync, self._sync.step_count
        joined = sync.finalized_at is not None and sync.finalized_at >= steps
        return steps > 0 and not joined and not sync.strategy.replicas_identical(steps - 1, False)

    def _where(self) -> str:
        strategy = self._sync.strategy
        name = strategy.settings_spec() or strategy.name
        why = (
            "its pair exchanges never average every replica before report()"
            if strategy.name in ("gossip", "noloco")
            else "each rank's holds its own local steps since the last average"
        )
        return (
            f"under {name} after step {self._sync.step_count - 1} without model.report(): the "
            f"replicas differ ({why})"
        )

    _FIX = (
        "Call model.report() on every rank after the training loop, before saving the final "
        "model and before destroy_process_group(): it averages the unfinished period so the "
        "replicas end identical (docs/porting.md, 'model.report() under local:H')"
    )

    def on_state_dict(self, *_: Any) -> None:
        if self._warned_state or self._sync.busy or not self.apart():
            return  # gradsync's own save / full_state_dict, or the replicas agree
        self._warned_state = True
        rank = self._sync.rank
        warnings.warn(
            f"gradsync: rank {rank} took model.state_dict() {self._where()}, so it is rank "
            f"{rank}'s replica alone, not a model the ranks agree on. {self._FIX}; for a "
            "checkpoint to resume from mid-period, model.sync.save(dir) on every rank",
            RuntimeWarning,
            stacklevel=3,
        )

    def at_exit(self) -> None:
        # a script that failed (Python set sys.last_value as it printed the exception) has
        # its own error to show; this would only bury it
        if getattr(sys, "last_value", None) is not None or not self.apart():
            return
        # no source line to point at: the script has ended (or dropped the wrapper)
        warnings.warn_explicit(
            f"gradsync: rank {self._sync.rank} ends {self._where()}, and they end so. {self._FIX}",
            RuntimeWarning,
            "<gradsync at exit>",
            0,
        )


class DistributedDataParallel(nn.Module):
    """``torch.nn.parallel.DistributedDataParallel``'s surface over a ``gs.Synchronizer``.

    ``model = gs.DistributedDataParallel(model, optimizer=optimizer)`` in place of
    ``DDP(model)``; the rest of a DDP loop stays as it is (the module docstring says how).
    ``optimizer`` is the one the loop steps, built on ``model.parameters()`` before the wrap.
    ``strategy``, ``compression`` and any other keyword (``timeout_s``, ``telemetry``,
    ``check_every``, ...) go to the Synchronizer, which is ``model.sync``: ``model.sync.save``,
    ``model.sync.full_state_dict`` and the others work as in the explicit form.

    DDP's own options: ``device_ids`` (one device, the module's), ``output_device``,
    ``broadcast_buffers``, ``process_group`` and ``bucket_cap_mb`` keep their meaning;
    ``find_unused_parameters`` as DDP's under ``bsp`` (a parameter no rank used keeps
    ``grad`` None; without it, or under another strategy, it gets a zero gradient, so momentum
    or weight decay still move it); ``gradient_as_bucket_view`` and ``static_graph`` are
    accepted and need nothing (gradients are bucket views already).

    Call ``model.report()`` on every rank at the end of training (before
    ``destroy_process_group``) for gradsync's timing report and final checks; under
    ``local:H`` / ``diloco:H`` it also closes an unfinished period with a last average, so the
    replicas end identical (``gossip:H`` / ``noloco:H``: averages every replica). Under
    ``bsp`` and ``zero:1/2/3`` it is optional. Under the others a script without it (a DDP
    script has none) is warned, with no collective: once when the model's state is taken while
    the replicas differ, and on every rank at the wrapper's collection or the interpreter's
    exit (``_ApartReplicas``).
    """

    def __init__(
        self,
        module: nn.Module,
        device_ids: list[int | torch.device] | None = None,
        output_device: int | torch.device | None = None,
        *,
        optimizer: torch.optim.Optimizer | None = None,
        strategy: str | Any | None = None,
        compression: str | Any | None = None,
        broadcast_buffers: bool = True,
        process_group: dist.ProcessGroup | None = None,
        bucket_cap_mb: float | None = None,
        find_unused_parameters: bool = False,
        gradient_as_bucket_view: bool = False,
        static_graph: bool = False,
        skip_nonfinite: bool = False,
        **options: Any,
    ) -> None:
        super().__init__()
        # accepted for DDP's sake and needing nothing here (the class docstring says why)
        del gradient_as_bucket_view, static_graph
        _check_arguments(module, optimizer, device_ids, output_device, strategy, options)
        assert optimizer is not None
        self.module = module
        #: DDP's flags: no_sync() clears the first; the second says whether this forward
        #: follows a synchronizing one (then buffers are broadcast first, as DDP does)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        with called_as("gs.DistributedDataParallel(model, ...)"):
            self.sync = Synchronizer(
                module,
                optimizer,
                strategy,
                compression,
                25.0 if bucket_cap_mb is None else bucket_cap_mb,
                group=process_group,
                accumulation="sum",
                broadcast_buffers=False,  # broadcast here instead, at DDP's point (the docstring)
                find_unused_parameters=find_unused_parameters,
                skip_nonfinite=skip_nonfinite,
                **options,
            )
        try:
            check_strategy(self.sync.strategy.name)
            # Read after the Synchronizer: under zero:3 these are FSDP2's sharded DTensors.
            self._params = [p for p in module.parameters() if p.requires_grad]
            #: zero:2: its shards of the gradient shown to the loop as DTensors (``_ShardView``)
            self._view = _shard_view(self._params, process_group, self.sync.strategy)
        except UsageError:
            self.sync.close()
            raise
        self._group = process_group
        self._follow_buffers = _follows_buffers(
            module, process_group, self.sync.strategy, broadcast_buffers
        )
        self._optimizer = optimizer
        self._open: _OpenStep | None = None
        #: the last thing done was an optimizer.step() (no forward pass since): a second one
        #: is a step taken twice, not a backward pass run under no_sync()
        self._stepped = False
        self._exit: _Exit | None = None
        self._queued = False
        self._closed = False
        self._skip_nonfinite = skip_nonfinite
        #: zero:3: the module is FSDP2's root, whose backward ends in its own callback
        self._fsdp = compat.is_fsdp_module(module)
        # After the Synchronizer's own: on each parameter its hook has counted the gradient
        # (and maybe launched its bucket) before this one queues the end-of-backward callback.
        # FSDP2's sharded parameters never accumulate a gradient (FSDP2 assigns it): there
        # the forward's outputs carry the hook instead.
        self._hooks = [] if self._fsdp else self._hook_parameters()
        #: zero:3: hooks on this step's outputs, until its backward pass ends
        self._output_hooks: list[Any] = []
        # restored by close(): the instance's own step (a scheduler's), else the class's
        self._own_step = optimizer.__dict__.get("step")
        self._original_step = optimizer.step
        self._routed_step = _route_step(optimizer, self._original_step, self._optimizer_step)
        #: local:H, diloco:H, gossip:H, noloco:H on more than one rank: the replicas differ
        #: between averages, and a script without model.report() ends with them apart
        self._apart = self._watch_apart_replicas(module, process_group)

    def _watch_apart_replicas(
        self, module: nn.Module, group: dist.ProcessGroup | None
    ) -> _ApartReplicas | None:
        """Under a strategy whose replicas differ between averages, on more than one rank: the
        warnings of a script that ends with them apart (``_ApartReplicas``), set up on
        ``module``'s ``state_dict()`` (the hook kept as ``_state_hook``) and at this object's
        collection or the interpreter's exit. None elsewhere."""
        if self.sync.strategy.replicates_every_step or runtime.world_size(group) <= 1:
            return None
        apart = _ApartReplicas(self.sync)
        # kept past close(): a script may save after it
        self._state_hook = module.register_state_dict_pre_hook(apart.on_state_dict)
        # at this object's collection or the interpreter's exit, whichever comes first
        weakref.finalize(self, apart.at_exit)
        return apart

    # -- the user's calls ---------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._closed:  # after close(): the plain module, synchronizing nothing
            return self.module(*inputs, **kwargs)
        syncing = torch.is_grad_enabled() and self.require_backward_grad_sync
        self._stepped = False
        if self._open is not None and self._open.synchronized:
            # The last step's update never came (a GradScaler skipped it): close that block
            # now, before this forward's backward adds a gradient to it.
            self._close(_Exit(apply=False))
        broadcast = self._follow_buffers and self.require_forward_param_sync
        # Outside a step block (a no_sync() micro-batch, an evaluation, the buffer broadcast
        # before the block opens) these are collectives under zero:3: the strategy puts them
        # behind one gate named for which it is (``Strategy.forward_between_steps``; nothing
        # under the other strategies, whose forward posts no collective a peer could pair).
        between = (
            self.sync.strategy.forward_between_steps(training=torch.is_grad_enabled())
            if self._open is None and (broadcast or not syncing)
            else contextlib.nullcontext()
        )
        with between:
            if broadcast:
                self._broadcast_buffers()
            if syncing and self._open is None:
                self._enter()
            if self._fsdp:  # no_sync(): FSDP2 accumulates unsharded gradients, reduces none
                root: Any = self.module  # an FSDPModule
                root.set_requires_gradient_sync(self.require_backward_grad_sync)
            output = self.module(*inputs, **kwargs)
        if self._fsdp and syncing:
            for t in _tensors_in(output):
                if t.requires_grad:  # the first to get its gradient starts the backward pass
                    self._output_hooks.append(t.register_hook(self._on_output_gradient))
        self.require_forward_param_sync = syncing
        return output

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """As DDP's: backward passes inside accumulate into ``p.grad`` on this rank only; the
        first one outside it (the step's last micro-batch) exchanges the sum."""
        old = self.require_backward_grad_sync
        self.require_backward_grad_sync = False
        try:
            yield
        finally:
            self.require_backward_grad_sync = old

    def report(self) -> Any:
        """Collective, at the end of training: ``model.sync.report()`` (the final average under
        ``local:H`` / ``diloco:H``, the final divergence check, the timing report)."""
        if self._open is not None and self._open.synchronized:
            self._close(_Exit(apply=False))
        return self.sync.report()

    def close(self) -> None:
        """Give the optimizer its own ``step`` back and release the Synchronizer (no
        collective)."""
        self._closed = True
        for h in [*self._hooks, *self._output_hooks]:
            h.remove()
        self._hooks, self._output_hooks = [], []
        # A scheduler built after the wrap wrapped the routed step: then it stays, and with
        # no open block it calls the original step directly.
        if self._optimizer.__dict__.get("step") is self._routed_step:
            if self._own_step is None:
                del self._optimizer.step
            else:
                self._optimizer.step = self._own_step  # type: ignore[method-assign]
        self.sync.close()

    # -- the superstep ------------------------------------------------------------------------
    def _hook_parameters(self) -> list[Any]:
        return [p.register_post_accumulate_grad_hook(self._on_gradient) for p in self._params]

    def _enter(self) -> None:
        """Open this step's block at its synchronizing forward pass, keeping the gradients the
        ``no_sync()`` micro-batches accumulated (the block's entry releases ``p.grad``).
        Under zero:3 FSDP2 keeps those itself, unsharded, and the sharded ``p.grad`` left is
        the last step's (the user's ``zero_grad()`` clears the optimizer's tensors, not
        FSDP2's): the entry's release stands."""
        held = [None if self._fsdp else p.grad for p in self._params]
        self._queued = False  # a backward pass that raised never ran the callback it queued
        self._open = _OpenStep(self.sync)
        for p, g in zip(self._params, held, strict=True):
            p.grad = g

    def _on_gradient(self, _: torch.Tensor) -> None:
        step = self._open
        if step is None or step.synchronized or self._queued:
            return  # a no_sync() micro-batch, or the callback is queued already
        step.backward_seen = True
        first = self._after_fsdp if self._fsdp else self._end_of_backward
        self._queued = compat.queue_end_of_backward(first)

    def _on_output_gradient(self, grad: torch.Tensor) -> None:
        self._on_gradient(grad)

    def _after_fsdp(self) -> None:
        """FSDP2 waits for its last reduce-scatter in an end-of-backward callback of its own,
        which may be queued after this one: queue the exchange's end behind it (callbacks
        queued while the engine runs them run after every one queued before)."""
        if not compat.queue_end_of_backward(self._end_of_backward):
            self._end_of_backward()

    def _end_of_backward(self) -> None:
        self._queued = False
        for h in self._output_hooks:
            h.remove()
        self._output_hooks = []
        # Only spreading a non-finite gradient or showing a sharded view asks whether the step
        # is skipped: anything else (bsp) leaves a verdict on the device there. zero:2's view
        # needs no answer where its verdict stays on the device: a skipped step keeps the
        # shards (the host path releases them), which the fused optimizer then ignores.
        shows = self._view is not None
        asks = (self._fsdp and not self._skip_nonfinite) or (shows and not self._shards_kept())
        if self._open is None or not self._open.synchronize(verdict=asks):
            return
        if not (asks or shows):
            return
        if self._fsdp and not self._skip_nonfinite:
            self._spread_nonfinite()
        if self._view is not None:
            self._view.show()

    def _optimizer_step(self, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        exiting = self._exit
        if self._closed:  # after close(), through a scheduler that wrapped the routed step
            return original(*args, **kwargs)
        if exiting is not None:  # the block's exit stepping the optimizer: the real update
            if not exiting.apply:
                return None
            exiting.result = original(*exiting.args, **exiting.kwargs)
            return exiting.result
        if self._stepped:
            raise UsageError(
                "optimizer.step() ran twice with no forward and backward pass between: the "
                "second would apply the same gradient again (DDP would); step once per "
                "backward pass and remove the second call"
            )
        if self._open is None or not self._open.backward_seen:
            raise UsageError(
                "optimizer.step() with no synchronizing backward pass since the last step: "
                "run the step's last backward pass outside model.no_sync() (every rank must "
                "exchange its gradient before the update), and step once per backward pass "
                "outside no_sync()"
            )
        if args or "closure" in kwargs:
            raise UsageError(
                "optimizer.step(closure) re-runs forward and backward inside the step, which "
                "gs.DistributedDataParallel cannot synchronize; use the explicit form, "
                "`with sync.step() as s:` (docs/porting.md)"
            )
        result = self._close(_Exit(apply=True, kwargs=kwargs))
        self._stepped = True
        return result

    def _close(self, exiting: _Exit) -> Any:
        step, self._open = self._open, None
        assert step is not None
        if self._view is not None:  # the update steps this rank's plain gradients
            self._view.hide()
        self._exit = exiting
        try:
            step.close()
        finally:
            self._exit = None
        return exiting.result

    def _shards_kept(self) -> bool:
        """zero:2: whether this step's verdict stays on the device, so that its gradient
        shards are there to show whether or not the step is skipped."""
        verdict_on_device = getattr(self.sync.strategy, "verdict_on_device", None)
        return verdict_on_device is not None and bool(verdict_on_device(self.sync.step_count))

    def _spread_nonfinite(self) -> None:
        """zero:3: when any rank's shard of the gradient is not finite, make every rank's all
        NaN, so that every rank's GradScaler skips the step, as under DDP, where the
        all-reduce leaves the non-finite values on every rank. (The scaler checks the
        optimizer's tensors, this rank's shards only, so the ranks would disagree: some
        stepping, some not.) One one-element all-reduce."""
        grads = [
            p.grad for g in self._optimizer.param_groups for p in g["params"] if p.grad is not None
        ]
        bad = torch.tensor([0.0 if all_finite(grads) else 1.0], device=runtime.device())
        dist.all_reduce(bad, op=dist.ReduceOp.MAX, group=self._group)
        if bad.item() != 0.0:
            with torch.no_grad():
                for g in grads:
                    g.fill_(math.nan)

    def _broadcast_buffers(self) -> None:
        """Rank 0's buffers on every rank, one broadcast per dtype and device (DDP's
        coalesced broadcast), read anew each time: a module may have replaced one."""
        groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for b in self.module.buffers():
            groups.setdefault((b.dtype, b.device), []).append(b)
        src = dist.get_global_rank(self._group, 0) if self._group is not None else 0
        with torch.no_grad():
            for tensors in groups.values():
                flat = flatten(tensors)
                dist.broadcast(flat, src=src, group=self._group)
                copy_into(flat, tensors)


class _ShardView:
    """``zero:2``'s gradient shown to the user's loop as DTensors, from the end of backward to
    ``optimizer.step()``, so that torch's ``clip_grad_norm_`` and ``GradScaler`` take the
    whole gradient's norm and inf/NaN check by themselves, as they do for FSDP2's gradients.

    After the exchange each rank holds the mean gradient of the whole tensors it owns and
    ``p.grad`` is None for the others', so torch's clip over ``model.parameters()`` would
    scale each rank's part by its own norm (``zero_shards.LocalClipGuard`` refuses that in the
    explicit form). Here every parameter's ``p.grad`` becomes a DTensor sharded on dim 0 over
    the group: the owner's local tensor is its whole gradient (the exchange's buffer itself,
    so in-place changes reach the update), every other rank's an empty one (0 rows, no
    memory); a 0-dim parameter's is ``Partial`` with a zero scalar on the others. DTensor's
    norm of such a tensor reduces the local norms over the group, whatever the rows per rank,
    and its inf/NaN check for the GradScaler (``found_inf``) is reduced over the group too.
    Every rank holds a DTensor for every parameter, so a clip of any subset of the parameters
    (the same on every rank) posts the same collectives on every rank. ``hide()`` puts the
    plain gradients back (None for the others') before the update."""

    def __init__(
        self, params: Sequence[torch.Tensor], group: dist.ProcessGroup | None, stage: Any
    ) -> None:
        #: the ``zero:2`` strategy: where this rank's part of each gradient is
        #: (``gradient_part``: a whole tensor it owns, or its rows of every tensor)
        self._stage = stage
        found = compat.fsdp2()
        try:
            from torch.distributed.tensor import Partial, Shard
        except ImportError:
            found = None
        if found is None:
            raise UsageError(
                f"gs.DistributedDataParallel runs zero:2 by showing the loop its gradient as "
                f"DTensors, which torch {torch.__version__} does not have publicly (torch >= "
                "2.6); use zero:1, or the explicit form with s.clip_grad_norm_ (docs/porting.md)"
            )
        _, self._dtensor, mesh_cls = found
        self._shard, self._partial = Shard(0), Partial()
        device_type = params[0].device.type if params else "cpu"
        self._mesh = mesh_cls.from_group(group or dist.group.WORLD, device_type)
        self._params = params
        #: per parameter: the DTensor shown, and the ``p.grad`` it replaced
        self._shown: list[tuple[torch.Tensor, Any, torch.Tensor | None]] = []

    def show(self) -> None:
        shown = []
        # the loop's GradScaler checks the gradients of the tensors the optimizer holds: the
        # parameters, whose DTensor gradients reduce its check over the group
        self._stage.show_parameters()
        for p in self._params:
            held = p.grad  # put back by hide(): the gradient, or zero:2's placeholder by rows
            mine = self._stage.gradient_part(p)
            if p.dim() == 0:
                local = torch.zeros_like(p) if mine is None else mine
                view = self._dtensor.from_local(local, self._mesh, [self._partial], run_check=False)
            else:
                local = p.new_empty((0, *p.shape[1:])) if mine is None else mine
                view = self._dtensor.from_local(
                    local,
                    self._mesh,
                    [self._shard],
                    run_check=False,
                    shape=p.shape,
                    stride=_contiguous_strides(p.shape),
                )
            p.grad = view
            shown.append((p, view, held))
        self._shown = shown

    def hide(self) -> None:
        for p, view, held in self._shown:
            grad: Any = p.grad
            p.grad = held
            if grad is view:
                continue
            # what the loop left instead: a DTensor of its own (g = g * c), a plain gradient,
            # or None (that parameter is not stepped, as under DDP)
            self._stage.set_gradient_part(
                p, grad.to_local() if isinstance(grad, self._dtensor) else grad
            )
        self._shown = []


def _contiguous_strides(shape: torch.Size) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)  # torch's contiguous strides
    return tuple(reversed(strides))


def _tensors_in(output: Any) -> Iterator[torch.Tensor]:
    """The tensors of a forward's output: a tensor, or nested lists, tuples and dicts."""
    if isinstance(output, torch.Tensor):
        yield output
    elif isinstance(output, list | tuple):
        for item in output:
            yield from _tensors_in(item)
    elif isinstance(output, dict):
        for item in output.values():
            yield from _tensors_in(item)


def _route_step(
    optimizer: torch.optim.Optimizer,
    original: Callable[..., Any],
    route: Callable[[Callable[..., Any], Any, Any], Any],
) -> Any:
    """Set ``optimizer.step`` (on the instance) to one that calls ``route(original, args,
    kwargs)``. A bound method, as torch's LR scheduler expects of ``optimizer.step`` when it
    wraps it (a scheduler built after the wrap); ``functools.wraps`` carries the marks of a
    scheduler's wrapper built before it, so that one does not warn that the step was
    replaced."""
    underlying = getattr(original, "__func__", original)

    @functools.wraps(underlying)
    def step(_: Any, *args: Any, **kwargs: Any) -> Any:
        return route(original, args, kwargs)

    routed = types.MethodType(step, optimizer)
    optimizer.step = routed  # type: ignore[method-assign]
    return routed


def _check_arguments(
    module: nn.Module,
    optimizer: Any,
    device_ids: list[int | torch.device] | None,
    output_device: int | torch.device | None,
    strategy: str | Any | None,
    options: dict[str, Any],
) -> None:
    """``UsageError`` naming the first argument the front door cannot take, and the fix."""
    if optimizer is None:
        raise UsageError(
            "gs.DistributedDataParallel(model, optimizer=optimizer): pass the optimizer the loop "
            "steps. Build it on model.parameters() before this line (the same tensors DDP's "
            "script would give it after)"
        )
    if not isinstance(optimizer, torch.optim.Optimizer):
        raise UsageError(
            f"optimizer must be a torch.optim.Optimizer, got {type(optimizer).__name__}"
        )
    if steps_none_of(module, optimizer):
        # another optimizer than the one the loop steps (built on another model, or a copy):
        # the exchange would average gradients this optimizer never applies, silently
        raise UsageError(
            "gs.DistributedDataParallel(model, optimizer=optimizer): the optimizer holds none "
            "of the model's parameters. Pass the optimizer the loop steps, built on "
            "model.parameters() before this line"
        )
    for name in OWN_OPTIONS:
        if name in options:
            raise UsageError(f"gs.DistributedDataParallel takes no {name}=: {OWN_OPTIONS[name]}")
    devices = {p.device for p in module.parameters()}
    for given in [*(device_ids or []), *([] if output_device is None else [output_device])]:
        wanted = torch.device(given) if not isinstance(given, int) else torch.device("cuda", given)
        if devices != {wanted}:
            raise UsageError(
                f"device_ids / output_device {given!r}: the module's parameters are on "
                f"{', '.join(sorted(map(str, devices)))}; move the module there first "
                "(model.to(device)) or leave device_ids out"
            )
    if device_ids is not None and len(device_ids) > 1:
        raise UsageError(f"device_ids={device_ids!r}: one device per process, as DDP requires")
    if not compat.end_of_backward_callbacks():
        raise UsageError(
            "this torch has no end-of-backward callbacks, which gs.DistributedDataParallel "
            "needs to finish the exchange before your clip reads p.grad; use the explicit "
            "form, gs.Synchronizer with `with sync.step() as s:` (docs/porting.md)"
        )
    if strategy is not None:  # before any collective; a run directory's choice is after
        check_strategy(parse_strategy(strategy, servers=options.get("servers", 1)).name)


def _shard_view(
    params: Sequence[torch.Tensor], group: dist.ProcessGroup | None, strategy: Any
) -> _ShardView | None:
    """Under ``zero:2``: the view that shows the loop its shards of the gradient as DTensors
    (``_ShardView``); None under any other strategy."""
    return _ShardView(params, group, strategy) if strategy.name == "zero:2" else None


def _follows_buffers(
    module: nn.Module, group: dist.ProcessGroup | None, strategy: Any, broadcast_buffers: bool
) -> bool:
    """Whether the wrapper broadcasts ``module``'s buffers from rank 0 where DDP does (at the
    first forward pass of a step): asked (``broadcast_buffers``), on more than one rank,
    under a strategy whose replicas agree after every step, and with buffers to send."""
    return (
        broadcast_buffers
        and runtime.world_size(group) > 1
        and strategy.replicates_every_step
        # as DDP: a module without buffers now is not walked for them at every forward
        and next(iter(module.buffers()), None) is not None
    )


__all__ = ["DistributedDataParallel", "check_strategy"]
