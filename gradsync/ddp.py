"""``gs.DistributedDataParallel``: DDP's front door over the ``Synchronizer``.

A DDP script ports by changing its ``DistributedDataParallel(model)`` line (and the import)::

    from gradsync import DistributedDataParallel as DDP
    model = DDP(model, optimizer=optimizer)          # was: DDP(model)

and nothing else: ``no_sync()`` / ``require_backward_grad_sync`` for accumulation,
``loss.backward()``, ``scaler.scale / unscale_ / step / update``, ``clip_grad_norm_``,
``optimizer.step()``, ``zero_grad()``, ``model.module`` and ``state_dict()`` keep their DDP
meaning, and under ``bsp`` the run ends bit for bit where DDP's does.

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

Refused at construction, naming the explicit ``sync.step()`` form instead: ``zero:2`` /
``zero:3`` (torch's ``clip_grad_norm_`` in the user's loop would see one shard of the
gradient), the parameter-server strategies (servers run ``sync.serve()`` on ranks of their own)
and ``hogwild``.
"""

from __future__ import annotations

import contextlib
import functools
import types
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from gradsync import compat, runtime
from gradsync.errors import UsageError
from gradsync.flat import copy_into, flatten
from gradsync.strategies import parse_strategy
from gradsync.synchronizer import StepHandle, Synchronizer

#: strategies whose update fits DDP's loop: the whole mean gradient (or this rank's own, for
#: the periodic ones) in ``p.grad`` at the end of backward, the update in ``optimizer.step()``
SUPPORTED = ("bsp", "zero:1", "local", "diloco")

#: why each other strategy is refused, and what to use
REFUSED = {
    "zero:2": "each rank holds only its shard of the mean gradient, so torch's clip_grad_norm_ "
    "in the loop would clip each shard by its own norm",
    "zero:3": "the model must go through fully_shard and every forward is a collective",
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
        f"gs.DistributedDataParallel cannot run strategy {name!r}: {why}. It runs "
        f"{', '.join(SUPPORTED[:2])}, local:H and diloco:H; for {name} use the explicit form, "
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

    def synchronize(self) -> None:
        if not self.synchronized:
            self.synchronized = True
            self.handle.synchronize()

    def close(self) -> None:
        self._block.__exit__(None, None, None)


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
    ``find_unused_parameters``, ``gradient_as_bucket_view`` and ``static_graph`` are accepted
    and need nothing (unused parameters count as zeros, gradients are bucket views already).

    Call ``model.report()`` on every rank at the end of training (before
    ``destroy_process_group``) for gradsync's timing report and final checks; under
    ``local:H`` / ``diloco:H`` it also closes an unfinished period with a last average, so the
    replicas end identical. Under ``bsp`` and ``zero:1`` it is optional.
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
        del find_unused_parameters, gradient_as_bucket_view, static_graph
        _check_arguments(module, optimizer, device_ids, output_device, options)
        assert optimizer is not None
        if strategy is not None:  # before any collective; a run directory's choice is after
            check_strategy(parse_strategy(strategy, servers=options.get("servers", 1)).name)
        if not compat.end_of_backward_callbacks():
            raise UsageError(
                "this torch has no end-of-backward callbacks, which gs.DistributedDataParallel "
                "needs to finish the exchange before your clip reads p.grad; use the explicit "
                "form, gs.Synchronizer with `with sync.step() as s:` (docs/porting.md)"
            )
        self.module = module
        #: DDP's flags: no_sync() clears the first; the second says whether this forward
        #: follows a synchronizing one (then buffers are broadcast first, as DDP does)
        self.require_backward_grad_sync = True
        self.require_forward_param_sync = True
        self.sync = Synchronizer(
            module,
            optimizer,
            strategy,
            compression,
            25.0 if bucket_cap_mb is None else bucket_cap_mb,
            group=process_group,
            accumulation="sum",
            broadcast_buffers=False,  # broadcast here instead, at DDP's point (the docstring)
            skip_nonfinite=skip_nonfinite,
            **options,
        )
        try:
            check_strategy(self.sync.strategy.name)
        except UsageError:
            self.sync.close()
            raise
        self._group = process_group
        self._follow_buffers = (
            broadcast_buffers
            and runtime.world_size(process_group) > 1
            and self.sync.strategy.replicates_every_step
        )
        self._optimizer = optimizer
        self._open: _OpenStep | None = None
        self._exit: _Exit | None = None
        self._queued = False
        self._closed = False
        self._params = [p for p in module.parameters() if p.requires_grad]
        # After the Synchronizer's own: on each parameter its hook has counted the gradient
        # (and maybe launched its bucket) before this one queues the end-of-backward callback.
        self._hooks = [
            p.register_post_accumulate_grad_hook(self._on_gradient) for p in self._params
        ]
        # restored by close(): the instance's own step (a scheduler's), else the class's
        self._own_step = optimizer.__dict__.get("step")
        self._original_step = optimizer.step
        self._routed_step = _route_step(optimizer, self._original_step, self._optimizer_step)

    # -- the user's calls ---------------------------------------------------------------------
    def forward(self, *inputs: Any, **kwargs: Any) -> Any:
        if self._closed:  # after close(): the plain module, synchronizing nothing
            return self.module(*inputs, **kwargs)
        syncing = torch.is_grad_enabled() and self.require_backward_grad_sync
        if self._open is not None and self._open.synchronized:
            # The last step's update never came (a GradScaler skipped it): close that block
            # now, before this forward's backward adds a gradient to it.
            self._close(_Exit(apply=False))
        if self._follow_buffers and self.require_forward_param_sync:
            self._broadcast_buffers()
        if syncing and self._open is None:
            self._enter()
        output = self.module(*inputs, **kwargs)
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
        for h in self._hooks:
            h.remove()
        self._hooks = []
        # A scheduler built after the wrap wrapped the routed step: then it stays, and with
        # no open block it calls the original step directly.
        if self._optimizer.__dict__.get("step") is self._routed_step:
            if self._own_step is None:
                del self._optimizer.step
            else:
                self._optimizer.step = self._own_step  # type: ignore[method-assign]
        self.sync.close()

    # -- the superstep ------------------------------------------------------------------------
    def _enter(self) -> None:
        """Open this step's block at its synchronizing forward pass, keeping the gradients the
        ``no_sync()`` micro-batches accumulated (the block's entry releases ``p.grad``)."""
        held = [p.grad for p in self._params]
        self._queued = False  # a backward pass that raised never ran the callback it queued
        self._open = _OpenStep(self.sync)
        for p, g in zip(self._params, held, strict=True):
            p.grad = g

    def _on_gradient(self, _: torch.Tensor) -> None:
        step = self._open
        if step is None or step.synchronized or self._queued:
            return  # a no_sync() micro-batch, or the callback is queued already
        step.backward_seen = True
        self._queued = compat.queue_end_of_backward(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._queued = False
        if self._open is not None:
            self._open.synchronize()

    def _optimizer_step(self, original: Callable[..., Any], args: Any, kwargs: Any) -> Any:
        exiting = self._exit
        if self._closed:  # after close(), through a scheduler that wrapped the routed step
            return original(*args, **kwargs)
        if exiting is not None:  # the block's exit stepping the optimizer: the real update
            if not exiting.apply:
                return None
            exiting.result = original(*exiting.args, **exiting.kwargs)
            return exiting.result
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
        return self._close(_Exit(apply=True, kwargs=kwargs))

    def _close(self, exiting: _Exit) -> Any:
        step, self._open = self._open, None
        assert step is not None
        self._exit = exiting
        try:
            step.close()
        finally:
            self._exit = None
        return exiting.result

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


__all__ = ["DistributedDataParallel", "check_strategy"]
