"""Periodic averaging: local SGD (``local:H``) and DiLoCo (``diloco:H``, and streaming DiLoCo,
``diloco:H:F:TAU:ALPHA[:SPLIT]``, whose schedule and fragments ``streaming`` holds).

Every worker steps the user's optimizer on its own gradient for H steps with no communication.
Then local SGD averages the parameters; DiLoCo averages the pseudo-gradient (global parameters
minus local ones), applies it to the global parameters with an outer optimizer (Nesterov
momentum by default), and copies the result back to every worker. Either sends one model's
worth of bytes every H steps: 1/H of BSP's per step, before compression.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.distributed as dist

from gradsync import exit_safety, runtime
from gradsync.checks.diagnose import END
from gradsync.compression.allreduce import ALLREDUCE
from gradsync.compression.base import FlatBucket
from gradsync.errors import UsageError
from gradsync.flat import copy_into, flatten
from gradsync.spec import (
    EAGER,
    KEEP,
    OUTER_DEFAULTS,
    SPLITS,
    StrategySpec,
    outer_options,
    parse_strategy_spec,
)
from gradsync.strategies.base import (
    Membership,
    StepOutcome,
    StepPlan,
    Strategy,
    SyncContext,
    compressor_state_dict,
    live_exchange,
    load_compressor_state,
    local_gradient,
    step_verdict,
)
from gradsync.strategies.eager import NOT_UNDER_MEMBERSHIP, EagerRounds, Result
from gradsync.strategies.passes import PassCounter
from gradsync.strategies.streaming import (
    Exchange,
    check_saved_fragments,
    fragment_tensors,
    offsets,
)
from gradsync.telemetry.records import Span


class Periodic(Strategy):
    """Shared step logic: local steps, and a synchronization every ``period`` steps."""

    name = "periodic"
    barrier_free = False
    #: its averages go through ``SyncContext.hierarchy`` when one is given
    takes_hierarchy = True
    #: the gate of an exchange step is waited on the gate's thread from that step's block
    #: entry (``gate_at``) and joined before the exchange is posted, as under bsp: its two
    #: store round trips leave the training thread, hidden by the step's forward and
    #: backward. Measured on the frontier's mlp under diloco:4:2:1 + int4, 2 emulated hosts
    #: (``benchmarks.frontier_timeline``): the training thread's time outside the exchange
    #: fell from 7.0 to 5.3 ms a step, but a rank's lag behind its peer then shows in the wait
    #: for the exchange instead (2.4 to 3.7 ms): the step as a whole within the run's noise
    gate_ahead = True

    def __init__(self, period: int) -> None:
        if not isinstance(period, int) or period < 1:
            raise UsageError(
                f"H (steps between synchronizations) must be an integer >= 1, got {period!r}"
            )
        self.period = period
        self._ctx: SyncContext | None = None
        self._params: list[torch.Tensor] = []
        self._passes = PassCounter([])
        self._state: Any = None
        self._group_sum = GroupSum(1, lambda flat: lambda: None)
        #: under live membership with fp16/bf16 compression: the type each replica's share of
        #: the quorum's mean is cast to (``Membership.allreduce``'s ``wire``)
        self._live_wire: torch.dtype | None = None
        self._average_over = 1
        self._step = 0  # the last step run: where a synchronization's wait is diagnosed
        #: whether the replicas agree (right after a synchronization, or the initial broadcast)
        self._in_sync = True
        #: under live membership: a quorum was joined and its commit is not decided yet
        #: (torchft's Manager holds one quorum at a time)
        self._quorum_open = False
        #: under live membership: this process's first step joins a quorum wherever it is in
        #: its period (a replacement restarted from a checkpoint of a mid-period step), so it
        #: heals at the step's start, not inside an exchange a period out of step with its
        #: peers' (each later quorum: ``_joins_quorum``)
        self._first_quorum = True
        #: this step's timeline spans of its synchronization (``record_spans``)
        self._spans: list[Span] = []

    def setup(self, ctx: SyncContext) -> None:
        self._ctx = ctx
        self._params = [p for p in ctx.model.parameters() if p.requires_grad]
        self._passes = PassCounter(self._params)
        # Under a hierarchy the compressor (or plain all-reduce) runs among the hosts' leaders.
        group = ctx.group if ctx.hierarchy is None else ctx.hierarchy.leader_group
        #: under live membership, this replica group's own sum (``_live_launch``):
        #: ``ctx.group`` is the group, the quorum holds the other groups
        self._group_sum = group_sum(ctx.group)
        self._live_wire, exchanged_over = live_exchange(ctx, group)
        self._state = ctx.compressor.make_state(exchanged_over)

    @contextmanager
    def _timed(self, name: str, cat: str = "step", **args: Any) -> Iterator[None]:
        """A timeline span around the block (``record_spans``; nothing is timed otherwise):
        where a synchronization's time goes on the training thread (issue 46)."""
        if self._ctx is None or not self._ctx.record_spans:
            yield
            return
        wall0, t0 = time.time(), time.perf_counter()
        yield
        self._spans.append(Span(-1, -1, name, wall0, time.perf_counter() - t0, cat, args or None))

    def _take_spans(self, outcome: StepOutcome) -> StepOutcome:
        outcome.spans.extend(self._spans)
        self._spans = []
        return outcome

    def begin_step(self, plan: StepPlan) -> None:
        assert self._ctx is not None
        membership = self._live()
        if membership is not None and (self._first_quorum or self._joins_quorum(plan.step)):
            self._first_quorum = False
            # A period's quorum, joined before its first local step: a replacement heals here
            # (a peer's parameters, optimizer and step, all from that peer's period start) and
            # then trains the period on its own data, so its share of the period's average is
            # its own, not a copy of its donor's. A participant lost during the period fails
            # the average's all-reduce, which is then not committed (``_synchronize_live``).
            membership.start_step(plan.step)
            self._quorum_open = True
        self._ctx.optimizer.zero_grad(set_to_none=True)
        self._ctx.found_inf = None  # a verdict a raising update left behind
        self._average_over = plan.average_over
        self._passes.arm(plan.micro_batches)

    def gradients_ready(self, step: int) -> StepOutcome:
        """The local gradient (mean over micro-batches): nothing is exchanged before a local
        step."""
        assert self._ctx is not None
        self._passes.check()
        # A local step is this rank's own business: a non-finite gradient skips it here only,
        # on the device where the optimizer takes the verdict there (``update`` steps it).
        outcome = local_gradient(self._params, self._ctx, self._average_over, on_device=True)
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
            step_verdict(self._ctx, outcome)
        # Even after a skipped step: a skip is this rank's alone, and every rank must make the
        # same decision in finalize() (it is a collective).
        self._in_sync = False
        return self._exchange(step, outcome)

    def _exchange(self, step: int, outcome: StepOutcome) -> StepOutcome:
        """The synchronization due after local step ``step``, if any."""
        assert self._ctx is not None
        if not self._exchanges_after(step):
            return outcome
        before = self._state.bytes_sent
        if self._live() is not None:
            self._in_sync = self._synchronize_live(step)
            outcome.bytes_sent += self._state.bytes_sent - before
            outcome.barrier = True
            return outcome
        # Joins the gate armed at this step's entry (gate_at). After a block that ended the
        # Synchronizer has joined it already (a no-op here); after one that raised
        # (Synchronizer._abandon) this is the only join before the exchange is posted.
        self._ctx.before_collective()
        with self._timed("average", "comm"):
            self._synchronize()
        self._in_sync = True
        outcome.bytes_sent += self._state.bytes_sent - before
        outcome.barrier = True
        return self._take_spans(outcome)

    def finalize(self) -> None:
        """An incomplete last period ends with one more synchronization (an average, or an
        outer step), so every replica leaves ``report()`` with the same parameters."""
        if self._in_sync:
            return
        if self._live() is not None:
            self._in_sync = self._synchronize_live(END)
            return
        if self._ctx is not None and self._ctx.gate is not None:
            self._ctx.gate.ensure(END, f"final averaging of {self.name}:{self.period}")
        self._synchronize()
        self._in_sync = True

    def _joins_quorum(self, step: int) -> bool:
        """Whether ``step`` joins a quorum before its local step (live membership): a
        period's first step."""
        return step % self.period == 0

    def _exchanges_after(self, step: int) -> bool:
        """Whether an exchange starts after ``step``'s local step: every H steps."""
        return (step + 1) % self.period == 0

    def gate_at(self, step: int) -> str | None:
        """Where an exchange follows this step's local step (under live membership the
        quorum, not the gate, stands for every rank's arrival)."""
        if self._live() is not None or not self._exchanges_after(step):
            return None
        return f"averaging of {self.name}:{self.period}"

    def _live(self) -> Membership | None:
        """The torchft quorum every average goes through (None: the group holds every
        replica)."""
        return None if self._ctx is None else self._ctx.membership

    def _synchronize_live(self, step: int) -> bool:
        """Under live membership: the synchronization through the period's quorum, applied
        where the quorum commits it; whether it was (a replica that was not keeps its own
        parameters, and a later quorum heals it if its peers went on)."""
        raise NotImplementedError

    def _quorum_mean(self, flat: torch.Tensor, step: int) -> torch.Tensor | None:
        """The mean of ``flat`` over the period's quorum, or None where the quorum does not
        commit it (``_synchronize_live`` then applies nothing)."""
        membership = self._live()
        assert membership is not None
        if not self._quorum_open:
            # the last synchronization, where the run ended right after a decided one (or one
            # not committed): a quorum of its own rather than the last one's, decided already
            membership.start_step(step)
            self._quorum_open = True
        mean = self._live_launch(flat).wait()
        committed = membership.commit(step)
        self._quorum_open = False
        return mean if committed else None

    def _live_launch(
        self, flat: torch.Tensor, index: int = 0, params: list[torch.Tensor] | None = None
    ) -> torch.futures.Future[torch.Tensor]:
        """Start the mean of ``flat`` (in place) over every rank of every replica group in the
        quorum: ``flat / W`` summed over this group's W ranks (gloo; the group's mean, the same
        bits on each of its ranks), then the quorum's mean of those over its participants,
        rank R with rank R of the other groups (``Membership.allreduce``, which waits for the
        group's sum first). Groups of equal size make that the mean over all their ranks,
        and every rank of every group holds the same bits; a group of one rank sends its
        own values as they are. With fp16/bf16 compression each replica's share of the
        quorum's mean travels cast to that type (``_live_wire``); the group's sum does not.
        Another compressor takes the group's mean and averages it over the participants with
        its own collectives (``index`` keys its state, as ``_launch``'s)."""
        membership, ctx = self._live(), self._ctx
        assert membership is not None and ctx is not None
        wire = self._live_wire
        compressed = wire is None and ctx.compressor is not ALLREDUCE
        if not compressed:  # the compressor's hook counts its own
            self._state.bytes_sent += flat.numel() * (wire or flat.dtype).itemsize
        after = None
        if self._group_sum.ranks > 1:
            flat.div_(self._group_sum.ranks)
            # the group's own all-reduce, uncompressed
            self._state.bytes_sent += flat.numel() * flat.element_size()
            # launched here, on the thread every rank's collectives are issued from, in order
            after = self._group_sum.launch(flat)
        if compressed:
            bucket = FlatBucket(flat, index=index, is_last=True, params=params or self._params)
            hook, state = ctx.compressor.hook, self._state
            return membership.exchange(lambda: hook(state, bucket), flat, after)
        if after is None:
            return membership.allreduce(flat, wire)
        return membership.allreduce(flat, wire, after=after)

    def replicas_identical(self, step: int, final: bool) -> bool:
        """Replicas agree right after each synchronization (and at the end), and only then."""
        return final or (step + 1) % self.period == 0

    def _mean(
        self, flat: torch.Tensor, index: int = 0, params: list[torch.Tensor] | None = None
    ) -> torch.Tensor:
        """Mean over ranks through the compressor (plain all-reduce when uncompressed);
        ``index`` keys the compressor's per-bucket state (a streaming fragment's own)."""
        return cast(torch.Tensor, self._launch(flat, index, params, wait=True))

    def _launch(
        self, flat: torch.Tensor, index: int, params: list[torch.Tensor] | None, wait: bool
    ) -> torch.Tensor | torch.futures.Future[torch.Tensor]:
        """Start the mean over ranks of ``flat``; its value when ``wait``, else its future."""
        ctx = self._ctx
        assert ctx is not None
        bucket = FlatBucket(flat, index=index, is_last=True, params=params or self._params)

        def run() -> torch.Tensor | torch.futures.Future[torch.Tensor]:
            if ctx.hierarchy is None:
                future = ctx.compressor.hook(self._state, bucket)
            else:  # summed in the host, the hook across hosts among the leaders, sent back
                if not ctx.hierarchy.is_leader:
                    self._state.bytes_sent += flat.numel() * flat.element_size()
                hook, state = ctx.compressor.hook, self._state
                future = ctx.hierarchy.mean_async(flat, lambda: hook(state, bucket))
            return future.wait() if wait else future

        if ctx.watch is None:
            return run()
        # The hook is inside the diagnosis too: some compressors wait on a first round there.
        return ctx.watch.run(self._step, f"averaging of {self._label(index)}", run)

    def _label(self, index: int) -> str:
        """What an exchange is called in a timeout's diagnosis."""
        assert self._ctx is not None
        return f"{self.name}:{self.period} ({self._ctx.compressor.spec})"

    def _synchronize(self) -> None:
        raise NotImplementedError

    def close(self) -> None:
        self._passes.close()

    def state_dict(self) -> dict[str, Any]:
        return {**compressor_state_dict(self._state), "in_sync": self._in_sync}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_compressor_state(self._state, state)
        self._in_sync = bool(state.get("in_sync", True))


class LocalSGD(Periodic):
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

    def settings_spec(self) -> str | None:
        return f"local:{self.period}" if self.name == "local" else None  # None: a user's subclass

    def setup(self, ctx: SyncContext) -> None:
        super().setup(ctx)
        if ctx.compressor is not ALLREDUCE:
            # Taken after the Synchronizer's initial broadcast: the same on every rank.
            self._anchor = flatten(self._params).clone()

    def _synchronize_live(self, step: int) -> bool:
        """The mean of the parameters over the quorum; cast to fp16/bf16 on the way, the mean
        change since the last synchronization added to the anchor, as ``_synchronize`` does
        (the anchor, in this strategy's state, comes along when a replica heals)."""
        if self._anchor is None:
            mean = self._quorum_mean(flatten(self._params), step)
            if mean is None:
                return False
            copy_into(mean, self._params)
            return True
        change = self._quorum_mean(flatten(self._params) - self._anchor, step)
        if change is None:  # not committed: this replica keeps its own, anchor and all
            return False
        self._anchor += change
        copy_into(self._anchor, self._params)
        return True

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
    outer_lr: float = OUTER_DEFAULTS["outer_lr"]
    outer_momentum: float = OUTER_DEFAULTS["outer_momentum"]
    nesterov: bool = True

    def __post_init__(self) -> None:
        if not self.outer_lr > 0:
            raise UsageError(f"outer_lr must be > 0, got {self.outer_lr}")
        if not 0 <= self.outer_momentum < 1:
            raise UsageError(f"outer_momentum must be in [0, 1), got {self.outer_momentum}")


class DiLoCo(Periodic):
    """``diloco:H``: the user's optimizer is the inner one; every H steps the averaged
    pseudo-gradient (global minus local parameters) goes through an outer SGD with Nesterov
    momentum, and the new global parameters are copied back to every worker.

    With ``outer_lr=1`` and no momentum the outer step lands on the average of the local
    parameters, which is local SGD.

    With ``sparseloco`` compression (``Compressor.replaces_momentum``) the outer optimizer runs
    without momentum, whatever ``outer_momentum`` says: the compressor's decaying error-feedback
    accumulator is the momentum (SparseLoCo), and the outer step is plain SGD at ``outer_lr``.

    Streaming DiLoCo (``diloco:H:F:TAU:ALPHA[:SPLIT]``, or ``fragments``, ``delay``,
    ``alpha`` and ``split`` here): F fragments, each synchronized every H steps at its own
    offset, its exchange applied TAU steps after it started and mixed into the local fragment
    with weight ALPHA, or with ``keep_local=True`` (``diloco:H:F:TAU:keep``) the local steps
    taken while it was in flight kept on top of the new global values; see
    ``gradsync.strategies.streaming``. ``split`` is how the model is cut
    into fragments: "rows" (the default: every tensor cut into F blocks of rows, so each
    exchange carries 1/F of the bytes) or "layers" (whole layers strided over the fragments, the
    paper's form). Plain DiLoCo is its one-fragment, undelayed case, and runs through the same
    code (with one fragment the split changes nothing). ``delay=None`` picks
    ``gradsync.spec.default_delay``.
    """

    name = "diloco"

    def __init__(
        self,
        period: int,
        outer_lr: float = OUTER_DEFAULTS["outer_lr"],
        outer_momentum: float = OUTER_DEFAULTS["outer_momentum"],
        nesterov: bool = True,
        *,
        fragments: int = 1,
        delay: int | None = None,
        alpha: float = 0.0,
        split: str = "rows",
        eager: bool = False,
        keep_local: bool = False,
    ) -> None:
        super().__init__(period)
        self.outer = OuterConfig(
            outer_lr=outer_lr, outer_momentum=outer_momentum, nesterov=nesterov
        )
        merge = _Merge(alpha=alpha, eager=eager, keep_local=keep_local)
        spec = _streaming_spec(period, fragments, delay, split, self.outer, merge)
        #: the canonical spec (``diloco:8:2:1``), for messages
        self.spec = str(spec)
        self.streaming = spec.fragments is not None
        self.fragments = spec.fragments or 1
        self.delay = spec.delay or 0
        self.alpha = spec.alpha or 0.0
        #: ``diloco:H:F:TAU:keep``: an applied exchange keeps the local steps taken meanwhile
        self.keep_local = spec.keep
        #: how the model is cut into fragments (one of ``gradsync.spec.SPLITS``)
        self.split = spec.split or SPLITS[0]
        #: eager outer updates (``diloco:H:F:eager``, ``gradsync.strategies.eager``)
        self.eager = spec.eager
        self._eager: EagerRounds | None = None
        self._offsets = offsets(period, self.fragments)
        self._fragment_params: list[list[torch.Tensor]] = []
        self._globals: list[torch.Tensor] = []
        self._outer_opt: torch.optim.SGD | None = None
        self._pending: list[Exchange] = []
        #: each fragment's last exchange's time in flight, set on the communication thread
        self._in_flight: dict[int, Span] = {}

    def settings_spec(self) -> str | None:
        return self.spec if self.name == "diloco" else None  # None: a user's subclass

    def setup(self, ctx: SyncContext) -> None:
        if self.eager and ctx.membership is not None:
            raise UsageError(f"{self.spec} under live membership: {NOT_UNDER_MEMBERSHIP}")
        super().setup(ctx)
        if self.eager:
            self._eager = EagerRounds(self.fragments, ctx.layout.workers)
        # Under the rows split a fragment holds views of row blocks (sharing the parameters'
        # storage): flatten reads them and copy_into writes through them like whole tensors.
        self._fragment_params = fragment_tensors(
            ctx.model, self._params, self.fragments, self.split, self.spec
        )
        # The global copies are taken after the Synchronizer's broadcast, so they are the same
        # on every rank; each fragment's lives as one flat tensor that the outer optimizer owns
        # (it steps only the fragment whose gradient is set).
        self._globals = [flatten(params).clone() for params in self._fragment_params]
        # sparseloco's decaying accumulator is the outer momentum already (SparseLoCo): a
        # second one on top of it would apply every exchange again for many more.
        momentum = 0.0 if ctx.compressor.replaces_momentum else self.outer.outer_momentum
        self._outer_opt = torch.optim.SGD(
            self._globals,
            lr=self.outer.outer_lr,
            momentum=momentum,
            nesterov=self.outer.nesterov and momentum > 0,
        )

    def _label(self, index: int) -> str:
        if not self.streaming:
            return super()._label(index)
        assert self._ctx is not None
        return f"{self.spec} fragment {index} ({self._ctx.compressor.spec})"

    def _exchange(self, step: int, outcome: StepOutcome) -> StepOutcome:
        """Apply the exchanges due after ``step``, then start the fragments scheduled here (and
        apply them at once when there is no delay). Under live membership each exchange goes
        through the quorum joined before it (``_joins_quorum``) and is applied where that
        quorum commits it, plain DiLoCo being the one-fragment, undelayed case."""
        assert self._ctx is not None
        applied, committed = self._apply_due(step)
        starting = self._starting(step)
        if starting:
            self._ctx.before_collective()  # as in Periodic._exchange: needed after a raise
            before = self._state.bytes_sent
            for p in starting:
                self._start(p, step)
            more, ok = self._apply_due(step)
            if self._eager is not None:  # applied as they start, with the last rounds' means
                more += len(starting)
            # Counted once the undelayed ones are applied: under live membership a compressor's
            # hook runs (and counts its payload) on the exchange thread, after ``_start``.
            outcome.bytes_sent += self._state.bytes_sent - before
            applied, committed = applied + more, committed and ok
        if applied:
            # Ranks wait for each other where an exchange is applied, not where it starts.
            outcome.barrier = True
            self._in_sync = committed and self._replicated()
        return self._take_spans(outcome)

    def _starting(self, step: int) -> list[int]:
        """The fragments whose exchanges start after ``step``'s local step."""
        return [p for p, at in enumerate(self._offsets) if (step + 1) % self.period == at]

    def _exchanges_after(self, step: int) -> bool:
        return bool(self._starting(step))

    def _joins_quorum(self, step: int) -> bool:
        """Live membership: one quorum an exchange, joined at the run's first step and at the
        step after each exchange was applied (plain DiLoCo: each period's first step). Nothing
        is in flight there, so a replacement that heals there takes a peer's whole streaming
        state (global copies, outer momentum, no exchange half-done), and the quorum lasts
        until the exchange it carries is applied: TAU steps after its start, before the next
        fragment's starts (``gradsync.membership.check_exchange`` refuses TAU >= H // F,
        where a fragment would start at the step the previous one is applied)."""
        return not self._quorum_open and not self._pending

    def _replicated(self) -> bool:
        """Whether the replicas agree right after an exchange was applied: only when that
        exchange covered the whole model and replaced it (never under eager updates, whose
        outer steps take each rank's own share)."""
        return (
            self.fragments == 1
            and self.alpha == 0
            and not self.keep_local
            and not self._pending
            and not self.eager
        )

    def _start(self, fragment: int, step: int) -> None:
        if self._eager is not None:
            self._start_eager(fragment, self._eager)
            return
        # The training thread's part: the pseudo-gradient and the compressor's encode, and
        # under plain DiLoCo the whole exchange (the wire, the peers, the decode) as well.
        blocking = self.delay == 0 and self._live() is None
        name = f"outer_exchange[{fragment}]" if blocking else f"outer_launch[{fragment}]"
        with self._timed(name, "comm" if blocking else "step", fragment=fragment):
            local = flatten(self._fragment_params[fragment])  # a copy: training moves them
            result = self._launch_fragment(fragment, local)
        # keep: the values the pseudo-gradient was taken from
        sent = local if self.keep_local else None
        if not isinstance(result, torch.Tensor) and self._ctx and self._ctx.record_spans:
            result = self._track_in_flight(fragment, result)
        self._pending.append(Exchange(fragment, step + self.delay, result, sent))

    def _start_eager(self, fragment: int, rounds: EagerRounds) -> None:
        """Eager outer updates: what the last round's mean (a period in flight) adds to the
        share taken of it, then this round's exchange started and not waited for, and the
        outer step applied at once on both (``gradsync.strategies.eager``)."""
        params = self._fragment_params[fragment]
        own = self._globals[fragment] - flatten(params)
        with self._timed(f"outer_wait[{fragment}]", fragment=fragment):
            owed = rounds.owed(fragment, self._wait_mean)
        in_flight = self._in_flight.pop(fragment, None)
        if in_flight is not None:
            self._spans.append(in_flight)
        with self._timed(f"outer_launch[{fragment}]", fragment=fragment):
            # a copy: the exchange reduces its tensor in place, and ``own`` is kept
            result = self._launch(own.clone(), fragment, params, wait=False)
        if not isinstance(result, torch.Tensor) and self._ctx and self._ctx.record_spans:
            result = self._track_in_flight(fragment, result)
        taken = rounds.share(own)
        # a tensor of its own: the outer SGD's foreach path (a GPU's default) adds its
        # Nesterov momentum into the gradient in place, and ``taken`` is kept
        gradient = taken.clone() if owed is None else taken + owed
        with self._timed(f"outer_step[{fragment}]", fragment=fragment):
            self._apply(fragment, gradient, self.alpha)
        rounds.keep(fragment, taken, result)

    def _launch_fragment(
        self, fragment: int, local: torch.Tensor
    ) -> torch.Tensor | torch.futures.Future[torch.Tensor]:
        """Start ``fragment``'s exchange of its pseudo-gradient, global copy minus ``local``
        (its values now, flat)."""
        params = self._fragment_params[fragment]
        pseudo = self._globals[fragment] - local
        if self._live() is not None:
            # the quorum joined before it carries it; it is waited for at its due step
            assert self._quorum_open, f"{self.spec}: an exchange started with no quorum joined"
            return self._live_launch(pseudo, fragment, params)
        if self.delay == 0:
            return self._mean(pseudo, fragment, params)
        return self._launch(pseudo, fragment, params, wait=False)

    def _track_in_flight(
        self, fragment: int, future: torch.futures.Future[torch.Tensor]
    ) -> torch.futures.Future[torch.Tensor]:
        """The exchange's time in flight, launch to result (the wire, the peers, the decode on
        the communication thread), kept as a span for the step it is applied at: what the
        inner steps overlap."""
        wall0, t0 = time.time(), time.perf_counter()

        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = fut.value()
            name = f"outer_in_flight[{fragment}]"
            self._in_flight[fragment] = Span(-1, -1, name, wall0, time.perf_counter() - t0, "comm")
            return value

        return cast("torch.futures.Future[torch.Tensor]", exit_safety.then(future, done))

    def _apply_due(self, step: int) -> tuple[int, bool]:
        """Apply (in the order they started) the exchanges due by ``step``: how many were due,
        and whether all were applied. Under live membership the quorum decides at the due
        step: one not committed (a participant lost while it was in flight) is not applied,
        its fragment keeping its local values, global copy and outer momentum."""
        due = [ex for ex in self._pending if ex.due <= step]
        self._pending = [ex for ex in self._pending if ex.due > step]
        membership = self._live()
        committed = True
        for ex in due:
            if isinstance(ex.result, torch.Tensor):  # waited for already (no delay)
                mean = ex.result
            else:
                with self._timed(f"outer_wait[{ex.fragment}]", fragment=ex.fragment):
                    mean = self._resolve(ex)
            in_flight = self._in_flight.pop(ex.fragment, None)
            if in_flight is not None:
                self._spans.append(in_flight)
            if membership is not None:
                ok = membership.commit(ex.due)
                self._quorum_open = False
                if not ok:
                    committed = False
                    continue
            with self._timed(f"outer_step[{ex.fragment}]", fragment=ex.fragment):
                self._apply(ex.fragment, mean, self.alpha, ex.sent)
        return len(due), committed

    def _resolve(self, ex: Exchange) -> torch.Tensor:
        """The mean pseudo-gradient of ``ex``, waited for if still in flight (the wait is this
        rank's communication or idle time: it lands in the step's sync time)."""
        ex.result = self._wait_mean(ex.fragment, ex.result)
        return ex.result

    def _wait_mean(self, fragment: int, result: Result) -> torch.Tensor:
        """The mean an exchange of ``fragment`` gives, waited for if still in flight."""
        if isinstance(result, torch.Tensor):
            return result
        ctx = self._ctx
        assert ctx is not None
        if ctx.watch is None:
            return result.wait()
        what = f"averaging of {self._label(fragment)}"
        return cast(torch.Tensor, ctx.watch.run(self._step, what, result.wait))

    def _apply(
        self, fragment: int, mean: torch.Tensor, alpha: float, sent: torch.Tensor | None = None
    ) -> None:
        """The outer step of one fragment, then its local copy mixed with the new global one
        (``sent``, under ``keep``: the new global one plus the local steps since ``sent``)."""
        assert self._outer_opt is not None
        target = self._globals[fragment]
        target.grad = mean
        self._outer_opt.step()
        target.grad = None
        params = self._fragment_params[fragment]
        if sent is not None:
            local = flatten(params).to(target.dtype)
            copy_into(local.sub_(sent).add_(target), params)
        elif alpha == 0:
            copy_into(target, params)
        else:
            # alpha * local + (1 - alpha) * global
            copy_into(torch.lerp(target, flatten(params).to(target.dtype), alpha), params)

    def _synchronize_live(self, step: int) -> bool:
        """The last synchronization (``finalize``): every fragment's outer step on the quorum's
        mean pseudo-gradient, each replaced by its new global copy. Its quorum is the one
        joined after the last exchange was applied, or one of its own where the run ended
        right at that exchange (``_quorum_mean``)."""
        pseudo = [g - flatten(p) for g, p in zip(self._globals, self._fragment_params, strict=True)]
        mean = self._quorum_mean(torch.cat(pseudo), step)
        if mean is None:
            return False
        for fragment, part in enumerate(mean.split([g.numel() for g in self._globals])):
            self._apply(fragment, part, 0.0)
        return True

    def _synchronize(self) -> None:
        """Every fragment at once, replaced by its new global copy (the end of training);
        under eager updates, the replicas' parameters averaged (their global copies differ)."""
        if self._eager is not None:
            self._average_replicas()
            return
        for fragment, params in enumerate(self._fragment_params):
            pseudo = self._globals[fragment] - flatten(params)
            self._apply(fragment, self._mean(pseudo, fragment, params), 0.0)

    def finalize(self) -> None:
        """Exchanges still in flight are applied first, as they would have been; then, unless
        that left the replicas agreeing, one synchronous exchange of every fragment. Under
        eager updates each fragment's last round is completed (the rest of its mean), then the
        replicas are averaged (``_average_replicas``)."""
        applied, committed = self._apply_due(sys.maxsize)
        if applied:
            self._in_sync = committed and self._replicated()
        if self._eager is not None:
            for fragment, rest in self._eager.rest(self._wait_mean):
                self._apply(fragment, rest, 0.0)
                self._in_sync = False
        super().finalize()

    def _average_replicas(self) -> None:
        """Eager updates' end: the parameters' plain mean over the ranks (uncompressed, one
        all-reduce), which the global copies then hold too, so every rank leaves ``report()``
        with the same model."""
        ctx = self._ctx
        assert ctx is not None
        flat = flatten(self._params)

        def average() -> None:
            dist.all_reduce(flat, group=ctx.group)

        what = f"final averaging of {self.spec}"
        average() if ctx.watch is None else ctx.watch.run(self._step, what, average)
        self._state.bytes_sent += flat.numel() * flat.element_size()
        copy_into(flat.div_(ctx.layout.workers), self._params)
        with torch.no_grad():
            for target, params in zip(self._globals, self._fragment_params, strict=True):
                target.copy_(flatten(params))

    def replicas_identical(self, step: int, final: bool) -> bool:
        """At the end; mid-run right after each exchange, and only for one fragment replaced
        by its global copy (with several, the others have moved on locally)."""
        if final:
            return True
        if self.fragments > 1 or self.alpha or self.eager or self.keep_local:
            return False
        started = step - self.delay
        return started >= 0 and (started + 1) % self.period == 0

    def state_dict(self) -> dict[str, Any]:
        assert self._outer_opt is not None
        # Exchanges in flight are waited for first: their results are saved (and applied at
        # their due step after a resume), and an error-feedback residual only reaches the
        # compressor's state when its exchange completes.
        pending = [
            {
                "fragment": ex.fragment,
                "due": ex.due,
                "mean": self._resolve(ex).detach().clone(),
                **({} if ex.sent is None else {"sent": ex.sent.clone()}),
            }
            for ex in self._pending
        ]
        # likewise the eager rounds in flight, before the compressor's state is read
        eager = None if self._eager is None else self._eager.state_dict(self._wait_mean)
        state = super().state_dict()
        state["global"] = torch.cat([g.detach() for g in self._globals]).clone()
        state["outer_optimizer"] = self._outer_opt.state_dict()
        if eager is not None:
            state["eager"] = eager
        if self.streaming:
            state["streaming"] = {
                "fragments": self.fragments,
                "split": self.split,
                "pending": pending,
            }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        assert self._outer_opt is not None
        saved = state.get("streaming", {})
        check_saved_fragments(saved, self.fragments, self.split, self.spec)
        _check_saved_eager(state, self._eager is not None, self.spec)
        saved_pending = [] if self._live() is not None else saved.get("pending", [])
        _check_saved_keep(saved_pending, self.keep_local, self.spec)
        for ex in self._pending:  # whatever is in flight completes before it is replaced
            self._resolve(ex)
        if self._eager is not None:  # so does an eager round (its residual comes back then)
            self._eager.settle(self._wait_mean)
        super().load_state_dict(state)
        sizes = [g.numel() for g in self._globals]
        with torch.no_grad():
            for target, part in zip(self._globals, state["global"].split(sizes), strict=True):
                target.copy_(part)
        self._outer_opt.load_state_dict(state["outer_optimizer"])
        # A checkpoint is loaded onto the CPU; an exchange's mean becomes its fragment's
        # gradient at its due step, so it goes where that fragment's global copy lives.
        # Under live membership a saved exchange's commit was never decided (its quorum is
        # gone with the run that saved it, and a failed all-reduce leaves garbage in the
        # mean): it is dropped, as one not committed, its fragment keeping its own values.
        # (A peer's state, when healing, has none: quorums are joined with nothing in flight.)
        self._pending = [
            _saved_exchange(ex, self._globals, self.keep_local) for ex in saved_pending
        ]
        if self._eager is not None:
            self._eager.load_state_dict(state.get("eager"), self._globals[0].device)


def _check_saved_keep(pending: list[dict[str, Any]], keep_local: bool, spec: str) -> None:
    """A DiLoCo with ``keep`` loading a state whose exchange in flight was saved without it (the
    Python API's ``load_state_dict``; ``sync.load`` refuses the other spec before): the local
    steps that exchange's merge should keep cannot be told apart. Checked before anything is
    loaded, so a refused load leaves the strategy as it was."""
    lacking = [int(ex["fragment"]) for ex in pending if ex.get("sent") is None]
    if keep_local and lacking:
        raise UsageError(
            f"{spec}: this checkpoint's exchange in flight (fragment {lacking[0]}) was saved "
            "without keep; load it into a DiLoCo without keep_local (the spec it was saved "
            "under)"
        )


def _check_saved_eager(state: dict[str, Any], eager: bool, spec: str) -> None:
    """A DiLoCo's state with eager rounds loaded into one without them, or the reverse (the
    Python API's ``load_state_dict``; ``sync.load`` refuses the other spec before): the
    replicas' global copies of an eager run differ, which a run of TAU would never reconcile."""
    if ("eager" in state) != eager:
        saved = "with eager outer updates" if "eager" in state else "without eager updates"
        raise UsageError(
            f"{spec}: this DiLoCo state was saved {saved}; load it into a DiLoCo "
            f"{'with' if 'eager' in state else 'without'} eager=True (the same spec as saved)"
        )


@dataclass(frozen=True, slots=True)
class GroupSum:
    """A replica group's own sum under live membership: its ``ranks``, and ``launch``, which
    starts a tensor's sum over them in place and returns its wait."""

    ranks: int
    launch: Callable[[torch.Tensor], Callable[[], object]]


def group_sum(group: dist.ProcessGroup | None) -> GroupSum:
    """``group``'s sum: a plain gloo all-reduce, uncompressed (``Periodic._live_launch``). A
    function of its own so that a test can stand in for a group of several ranks without
    starting processes (tests/unit/test_group_quorum_mean_unit.py)."""

    def launch(flat: torch.Tensor) -> Callable[[], object]:
        work = dist.all_reduce(flat, group=group, async_op=True)
        assert work is not None
        return work.wait

    return GroupSum(runtime.world_size(group), launch)


def _saved_exchange(
    saved: dict[str, Any], globals_: list[torch.Tensor], keep_local: bool
) -> Exchange:
    """An exchange a checkpoint held (``state_dict``'s pending entries), its tensors moved to
    where its fragment's global copy lives (a checkpoint is loaded onto the CPU). One saved
    under ``keep`` carries the values it was sent from; loaded into a DiLoCo without ``keep``
    they are dropped (``_check_saved_keep`` refused the reverse before anything was loaded)."""
    fragment = int(saved["fragment"])
    device = globals_[fragment].device
    sent = saved.get("sent")
    return Exchange(
        fragment,
        int(saved["due"]),
        saved["mean"].to(device, copy=True),
        sent.to(device, copy=True) if sent is not None and keep_local else None,
    )


@dataclass(frozen=True, slots=True)
class _Merge:
    """How a DiLoCo built by hand applies an exchange: ALPHA's mix, eager, or keep."""

    alpha: float = 0.0
    eager: bool = False
    keep_local: bool = False


def _streaming_spec(
    period: int,
    fragments: int,
    delay: int | None,
    split: str,
    outer: OuterConfig,
    merge: _Merge,
) -> StrategySpec:
    """The spec a DiLoCo built by hand stands for, checked by the one spec parser, so a bad
    argument gets the message of the spec string that would carry it."""
    text = f"diloco:{period}:{fragments}"
    eager, alpha, given_delay = merge.eager, merge.alpha, delay
    for name, value in (("eager", eager), ("keep_local", merge.keep_local)):
        if not isinstance(value, bool):
            raise UsageError(f"{name} must be True or False, got {value!r}")
    if merge.keep_local and (eager or alpha):
        raise UsageError(
            f"keep_local=True takes no {'eager=True' if eager else f'alpha (got {alpha!r})'}: "
            "it is the way an exchange is applied, in place of ALPHA's mix"
        )
    if eager:
        if delay or alpha:
            raise UsageError(
                f"eager=True takes no delay or alpha (got delay={delay!r}, alpha={alpha!r}): "
                "each fragment's exchange is applied a period after it starts"
            )
        text += f":{EAGER}"
        delay = None
    elif delay is None:
        delay = parse_strategy_spec(text).delay or 0
    if merge.keep_local and not delay:
        given = (
            f"no delay given, and the default for {fragments} fragment(s) is 0"
            if given_delay is None
            else f"got delay={delay!r}"
        )
        raise UsageError(
            f"keep_local=True needs delay >= 1 ({given}): with no delay, no local step falls "
            "between an exchange's start and its application"
        )
    # A word is the parser's to judge (its message names the spec); what it would read as
    # another number, or as no field at all, is refused here.
    if not isinstance(split, str) or split.strip().lower() not in SPLITS:
        try:
            float(split)
            word = False
        except (TypeError, ValueError):
            word = isinstance(split, str) and bool(split.strip())
        if not word:
            raise UsageError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    options = outer_options({"outer_lr": outer.outer_lr, "outer_momentum": outer.outer_momentum})
    fields = "" if eager else f":{delay}:{KEEP if merge.keep_local else alpha}"
    return parse_strategy_spec(f"{text}{fields}:{split}{options}")
