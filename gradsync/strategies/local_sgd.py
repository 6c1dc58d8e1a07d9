"""Periodic averaging: local SGD (``local:H``) and DiLoCo (``diloco:H``).

Every worker steps the user's optimizer on its own gradient for H steps with no communication.
Then local SGD averages the parameters; DiLoCo averages the pseudo-gradient (global parameters
minus local ones), applies it to the global parameters with an outer optimizer (Nesterov
momentum by default), and copies the result back to every worker. Either sends one model's
worth of bytes every H steps: 1/H of BSP's per step, before compression.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from gradsync.compression.allreduce import ALLREDUCE
from gradsync.compression.base import FlatBucket
from gradsync.errors import UsageError
from gradsync.fault.diagnose import END
from gradsync.flat import copy_into, flatten
from gradsync.strategies.base import (
    StepOutcome,
    StepPlan,
    Strategy,
    SyncContext,
    compressor_state_dict,
    load_compressor_state,
    local_gradient,
    optimizer_step,
)


class _Periodic(Strategy):
    """Shared step logic: local steps, and a synchronization every ``period`` steps."""

    name = "periodic"
    barrier_free = False

    def __init__(self, period: int) -> None:
        if not isinstance(period, int) or period < 1:
            raise UsageError(
                f"H (steps between synchronizations) must be an integer >= 1, got {period!r}"
            )
        self.period = period
        self._ctx: SyncContext | None = None
        self._params: list[torch.Tensor] = []
        self._state: Any = None
        self._average_over = 1
        self._step = 0  # the last step run: where a synchronization's wait is diagnosed
        #: whether the replicas agree (right after a synchronization, or the initial broadcast)
        self._in_sync = True

    def setup(self, ctx: SyncContext) -> None:
        self._ctx = ctx
        self._params = [p for p in ctx.model.parameters() if p.requires_grad]
        self._state = ctx.compressor.make_state(ctx.group)

    def begin_step(self, plan: StepPlan) -> None:
        assert self._ctx is not None
        self._ctx.optimizer.zero_grad(set_to_none=True)
        self._average_over = plan.average_over

    def gradients_ready(self, step: int) -> StepOutcome:
        """The local gradient (mean over micro-batches): nothing is exchanged before a local
        step."""
        assert self._ctx is not None
        # A local step is this rank's own business: a non-finite gradient skips it here only.
        outcome = local_gradient(self._params, self._ctx, self._average_over)
        if outcome.skipped:
            self._ctx.optimizer.zero_grad(set_to_none=True)
        return outcome

    def abandon(self, step: int) -> StepOutcome:
        """This rank's block raised: its local step is skipped; a synchronization due at this
        step still happens (in ``update``), with this rank's parameters as they are."""
        assert self._ctx is not None
        self._ctx.optimizer.zero_grad(set_to_none=True)
        return StepOutcome(barrier=False, skipped=True)

    def update(self, step: int, outcome: StepOutcome) -> StepOutcome:
        assert self._ctx is not None
        self._step = step  # the last step run, for the timeout diagnosis of a synchronization
        if not outcome.skipped:
            # A GradScaler, when given, skips on this rank's own non-finite gradient.
            outcome.skipped = not optimizer_step(self._ctx)
        # Even after a skipped step: a skip is this rank's alone, and every rank must make the
        # same decision in finalize() (it is a collective).
        self._in_sync = False
        if (step + 1) % self.period:
            return outcome
        before = self._state.bytes_sent
        if self._ctx.gate is not None:
            self._ctx.gate.ensure(step, f"averaging of {self.name}:{self.period}")
        self._synchronize()
        self._in_sync = True
        outcome.bytes_sent += self._state.bytes_sent - before
        outcome.barrier = True
        return outcome

    def finalize(self) -> None:
        """An incomplete last period ends with one more synchronization (an average, or an
        outer step), so every replica leaves ``report()`` with the same parameters."""
        if self._in_sync:
            return
        if self._ctx is not None and self._ctx.gate is not None:
            self._ctx.gate.ensure(END, f"final averaging of {self.name}:{self.period}")
        self._synchronize()
        self._in_sync = True

    def replicas_identical(self, step: int, final: bool) -> bool:
        """Replicas agree right after each synchronization (and at the end), and only then."""
        return final or (step + 1) % self.period == 0

    def _mean(self, flat: torch.Tensor) -> torch.Tensor:
        """Mean over ranks through the compressor (plain all-reduce when uncompressed)."""
        ctx = self._ctx
        assert ctx is not None
        bucket = FlatBucket(flat, index=0, is_last=True, params=self._params)
        if ctx.watch is None:
            return ctx.compressor.hook(self._state, bucket).wait()
        # The hook is inside the diagnosis too: some compressors wait on a first round there.
        what = f"averaging of {self.name}:{self.period} ({ctx.compressor.spec})"
        return ctx.watch.run(
            self._step, what, lambda: ctx.compressor.hook(self._state, bucket).wait()
        )

    def _synchronize(self) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {**compressor_state_dict(self._state), "in_sync": self._in_sync}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_compressor_state(self._state, state)
        self._in_sync = bool(state.get("in_sync", True))


class LocalSGD(_Periodic):
    """``local:H``: average the parameters every H steps.

    Uncompressed, the parameters themselves are averaged. Through a lossy compressor they must
    not be: a sparsifier would zero most of every replica, and error feedback would carry whole
    parameters as residuals. There each rank sends the change since the last synchronization
    instead, and every replica becomes the last synchronized parameters plus the mean change,
    which is the same average when nothing is lost.
    """

    name = "local"

    def __init__(self, period: int) -> None:
        super().__init__(period)
        self._anchor: torch.Tensor | None = None  # last synchronized parameters (lossy only)

    def setup(self, ctx: SyncContext) -> None:
        super().setup(ctx)
        if ctx.compressor is not ALLREDUCE:
            # Taken after the Synchronizer's initial broadcast: the same on every rank.
            self._anchor = flatten(self._params).clone()

    def _synchronize(self) -> None:
        if self._anchor is None:
            copy_into(self._mean(flatten(self._params)), self._params)
            return
        self._anchor += self._mean(flatten(self._params) - self._anchor)
        copy_into(self._anchor, self._params)

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        if self._anchor is not None:
            state["anchor"] = self._anchor.detach().clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        if self._anchor is not None and "anchor" in state:
            self._anchor.copy_(state["anchor"])


@dataclass(frozen=True, slots=True, kw_only=True)
class OuterConfig:
    outer_lr: float = 0.7
    outer_momentum: float = 0.9
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not self.outer_lr > 0:
            raise UsageError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise UsageError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")


class DiLoCo(_Periodic):
    """``diloco:H``: the user's optimizer is the inner one; every H steps the averaged
    pseudo-gradient (global minus local parameters) goes through an outer SGD with Nesterov
    momentum, and the new global parameters are copied back to every worker.

    With ``outer_lr=1`` and no momentum the outer step lands on the average of the local
    parameters, which is local SGD.
    """

    name = "diloco"

    def __init__(
        self,
        period: int,
        outer_lr: float = 0.7,
        outer_momentum: float = 0.9,
        nesterov: bool = True,
    ) -> None:
        super().__init__(period)
        self.outer = OuterConfig(
            outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov
        )
        self._global: torch.Tensor | None = None
        self._outer_opt: torch.optim.SGD | None = None

    def setup(self, ctx: SyncContext) -> None:
        super().setup(ctx)
        # The global copy is taken after the Synchronizer's broadcast, so it is the same on
        # every rank; it lives as one flat tensor that the outer optimizer owns.
        self._global = flatten(self._params).clone()
        momentum = self.outer.outer_momentum
        self._outer_opt = torch.optim.SGD(
            [self._global],
            lr=self.outer.outer_lr,
            momentum=momentum,
            nesterov=self.outer.nesterov and momentum > 0,
        )

    def _synchronize(self) -> None:
        assert self._global is not None and self._outer_opt is not None
        pseudo = self._global - flatten(self._params)
        self._global.grad = self._mean(pseudo)
        self._outer_opt.step()
        self._global.grad = None
        copy_into(self._global, self._params)

    def state_dict(self) -> dict[str, Any]:
        assert self._global is not None and self._outer_opt is not None
        state = super().state_dict()
        state["global"] = self._global.detach().clone()
        state["outer_optimizer"] = self._outer_opt.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        assert self._global is not None and self._outer_opt is not None
        with torch.no_grad():
            self._global.copy_(state["global"])
        self._outer_opt.load_state_dict(state["outer_optimizer"])
