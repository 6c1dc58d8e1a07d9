"""Gradient buckets fired from autograd hooks, so communication overlaps the backward pass.

Parameters are grouped, in reverse registration order (roughly the order backward produces
their gradients), into buckets of about ``bucket_mb``, the first of at most
``spec.FIRST_BUCKET_MB`` (1 MiB, as DDP's first bucket: it leaves while backward goes on). A
post-accumulate-grad hook on every parameter counts how many backward passes have reached it
this step; when every parameter of a bucket has seen the step's last micro-batch, the bucket is
flattened (its gradients copied into one buffer, scaled on the way) and its exchange launched
asynchronously through the function the strategy passes in (a plain all-reduce or a
compressor's hook).

Buckets are launched strictly in index order on every rank, because collectives on one process
group must be issued in the same order everywhere. A bucket that is ready early waits for its
predecessors; a parameter that receives no gradient this step holds its bucket (and those after
it) until ``flush()`` at block exit, where missing gradients count as zeros. So an unused
parameter costs overlap, never a hang or a desynchronised step.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from gradsync import compat, exit_safety
from gradsync.checks.guards import poison_nonfinite_
from gradsync.compression.base import FlatBucket
from gradsync.spec import FIRST_BUCKET_MB, default_bucket_mb
from gradsync.telemetry.records import Span

MB = 1024 * 1024


def plan_buckets(
    params: Sequence[torch.Tensor], bucket_mb: float, first_bucket_mb: float = FIRST_BUCKET_MB
) -> list[list[torch.Tensor]]:
    """Group parameters in reverse order into buckets of at most ``bucket_mb``, the first of at
    most ``first_bucket_mb`` (a parameter larger than its bucket's cap gets a bucket of its
    own); a bucket never mixes dtypes or devices."""
    limit = min(first_bucket_mb, bucket_mb) * MB
    buckets: list[list[torch.Tensor]] = []
    current: list[torch.Tensor] = []
    size = 0
    for p in reversed(list(params)):
        nbytes = p.numel() * p.element_size()
        mixed = bool(current) and (current[0].dtype, current[0].device) != (p.dtype, p.device)
        if current and (size + nbytes > limit or mixed):
            buckets.append(current)
            current, size = [], 0
            limit = bucket_mb * MB  # the first bucket is closed: the others take bucket_mb
        current.append(p)
        size += nbytes
    if current:
        buckets.append(current)
    return buckets


def distinct_plans(params: Sequence[torch.Tensor], sizes: Sequence[float]) -> list[float]:
    """``sizes`` without those that group ``params`` into the same buckets as an earlier one.
    Sizes are only caps: on a model of a few large tensors several give one plan (a 38 MB mlp
    whose 37 MB weight is a bucket of its own has the same buckets at 4.8 MB as at 25 MB), and
    ``bucket_mb="auto"`` would time the same plan twice."""
    kept: list[float] = []
    seen: set[tuple[int, ...]] = set()
    for mb in sizes:
        layout = tuple(len(bucket) for bucket in plan_buckets(params, mb))
        if layout not in seen:
            seen.add(layout)
            kept.append(mb)
    return kept


class GradBucket(FlatBucket):
    """One bucket: its parameters and a flat buffer they are copied into, with DDP
    ``GradBucket``'s surface (inherited from ``FlatBucket``)."""

    __slots__ = ("offsets", "_views", "_exchanged")

    def __init__(self, index: int, params: list[torch.Tensor], is_last: bool) -> None:
        total = sum(p.numel() for p in params)
        buffer = torch.zeros(total, dtype=params[0].dtype, device=params[0].device)
        super().__init__(buffer, index=index, is_last=is_last, params=params)
        self.offsets: list[int] = []
        offset = 0
        for p in params:
            self.offsets.append(offset)
            offset += p.numel()
        self._views = super().gradients()
        self._exchanged = self._exchange_face()

    def gradients(self) -> list[torch.Tensor]:
        # Built once: every step re-points p.grad at these views twice (collect, attach), and
        # slicing a fresh view per parameter each time is measurable on many-tensor models.
        return list(self._views)

    def set_buffer(self, buffer: torch.Tensor) -> None:
        super().set_buffer(buffer)
        self._views = super().gradients()
        self._exchanged = self._exchange_face()

    def for_exchange(self) -> FlatBucket:
        """This bucket as its exchange sees it: the same memory, index and parameters, through
        a buffer whose writes do not move ``compat.write_count(self.buffer())``. A compressor
        or the hierarchical all-reduce writes its result into the bucket while the script may
        still run; through this alias only the script's own writes (``p.grad`` views the real
        buffer) move the count that ``BucketReducer.wait`` compares."""
        return self._exchanged

    def _exchange_face(self) -> FlatBucket:
        alias = compat.untracked_alias(self._buffer)
        return FlatBucket(alias, index=self._index, is_last=self._is_last, params=self._params)

    def attach_grads(self) -> None:
        """Make every ``p.grad`` a view into this bucket's buffer (after the exchange, so the
        optimizer reads the reduced gradient in place: DDP's ``gradient_as_bucket_view``)."""
        for view, p in zip(self._views, self._params, strict=True):
            if p.grad is None or p.grad.data_ptr() != view.data_ptr():
                p.grad = view

    def release_grads(self) -> None:
        """Before a step's backward: set every ``p.grad`` to None.

        Autograd then hands each parameter its freshly computed gradient tensor as is, and
        ``collect_grads`` copies it into the buffer at launch: one pass over the bytes. Keeping
        the views attached instead would make the step zero the buffer and then accumulate
        into it (a write pass, then two reads and a write), which measured about 3 ms more per
        step than DDP on a 6M-parameter model. Later backward passes of the same step (micro-
        batches) accumulate into the tensor autograd handed over.
        """
        for p in self._params:
            p.grad = None

    def collect_grads(self, factor: float = 1.0, missing: set[int] | None = None) -> None:
        """Before a launch: bring every gradient into the buffer multiplied by ``factor`` (a
        missing one as zeros) and re-point ``p.grad`` at its view.

        The factor rides on the copy (``torch.mul(..., out=)``), as DDP folds its 1/world
        into the same copy: the copy is memory-bound, so the multiply is free there, whereas a
        separate ``mul_`` or ``div_`` over the buffer is one more pass over its bytes (2 to 3 ms
        of CPU per 24 MB on a 2-core machine, on the critical path after the all-reduce).
        """
        for view, p in zip(self._views, self._params, strict=True):
            g = p.grad
            if g is None:
                view.zero_()
                p.grad = view
                if missing is not None:  # no gradient on this rank: ``got_gradient``
                    missing.add(id(p))
            elif g.data_ptr() != view.data_ptr():
                if factor == 1.0:
                    view.copy_(g)
                else:
                    torch.mul(g, factor, out=view)
                p.grad = view
            elif factor != 1.0:  # the user pointed p.grad at the view itself
                view.mul_(factor)

    @property
    def nbytes(self) -> int:
        return self._buffer.numel() * self._buffer.element_size()


#: launches one bucket's exchange; it gets ``GradBucket.for_exchange()``, the bucket's memory
#: under an alias whose writes the write guard does not count
ExchangeFn = Callable[[FlatBucket], "torch.futures.Future[torch.Tensor]"]


class BucketReducer:
    """Launches each bucket's exchange as soon as its gradients are final, in index order."""

    def __init__(
        self,
        params: Sequence[torch.Tensor],
        bucket_mb: float | None,
        exchange: ExchangeFn,
        record_spans: bool = False,
    ) -> None:
        if bucket_mb is None:  # the default plan, from the gradient's size (spec)
            total_mb = sum(p.numel() * p.element_size() for p in params) / MB
            bucket_mb = default_bucket_mb(total_mb)
        #: the bucket size planned with (the user's ``bucket_mb``, or the default plan's)
        self.bucket_mb = bucket_mb
        groups = plan_buckets(params, bucket_mb)
        self.buckets = [GradBucket(i, ps, i == len(groups) - 1) for i, ps in enumerate(groups)]
        self._bucket_of: dict[int, int] = {}
        for b in self.buckets:
            for p in b.parameters():
                self._bucket_of[id(p)] = b.index()
        self._exchange = exchange
        self._record_spans = record_spans
        self._armed = False
        #: a gradient arrived after flush(), before the update
        self.late_gradient = False
        self._micro_batches = 1
        self._seen: dict[int, int] = {}
        self._param_counts = [len(b.parameters()) for b in self.buckets]
        self._pending_params = list(self._param_counts)
        #: each bucket's range name in torch.profiler traces, made once
        self._range_names = [f"gradsync.launch[bucket {b.index()}]" for b in self.buckets]
        self._next_to_launch = 0
        self._futures: list[torch.futures.Future[torch.Tensor] | None] = []
        #: (bucket index, perf_counter at launch, wall time at launch) for this step
        self.launch_log: list[tuple[int, float, float]] = []
        self._spans: list[Span] = []
        #: multiplies each rank's gradient as it is copied into its bucket, before the exchange
        #: (load balancing's sample weight; for a plain sum, also the mean's 1/world and 1/k)
        self.scale = 1.0
        #: replace a non-finite local bucket by NaN before a lossy exchange (see checks.guards)
        self.poison_nonfinite = False
        self.local_nonfinite = False
        self._poison_rest = False
        #: the parameters that had no gradient on this rank when their bucket was launched
        self._missing = set[int]()
        #: note each bucket's write count at launch, so that ``wait()`` finds a gradient
        #: written while its exchange was in flight. The exchange's own writes do not count:
        #: it writes through ``GradBucket.for_exchange()``'s alias, the script through ``p.grad``
        self.guard_writes = False
        #: whether a bucket may be posted now (the step gate has opened): asked before each
        #: launch from a hook; a bucket not posted then is posted at a later hook or at flush()
        self.may_launch: Callable[[], bool] | None = None
        #: with ``guard_writes``, a gradient's write count when its bucket was held back (by
        #: id of its parameter): a script's write before the bucket is posted is found too
        self._held_writes: dict[int, int] = {}
        self._noted = 0  # the first bucket whose held-back write counts are not taken yet
        self._written_before_launch: list[int] = []
        self._launch_writes: list[int | None] = []
        #: the indices of the buckets that ``wait()`` found written during their exchange
        self.written_in_flight: list[int] = []
        self._handles = [p.register_post_accumulate_grad_hook(self._on_grad) for p in params]

    # -- step lifecycle ---------------------------------------------------------------------
    def arm(self, micro_batches: int) -> None:
        self._armed = True
        self._micro_batches = micro_batches
        self._seen = {}
        self._pending_params = list(self._param_counts)
        self._next_to_launch = 0
        self._futures = [None] * len(self.buckets)
        self._launch_writes = [None] * len(self.buckets)
        self.written_in_flight = []
        self._held_writes = {}
        self._noted = 0
        self._written_before_launch = []
        self.launch_log = []
        self._spans = []
        self.local_nonfinite = False
        self._missing = set[int]()
        for b in self.buckets:
            b.release_grads()

    def got_gradient(self, param: torch.Tensor) -> bool:
        """Whether ``param`` had a gradient on this rank when its bucket was launched (a
        backward pass of the step reached it, or the front door's ``no_sync()`` micro-batches
        left it one)."""
        return id(param) not in self._missing

    def backward_passes(self) -> int:
        """How many backward passes reached at least one parameter this step."""
        return max(self._seen.values(), default=0)

    def flush(self, poison: bool = False) -> None:
        """Launch every bucket not yet launched (block exit): missing gradients count as zero.
        ``poison``: fill the buckets whose gradients were not all final with NaN instead (this
        rank's block raised), so that every rank finds the step's gradient non-finite and skips
        it. A bucket whose gradients were final goes out as it is, held back for the step gate
        or not: the step completes where the backward pass had, as when every bucket was in
        flight before the block raised."""
        self._poison_rest = poison
        try:
            self._launch_ready(force=True)
        finally:
            self._poison_rest = False
        self._armed = False
        self.late_gradient = False

    @property
    def armed(self) -> bool:
        """Whether this step's buckets still wait for gradients (flush() has not run)."""
        return self._armed

    def flush_abort(self) -> None:
        """Disarm without launching (the step is being abandoned on a usage error)."""
        self._armed = False

    def wait(
        self, step: int = 0, each: Callable[[torch.Tensor], None] | None = None
    ) -> list[torch.Tensor]:
        """Wait for every bucket's exchange; return the reduced flat buffers by bucket index.
        ``each`` runs on each reduced buffer as soon as it is in, while later buckets may still
        be on the wire (the non-finite guard's sums: off the step's critical path but for the
        last bucket's). With ``guard_writes``, ``written_in_flight`` then names the buckets
        whose gradients were written (``p.grad`` changed in place, e.g. by a clip) during
        their exchange, or after they were final while the bucket was held back (``may_launch``)."""
        out = []
        for fut in self._futures:
            assert fut is not None, "flush() must run before wait()"
            out.append(fut.wait())
            if each is not None:
                each(out[-1])
        in_flight = {
            b.index()
            for b, count in zip(self.buckets, self._launch_writes, strict=True)
            if count is not None and compat.write_count(b.buffer()) != count
        }
        self.written_in_flight = sorted(in_flight.union(self._written_before_launch))
        return out

    def write_back(self, reduced: list[torch.Tensor], scale: float = 1.0) -> None:
        """Put the reduced buffers into ``p.grad`` (every parameter gets one, zeros where no
        rank had a gradient). An in-place all-reduce already left them there."""
        for bucket, flat in zip(self.buckets, reduced, strict=True):
            buf = bucket.buffer()
            if flat.data_ptr() != buf.data_ptr():
                buf.copy_(flat)
            if scale != 1.0:
                buf.mul_(scale)
            bucket.attach_grads()

    def take_spans(self) -> list[Span]:
        spans, self._spans = self._spans, []
        return spans

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    # -- hooks ------------------------------------------------------------------------------
    def _on_grad(self, param: torch.Tensor) -> None:
        if not self._armed:
            # A backward pass after flush() (after StepHandle.synchronize()) adds into the
            # reduced gradient on this rank only: BSP refuses the update then.
            self.late_gradient = True
            return
        key = id(param)
        count = self._seen.get(key, 0) + 1
        self._seen[key] = count
        if count == self._micro_batches:
            self._pending_params[self._bucket_of[key]] -= 1
            self._launch_ready(force=False)

    def _launch_ready(self, force: bool) -> None:
        while self._next_to_launch < len(self.buckets):
            i = self._next_to_launch
            if not force and self._pending_params[i] > 0:
                return
            if not force and self.may_launch is not None and not self.may_launch():
                if self.guard_writes:
                    self._note_held(i)
                return
            self._launch(self.buckets[i])
            self._next_to_launch += 1

    def _note_held(self, first: int) -> None:
        """The write counts of the final gradients of the buckets held back from ``first`` on,
        taken once per bucket (``_noted`` moves past it): the backward pass is still running,
        so the script has not written."""
        self._noted = max(self._noted, first)
        while self._noted < len(self.buckets) and self._pending_params[self._noted] == 0:
            for p in self.buckets[self._noted].parameters():
                if p.grad is not None:
                    self._held_writes[id(p)] = compat.write_count(p.grad)
            self._noted += 1

    def _check_held(self, bucket: GradBucket) -> None:
        """Whether the script wrote a gradient of ``bucket`` while it was held back: the same
        race as a write in flight (the exchange not done), found where the bucket was posted
        late. Every rank finds it, whichever of its buckets were held back."""
        for p in bucket.parameters():
            noted = self._held_writes.pop(id(p), None)
            if noted is not None and p.grad is not None and compat.write_count(p.grad) != noted:
                self._written_before_launch.append(bucket.index())
                return

    def _launch(self, bucket: GradBucket) -> None:
        # A named range in torch.profiler traces, beside the user's kernels and gloo's ops.
        with compat.annotate(self._range_names[bucket.index()]):
            self._copy_in_and_launch(bucket)

    def _copy_in_and_launch(self, bucket: GradBucket) -> None:
        if self._held_writes:
            self._check_held(bucket)
        bucket.collect_grads(self.scale, self._missing)
        if self._poison_rest and self._pending_params[bucket.index()] > 0:
            bucket.buffer().fill_(float("nan"))
            self.local_nonfinite = True
        elif self.poison_nonfinite:
            # The whole bucket NaN where any element is not finite, decided on the device: a
            # host check here made the host wait for the backward every bucket (issue 44).
            poison_nonfinite_(bucket.buffer())
        t0, wall0 = time.perf_counter(), time.time()
        self.launch_log.append((bucket.index(), t0, wall0))
        if self.guard_writes:
            self._launch_writes[bucket.index()] = compat.write_count(bucket.buffer())
        fut = self._exchange(bucket.for_exchange())
        if self._record_spans:
            fut = exit_safety.then(fut, self._span_recorder(bucket, t0, wall0))
        self._futures[bucket.index()] = fut

    def _span_recorder(
        self, bucket: GradBucket, t0: float, wall0: float
    ) -> Callable[[torch.futures.Future[torch.Tensor]], torch.Tensor]:
        def done(fut: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
            value = fut.value()
            args: dict[str, Any] = {"bucket": bucket.index(), "bytes": bucket.nbytes}
            self._spans.append(
                Span(
                    -1,
                    -1,
                    f"allreduce[{bucket.index()}]",
                    wall0,
                    time.perf_counter() - t0,
                    "comm",
                    args,
                )
            )
            return value

        return done
