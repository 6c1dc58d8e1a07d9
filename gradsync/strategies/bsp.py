"""BSP: every step, every replica applies the mean gradient of the global batch.

Gradients are exchanged bucket by bucket from autograd hooks (see ``gradsync.buckets``), so
most communication overlaps the backward pass; the step then waits for every bucket, writes
the mean gradient back into ``p.grad`` and calls the user's ``optimizer.step()`` unchanged.

Under live membership (``SyncContext.membership``, ``membership="torchft"``) the group is one
replica and the exchange crosses replicas through the quorum instead: each step joins the
quorum first, each bucket is averaged over the step's participants, and the update is applied
only where the quorum commits the step.
"""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from gradsync import exit_safety, runtime
from gradsync.bucket_autotune import AUTO, STEPS_PER_PLAN, WARMUP_STEPS, BucketTuner, candidates
from gradsync.buckets import MB, BucketReducer, distinct_plans
from gradsync.checks.guards import (
    finite_given_sums,
    finite_sum,
    nonfinite_flag,
    scrub_nonfinite_on_device,
    scrub_nonfinite_state,
    scrubs_on_device,
)
from gradsync.compression.allreduce import ALLREDUCE
from gradsync.compression.base import FlatBucket
from gradsync.errors import UsageError
from gradsync.logs import get_logger
from gradsync.strategies.base import (
    Membership,
    StepOutcome,
    StepPlan,
    Strategy,
    SyncContext,
    commit_or_skip,
    compressor_state_dict,
    device_verdict,
    live_exchange,
    load_compressor_state,
    scaler_on_device,
    step_verdict,
)
from gradsync.strategies.passes import wrong_passes
from gradsync.telemetry.records import Span

logger = get_logger("strategies.bsp")


class BSP(Strategy):
    name = "bsp"
    barrier_free = False
    weights_samples = True
    #: every replica holds the same model and optimizer state, so rank 0's seeds any world size
    resizable = True
    lockstep = True
    replicates_every_step = True
    gate_ahead = True
    takes_hierarchy = True
    drops_unused_gradients = True

    def __init__(self) -> None:
        self._ctx: SyncContext | None = None
        self._reducer: BucketReducer | None = None
        self._state: Any = None
        self._micro_batches = 1
        self._average_over = 1
        self._bytes_at_start = 0
        #: plain all-reduce: the mean's 1/W and 1/k are applied while gradients are copied into
        #: their buckets and the exchange is a bare sum, so no pass over the reduced buffers
        #: is needed to divide them (DDP does the same). Compressors divide in their own hook.
        self.fused_mean = False
        self._world = 1
        self._params: list[torch.Tensor] = []
        #: ``bucket_mb="auto"``'s trials (None: a fixed plan)
        self._tuner: BucketTuner | None = None
        self._step_started: float | None = None
        #: live membership's quorum (None: ``ctx.group`` holds every replica)
        self._membership: Membership | None = None
        #: the dtype the quorum's all-reduce sends (fp16/bf16 compression), None: as is
        self._live_wire: torch.dtype | None = None

    def setup(self, ctx: SyncContext) -> None:
        self._ctx = ctx
        self._params = [p for p in ctx.model.parameters() if p.requires_grad]
        hierarchy = ctx.hierarchy
        # Under a hierarchy a compressor runs on the leaders only, across hosts.
        group = ctx.group if hierarchy is None else hierarchy.leader_group
        self._world = runtime.world_size(ctx.group)
        self._membership = ctx.membership
        # Under live membership, after the replica group's own sum (``_exchange_live``)
        self._live_wire, exchanged_over = live_exchange(ctx, group)
        self._state = ctx.compressor.make_state(exchanged_over)
        self.fused_mean = ctx.compressor is ALLREDUCE or self._live_wire is not None
        assert self._membership is None or hierarchy is None
        if ctx.bucket_mb == AUTO:
            self._tuner = self._make_tuner(ctx)
            self._reducer = self._make_reducer(self._tuner.plan_for_next_step())
        else:
            assert not isinstance(ctx.bucket_mb, str), ctx.bucket_mb
            self._reducer = self._make_reducer(ctx.bucket_mb)
        # Under bucket_mb auto the plan is said once it is kept (``_retune``), unless there
        # is nothing to time.
        if ctx.rank == 0 and (self._tuner is None or not self._tuner.deciding):
            self._log_plan(ctx.bucket_mb)

    def _make_tuner(self, ctx: SyncContext) -> BucketTuner:
        if not self.fused_mean or ctx.hierarchy is not None:
            # A compressor keeps state per bucket (residuals, PowerSGD's factors), which a
            # change of plan mid-run would misplace.
            given = (
                f"compression {ctx.compressor.spec!r}"
                if not self.fused_mean
                else "allreduce='hierarchical'"
            )
            raise UsageError(
                f"bucket_mb='auto' tunes the plain all-reduce's buckets; with {given} give "
                "bucket_mb a number (or None for the default plan)"
            )
        total_mb = sum(p.numel() * p.element_size() for p in self._params) / MB
        # the same buckets under two sizes are one plan: timed once
        tuner = BucketTuner(distinct_plans(self._params, candidates(total_mb)))
        if ctx.rank == 0 and not tuner.deciding:
            logger.info("%s: bucket_mb auto: one plan for this model, nothing to time", self.name)
        elif ctx.rank == 0:
            logger.info(
                "%s: bucket_mb auto: timing plans of %s MB over the first %d steps",
                self.name,
                ", ".join(f"{mb:g}" for mb in tuner.plans),
                WARMUP_STEPS + STEPS_PER_PLAN * len(tuner.plans),
            )
        return tuner

    def _make_reducer(self, bucket_mb: float | None) -> BucketReducer:
        assert self._ctx is not None
        ctx = self._ctx
        reducer = BucketReducer(self._params, bucket_mb, self._exchange, ctx.record_spans)
        # Every exchange (plain sum, compressor, hierarchy) writes into a bucket through an
        # alias the guard does not count, so a write it sees in flight is the script's, racing
        # the exchange (issue 42, trap 2).
        reducer.guard_writes = True
        # A plain sum carries NaN/Inf to every rank by itself; lossy exchanges need the poison.
        reducer.poison_nonfinite = ctx.skip_nonfinite and ctx.compressor is not ALLREDUCE
        # A bucket ready before the step gate opens is posted at a later hook or the block's
        # end, so that backward goes on meanwhile (checks.gate_ahead).
        reducer.may_launch = ctx.collective_ready
        return reducer

    def _log_plan(self, asked: float | str | None) -> None:
        reducer = self.reducer
        sizes = [b.nbytes / MB for b in reducer.buckets]
        why = ""
        if asked is None:
            why = ": the default plan"
        elif asked == AUTO:
            why = ": kept by bucket_mb auto"
        logger.info(
            "%s: %d gradient bucket(s) of %s MiB (bucket_mb %g%s)",
            self.name,
            len(sizes),
            ", ".join(f"{mb:.2f}" for mb in sizes),
            reducer.bucket_mb,
            why,
        )

    def _retune(self, step: int) -> None:
        """Under ``bucket_mb="auto"``, at the start of a step: time the step before, decide once
        every plan has its steps (one collective, on every rank at the same step), and switch
        the reducer to the plan this step runs."""
        assert self._ctx is not None and self._tuner is not None
        ctx, tuner = self._ctx, self._tuner
        now = time.perf_counter()
        if self._step_started is not None:
            tuner.record(now - self._step_started)
        if tuner.ready_to_decide:
            ctx.before_collective()
            agreed = torch.tensor(tuner.medians(), dtype=torch.float64, device=runtime.device())

            def slowest_rank() -> None:
                dist.all_reduce(agreed, op=dist.ReduceOp.MAX, group=ctx.group)

            if self._world > 1 and ctx.watch is not None:
                ctx.watch.run(step, "bucket_mb auto: agreeing on the plan", slowest_rank)
            elif self._world > 1:
                slowest_rank()
            times = agreed.cpu().tolist()
            tuner.decide(times)
            if ctx.rank == 0:
                logger.info("%s: bucket_mb auto: %s", self.name, tuner.describe(times))
            decided = True
        else:
            decided = False
        mb = tuner.plan_for_next_step()
        if abs(mb - self.reducer.bucket_mb) > 1e-9:
            self.reducer.close()
            self._reducer = self._make_reducer(mb)
        if decided and ctx.rank == 0:  # once, whichever plan won (a switch or not)
            self._log_plan(AUTO)
        self._step_started = None if not tuner.deciding else time.perf_counter()

    @property
    def reducer(self) -> BucketReducer:
        assert self._reducer is not None, "setup() has not run"
        return self._reducer

    @property
    def compressor_state(self) -> Any:
        return self._state

    def _exchange(self, bucket: FlatBucket) -> torch.futures.Future[torch.Tensor]:
        assert self._ctx is not None
        self._ctx.before_collective()
        if self._membership is not None:
            return self._exchange_live(self._membership, bucket)
        if self.fused_mean and self._ctx.hierarchy is not None:
            buf = bucket.buffer()
            self._state.bytes_sent += buf.numel() * buf.element_size()
            return self._ctx.hierarchy.sum_async(buf)
        if self.fused_mean:
            return _allreduce_sum(self._state, bucket)
        hierarchy = self._ctx.hierarchy
        if hierarchy is not None:
            if not hierarchy.is_leader:  # its part is the reduce to the host's leader
                buf = bucket.buffer()
                self._state.bytes_sent += buf.numel() * buf.element_size()
            hook, state = self._ctx.compressor.hook, self._state
            return hierarchy.mean_async(bucket.buffer(), lambda: hook(state, bucket))
        return self._ctx.compressor.hook(self._state, bucket)

    def _exchange_live(
        self, membership: Membership, bucket: FlatBucket
    ) -> torch.futures.Future[torch.Tensor]:
        """The bucket's exchange across the quorum, after the replica group's own sum (W ranks;
        none to make when W is 1), which makes the group's gradient. A plain mean: the bucket
        holds this rank's gradient times its 1/(W k), so the group's sum is the group's mean
        and the quorum's mean of those the step's gradient. A compressor's: the bucket holds
        the gradient as is, so the group's sum is divided by W before the compressor, whose
        mean over the participants is the step's gradient."""
        assert self._ctx is not None
        buf = bucket.buffer()
        group_sum = None
        if self._world > 1:
            self._state.bytes_sent += buf.numel() * buf.element_size()
            group_sum = _group_sum(buf, self._ctx.group)
        if not self.fused_mean:
            hook, state, world = self._ctx.compressor.hook, self._state, self._world

            def group_mean() -> None:
                if group_sum is not None:
                    group_sum.wait()
                    buf.div_(world)

            return membership.exchange(lambda: hook(state, bucket), buf, group_mean)
        wire = self._live_wire or buf.dtype
        self._state.bytes_sent += buf.numel() * wire.itemsize
        after = None if group_sum is None else group_sum.wait
        return membership.allreduce(buf, self._live_wire, after)

    def begin_step(self, plan: StepPlan) -> None:
        assert self._ctx is not None
        if self._membership is not None:
            # Before anything of the step: a replacement heals here (model, optimizer, the
            # Synchronizer's state), and its first exchange is then its peers'.
            self._membership.start_step(plan.step)
        if self._tuner is not None and self._tuner.deciding:
            self._retune(plan.step)
        self._ctx.found_inf = None  # a verdict a raising update left behind
        # No optimizer.zero_grad() here: arm() releases every p.grad (it was a view into a
        # bucket holding last step's reduced gradient) before the backward pass.
        self._micro_batches = plan.micro_batches
        self._average_over = plan.average_over
        # Hooks launch buckets (and count their bytes) during backward, inside the block.
        self._bytes_at_start = self._state.bytes_sent
        scale = plan.sample_weight
        if self.fused_mean:
            scale /= self._world * plan.average_over
        self.reducer.scale = scale
        self.reducer.arm(plan.micro_batches)

    def gradients_ready(self, step: int) -> StepOutcome:
        assert self._ctx is not None
        reducer = self.reducer
        passes = reducer.backward_passes()
        if passes != self._micro_batches:
            # Checked before flush so no rank has launched a partial set of buckets because of it.
            reducer.flush_abort()
            raise wrong_passes(self._micro_batches, passes)
        reducer.flush()
        outcome = self._finish_exchange(step)
        if self._ctx.find_unused_parameters and not outcome.skipped:
            self._drop_unused(step)
        return outcome

    def _drop_unused(self, step: int) -> None:
        """``find_unused_parameters=True``, as DDP: a parameter that no rank's backward pass
        reached this step keeps ``grad`` None, so the optimizer leaves it alone (its momentum,
        its weight decay); the exchange gave it zeros. Which ones: one all-reduce of a flag per
        parameter, as DDP's bitmap (a host read of it too)."""
        ctx = self._ctx
        assert ctx is not None
        reducer = self.reducer
        flags = [reducer.got_gradient(p) for p in self._params]
        used = torch.tensor(flags, dtype=torch.int32, device=self._params[0].device)
        if self._world > 1:

            def everyone() -> None:
                dist.all_reduce(used, group=ctx.group)

            what = "find_unused_parameters: which parameters were used"
            everyone() if ctx.watch is None else ctx.watch.run(step, what, everyone)
        for p, count in zip(self._params, used.tolist(), strict=True):
            if not count:
                p.grad = None

    def abandon(self, step: int) -> StepOutcome:
        """This rank's block raised: send every bucket not yet sent, as NaN where its
        gradients were not final, so the peers' exchange completes and every rank skips the
        step together (the non-finite guard, or the GradScaler). Backward finished before the
        raise (every bucket's gradients final, sent or held back for the gate): the step
        completes as on the peers."""
        assert self._ctx is not None
        reducer = self.reducer
        if not reducer.armed:
            return StepOutcome(skipped=True)
        if not (self._ctx.skip_nonfinite or self._ctx.scaling):
            # Nothing would make the peers skip a NaN: they would apply it. Leave them to time
            # out instead; their message names this rank's exception.
            reducer.flush_abort()
            return StepOutcome(skipped=True)
        reducer.flush(poison=True)
        return self._finish_exchange(step, check_script_writes=False)

    def _finish_exchange(self, step: int, check_script_writes: bool = True) -> StepOutcome:
        assert self._ctx is not None
        reducer = self.reducer
        ctx = self._ctx
        checked = ctx.skip_nonfinite or ctx.scaling
        # The host verdict's sums, bucket by bucket as each arrives: only the last bucket's
        # is left after the exchange (38 MB of gradient: 1.6 ms of CPU, one thread).
        sums: list[torch.Tensor] = []

        def summed(t: torch.Tensor) -> None:
            sums.append(finite_sum(t))

        each = summed if checked and not self._verdict_on_device(step) else None
        if ctx.watch is not None:
            what = f"gradient exchange ({len(reducer.buckets)} bucket(s), {ctx.compressor.spec})"
            reduced = ctx.watch.run(step, what, lambda: reducer.wait(step, each))
        else:
            reduced = reducer.wait(step, each)
        if reducer.written_in_flight and check_script_writes:
            raise written_in_flight(step, reducer.written_in_flight)
        nbytes = self._state.bytes_sent - self._bytes_at_start
        spans = reducer.take_spans()
        # Asked again: the exchange may have made a state's first warm start (PowerSGD's),
        # which the device verdict cannot scrub; the sums are then taken here.
        if self._verdict_on_device(step):
            return self._ready_on_device(reduced, nbytes, spans)
        if checked and not finite_given_sums(sums or [finite_sum(t) for t in reduced], reduced):
            scrub_nonfinite_state(self._state)
            if not ctx.scaling:
                # Every rank holds the same reduced bits, so every rank skips this same step.
                ctx.optimizer.zero_grad(set_to_none=True)
                return StepOutcome(bytes_sent=nbytes, skipped=True, spans=spans)
            # A GradScaler finds the same non-finite values on every rank in update() and
            # skips there, lowering its scale as it would under DDP.
        # The mean over ranks and micro-batches (so that k micro-batches of a mean-reduced loss
        # equal one batch k times as large) was applied at copy-in for a plain sum; otherwise
        # the compressor's hook took the mean over ranks and the micro-batches' is taken here.
        remaining = 1.0 if self.fused_mean else 1.0 / self._average_over
        reducer.write_back(reduced, scale=remaining)
        return StepOutcome(bytes_sent=nbytes, spans=spans)

    def _verdict_on_device(self, step: int) -> bool:
        """Whether this step's non-finite verdict stays on the device: the fused optimizer
        takes gradsync's flag (``device_verdict``) or a GradScaler's (``scaler_on_device``),
        and a compressor's state, if any, can be scrubbed there (``scrubs_on_device``: not
        PowerSGD's warm starts). A torchft quorum decides its commit on the host anyway.
        On every rank alike: whether the update gathers after it (``zero:1``) follows the
        decision, so no rank may differ. gradsync's flag once an update was applied (the
        rule is ``device_verdict``'s), a GradScaler's from the second step."""
        ctx = self._ctx
        assert ctx is not None
        return (
            step > 0
            and self._membership is None
            and (device_verdict(ctx) or scaler_on_device(ctx))
            and (self.fused_mean or scrubs_on_device(self._state))
        )

    def _ready_on_device(
        self, reduced: list[torch.Tensor], nbytes: int, spans: list[Span]
    ) -> StepOutcome:
        """The gradient-ready point with the verdict left on the device. Every rank computes
        the same flag from the same reduced bits: a compressor's state is scrubbed where it is
        set, and the optimizer skips on it (or, with a GradScaler, on the scaler's own
        ``found_inf``, in ``update``), so every rank skips this same step with no host read."""
        ctx = self._ctx
        assert ctx is not None
        flag = None if self.fused_mean and ctx.scaling else nonfinite_flag(reduced)
        if not self.fused_mean:
            assert flag is not None
            scrub_nonfinite_on_device(self._state, flag)
        self.reducer.write_back(reduced, scale=1.0 if self.fused_mean else 1.0 / self._average_over)
        if ctx.scaling:
            return StepOutcome(bytes_sent=nbytes, spans=spans)
        ctx.found_inf = flag
        return StepOutcome(bytes_sent=nbytes, spans=spans, found_inf=flag)

    def update(self, step: int, outcome: StepOutcome) -> StepOutcome:
        assert self._ctx is not None
        if self.reducer.late_gradient:
            raise late_gradient(step)
        commit_or_skip(self._membership, step, self._ctx.optimizer, outcome)
        if outcome.skipped:
            return outcome
        wall0, t0 = time.time(), time.perf_counter()
        step_verdict(self._ctx, outcome)
        if self._ctx.record_spans:
            span = Span(-1, -1, "optimizer", wall0, time.perf_counter() - t0, "step")
            outcome.spans.append(span)
        return outcome

    def summary(self) -> dict[str, Any]:
        """The bucket plan the run ended with (report.json), and what ``bucket_mb="auto"``
        timed."""
        reducer = self.reducer
        out: dict[str, Any] = {
            "bucket_mb": reducer.bucket_mb,
            "bucket_sizes_mb": [round(b.nbytes / MB, 4) for b in reducer.buckets],
        }
        if self._tuner is not None:
            out["bucket_mb_auto"] = {
                "tried_mb": self._tuner.plans,
                "chosen_mb": self._tuner.chosen,
            }
        return out

    def replicas_identical(self, step: int, final: bool) -> bool:
        """Whether every replica must hold the same parameters after ``step`` (always, in BSP).
        The answer must be the same on every rank: it decides a collective."""
        return True

    def state_dict(self) -> dict[str, Any]:
        return compressor_state_dict(self._state)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        load_compressor_state(self._state, state)

    def close(self) -> None:
        if self._reducer is not None:
            self._reducer.close()


def written_in_flight(step: int, buckets: list[int]) -> UsageError:
    """The script wrote into gradients before their exchange had completed: in flight, or
    held back until the step gate opened (every rank finds the write, whichever it was)."""
    return UsageError(
        f"step {step}: p.grad was changed in place inside the sync.step() block before its "
        f"exchange had completed (bucket(s) {', '.join(map(str, buckets))}), e.g. by "
        "clip_grad_norm_ or scaler.unscale_ before s.synchronize(): the write races the "
        "exchange and the replicas drift apart. Call s.synchronize() first (it waits for the "
        "exchange), then clip; or use gs.DistributedDataParallel, whose exchange ends with "
        "backward (docs/porting.md)"
    )


def late_gradient(step: int) -> UsageError:
    """A backward pass ran after the gradient-ready point (``s.synchronize()``)."""
    return UsageError(
        f"step {step}: a backward pass ran after s.synchronize(); its gradient was added "
        "to the averaged one on this rank only. Run every backward pass of the step "
        "before synchronize()"
    )


def _allreduce_sum(state: Any, bucket: FlatBucket) -> torch.futures.Future[torch.Tensor]:
    """The uncompressed exchange without its division: the bucket already holds g / W.

    Waited as its future, through a callback (``exit_safety.then``). Waiting on the work
    itself (a ``Launched`` class in buckets, ac9403c) saved the callback's hand-over on gloo's
    thread, but with it a rank whose peer was stopped (SIGSTOP) mid-run went on to the next
    step's gate and failed there, 12.8 s after the stop instead of about 7
    (tests/e2e/test_stopped_worker.py failed 6 times in 8 with it, passed 6 in 6 without); not
    understood yet, so undone."""
    buf = bucket.buffer()
    state.bytes_sent += buf.numel() * buf.element_size()
    return _group_sum(buf, state.group)


def _group_sum(
    buf: torch.Tensor, group: dist.ProcessGroup | None
) -> torch.futures.Future[torch.Tensor]:
    """The sum of ``buf`` over ``group``, started (the plain exchange's, and under live
    membership the replica group's own), waited as its future."""
    work = dist.all_reduce(buf, group=group, async_op=True)
    assert work is not None
    return exit_safety.then(work.get_future(), _first)


def _first(fut: torch.futures.Future[list[torch.Tensor]]) -> torch.Tensor:
    return fut.value()[0]
