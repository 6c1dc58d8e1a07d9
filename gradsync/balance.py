"""Load-balanced BSP: shares of the global batch follow each rank's measured speed.

A slow rank takes fewer samples and fast ranks more, so all ranks reach the barrier together.
The math stays exact: the Synchronizer weights rank r's gradient (the mean over its n_r
samples) by ``n_r * W / N`` before the mean all-reduce, so the update is still the mean gradient
of the whole global batch of N samples.

Every rank feeds the balancer the same gathered telemetry and gets the same shares, so no
extra collective is needed to agree on them.

The model: a step of n samples takes ``(a + n) / v_r`` on rank r. ``a``, the step's fixed cost
(launching kernels, the Python around them, the bucket copies) counted in samples, is the same
on every rank (the same model and code); ``v_r``, the rank's speed, is what a straggler changes,
and it slows the fixed part too. From each gathered batch of records (all of one share, since
shares only change here) the balancer reads every rank's median compute at its current share,
hence its speed, and the shares at which every rank finishes together follow in closed form
(``equal_finish``), with a floor of one sample per rank. The fixed cost matters: ignoring it
(sharing by samples per second) makes a rank with few samples look slow per sample, so a rank
that was slow keeps a small share long after it recovered; and when the fixed cost dominates
(small models, small batches) no share makes a slow rank fast, the best is to give it little.

``a`` is learnt from the run: when shares changed between two batches, the fixed cost that
best explains how each rank's compute changed, relative to the other ranks' (which cancels
whatever happened to the whole machine), is recorded; the median of recent estimates is used.
Before the first one the model assumes no fixed cost, which makes the largest first move; the
next batch then measures it.

A change of speed is told apart from a change of share the same way: if no fixed cost in the
plausible range explains how one rank's compute moved relative to the others' (by more than
``_SPEED_CHANGE``), that rank's speed changed (a slowdown began or ended). The shares then go
back to even, where speeds compare without any model, instead of crawling back through ever
smaller corrections computed from stale speeds.

Updates are damped (half-way to the target by default), which averages out noise in the
measured medians, and even shares are preferred whenever they are predicted to be within
``tolerance`` of the best, or within what the batch's own noise could explain (moving samples
for less is chasing noise).
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Sequence

from gradsync.errors import UsageError
from gradsync.telemetry.records import StepRecord

__all__ = ["ShardBalancer", "equal_finish", "split"]

#: A rank whose compute moved by this factor relative to the other ranks', more than any fixed
#: cost explains, changed speed. Well above the batch-to-batch noise of medians.
_SPEED_CHANGE = 1.75
#: The fixed cost is at most this fraction of an even share's step. A step that is nearly all
#: fixed cost leaves nothing to balance; an estimate up there (noise pushes compute ratios near
#: 1 to that end) would stop the shares from moving, and with them the measurements that could
#: correct it.
_MAX_FIXED = 0.8
#: The fixed-cost fractions tried when fitting one.
_GRID = [_MAX_FIXED * i / 40 for i in range(41)]
#: A pair of batches measures the fixed cost only if the fractions 0 and _MAX_FIXED predict the
#: ranks' relative changes this differently (the shares moved enough for it to show) ...
_INFORMATIVE = math.log(1.25)
#: ... and the best fraction explains them to within this (else noise or a smaller change of
#: speed is in the pair).
_FITS = math.log(1.15)
#: How many past batches (since the last change of speed) a new one is compared with.
_HISTORY = 4
#: Until this many estimates exist, the missing ones count as 0 (the prior: no fixed cost).
_MIN_ESTIMATES = 3

Measurement = list[tuple[float, float]]  # per rank: (samples, median compute)


def split(global_batch: int, shares: Sequence[float]) -> list[int]:
    """Integer sizes proportional to ``shares`` that sum to ``global_batch``, each at least 1
    (largest-remainder rounding, ties to the lower rank, so every rank computes the same)."""
    n = len(shares)
    if global_batch < n:
        raise UsageError(f"a global batch of {global_batch} cannot give each of {n} ranks a sample")
    total = float(sum(shares))
    exact = [global_batch * s / total for s in shares]
    sizes = [int(x) for x in exact]
    left = global_batch - sum(sizes)
    for r in sorted(range(n), key=lambda r: (-(exact[r] - sizes[r]), r))[:left]:
        sizes[r] += 1
    # Every rank keeps at least one sample, taken from the largest shard.
    for r in range(n):
        if sizes[r] == 0:
            sizes[max(range(n), key=lambda q: (sizes[q], -q))] -= 1
            sizes[r] = 1
    return sizes


def equal_finish(
    total: float, speeds: Sequence[float], fixed: float = 0.0, least: float = 1.0
) -> list[float]:
    """Samples per rank, summing to ``total``, at which every rank's ``(fixed + n) / speed``
    is the same, except that no rank gets fewer than ``least`` (those finish early)."""
    n = len(speeds)
    sizes = [float(least)] * n
    free = list(range(n))
    while free:
        # (fixed + n_r) / v_r = T for the free ranks, with the floored ones at ``least``.
        t = (total - least * (n - len(free)) + fixed * len(free)) / sum(speeds[r] for r in free)
        low = [r for r in free if t * speeds[r] - fixed < least]
        if not low:
            for r in free:
                sizes[r] = t * speeds[r] - fixed
            return sizes
        free = [r for r in free if r not in low]
    return sizes  # ``total`` below ``least`` per rank: split() reports it


def _spread(before: Measurement, now: Measurement, fixed: float) -> float:
    """The largest change of one rank's speed relative to the other ranks' (log), between two
    measurements, if the step's fixed cost is ``fixed`` samples."""
    change = [
        math.log(c2 / c) - math.log((fixed + n2) / (fixed + n))
        for (n, c), (n2, c2) in zip(before, now, strict=True)
    ]
    return max(
        abs(x - statistics.median(change[:r] + change[r + 1 :])) for r, x in enumerate(change)
    )


def _median_error(values: list[float], median: float) -> float:
    """The standard error of the median of ``values``, relative to it (robust: from the median
    absolute deviation, as for normal noise)."""
    mad = statistics.median(abs(v - median) for v in values)
    return 1.2533 * 1.4826 * mad / median / math.sqrt(len(values))


class ShardBalancer:
    """Shares of the global batch per rank, moved toward equal finish times by ``observe``.

    ``shares``: fixed starting shares (relative; normalised), default even. ``adapt=False``
    keeps them. ``damping``: the weight of the old shares in each update (0: jump to the
    target). ``tolerance``: even shares are used whenever the model predicts their step time
    within this fraction of the best shares', plus twice the relative standard error of the
    noisiest rank's median compute in the batch (moving samples for less is chasing noise).
    """

    def __init__(
        self,
        world_size: int,
        *,
        shares: Sequence[float] | None = None,
        adapt: bool = True,
        damping: float = 0.5,
        tolerance: float = 0.05,
    ) -> None:
        if world_size < 1:
            raise UsageError(f"world_size must be >= 1, got {world_size}")
        if shares is not None and (len(shares) != world_size or min(shares) <= 0):
            raise UsageError(
                f"shares must be {world_size} positive numbers (one per rank), got {list(shares)}"
            )
        if not 0 <= damping < 1:
            raise UsageError(f"damping must be in [0, 1), got {damping}")
        if not 0 <= tolerance < 1:
            raise UsageError(f"tolerance must be in [0, 1), got {tolerance}")
        self.world_size = world_size
        total = sum(shares) if shares is not None else world_size
        self.shares = (
            [s / total for s in shares] if shares is not None else [1 / world_size] * world_size
        )
        self.adapt = adapt
        self.damping = damping
        self.tolerance = tolerance
        #: how many times a change of speed sent the shares back to even
        self.resets = 0
        #: recent estimates of the fixed cost, as a fraction of an even share's step
        self._fixed: deque[float] = deque(maxlen=8)
        #: the batches measured since the last change of speed (the last few)
        self._history: deque[Measurement] = deque(maxlen=_HISTORY)

    def sizes(self, global_batch: int) -> list[int]:
        return split(global_batch, self.shares)

    @property
    def fixed_fraction(self) -> float:
        """The estimated fixed cost of a step at an even share, as a fraction of that step
        (0 until the shares have moved enough to measure it)."""
        padded = [*self._fixed, *[0.0] * (_MIN_ESTIMATES - len(self._fixed))]
        return statistics.median(padded)

    def observe(self, records: Sequence[StepRecord]) -> None:
        """Move the shares from one gathered batch of records (the same on every rank; all its
        steps ran with the current shares, since shares only change here)."""
        if not self.adapt:
            return
        seen = self._measure(records)
        if seen is None:
            return
        now, counted, noise = seen
        total = sum(n for n, _ in now)
        even = total / self.world_size
        if self._history and self._speed_changed(self._history[-1], now, even):
            # Batches from before the change must not pair with later ones to estimate the
            # fixed cost. Speeds measured at uneven shares depend on the model: back to even
            # shares, where they compare without it (at even shares, balance from here now).
            self._history.clear()
            if max(n for n, _ in now) - min(n for n, _ in now) > 0.01 * even:
                self._history.append(now)
                self.shares = [1 / self.world_size] * self.world_size
                self.resets += 1
                return
        self._learn_fixed(now, even, noise)
        self._history.append(now)
        phi = self.fixed_fraction
        fixed = even * phi / (1 - phi)
        speeds = [(fixed + n) / c for n, c in now]
        least = min(1.0 if counted else 0.0, even)  # split() keeps one sample per rank anyway
        target = equal_finish(total, speeds, fixed, least)

        def step_time(sizes: Sequence[float]) -> float:
            return max((fixed + n) / v for n, v in zip(sizes, speeds, strict=True))

        # Within the tolerance, or within what the batch's own noise could make of it (two
        # standard errors of the noisiest median), the model cannot tell the target from even.
        margin = self.tolerance + 2 * noise
        if step_time([even] * self.world_size) <= step_time(target) * (1 + margin):
            # Even shares are the neutral state and as good as any: go back at once (damping
            # guards against trusting a noisy estimate of *how* uneven, not against this).
            self.shares = [1 / self.world_size] * self.world_size
            return
        goal = [n / total for n in target]
        new = [
            self.damping * old + (1 - self.damping) * g
            for old, g in zip(self.shares, goal, strict=True)
        ]
        if max(abs(a - b) for a, b in zip(new, goal, strict=True)) * total < 0.5:
            new = goal  # within half a sample of the target: rounding could not tell them apart
        s = sum(new)
        self.shares = [x / s for x in new]

    def _measure(self, records: Sequence[StepRecord]) -> tuple[Measurement, bool, float] | None:
        """Per rank, the median samples and median compute of these records; whether the
        records counted samples (without, the current shares stand in for them); and the
        largest relative standard error of a rank's median compute (None: a rank has none)."""
        compute: list[list[float]] = [[] for _ in range(self.world_size)]
        samples: list[list[float]] = [[] for _ in range(self.world_size)]
        for r in records:
            if r.compute > 0 and not r.skipped and 0 <= r.rank < self.world_size:
                compute[r.rank].append(r.compute)
                samples[r.rank].append(float(r.samples))
        if any(not c for c in compute):
            return None
        n = [statistics.median(s) for s in samples]
        counted = min(n) > 0
        if not counted:
            n = list(self.shares)
        medians = [statistics.median(c) for c in compute]
        noise = max(_median_error(c, m) for c, m in zip(compute, medians, strict=True))
        return list(zip(n, medians, strict=True)), counted, noise

    def _speed_changed(self, before: Measurement, now: Measurement, even: float) -> bool:
        """Whether no fixed cost in the plausible range explains how the ranks' compute moved
        relative to each other since the last batch: some rank's speed changed."""
        if self.world_size < 2:
            return False
        best = min(_spread(before, now, even * p / (1 - p)) for p in _GRID)
        return best > math.log(_SPEED_CHANGE)

    def _learn_fixed(self, now: Measurement, even: float, noise: float) -> None:
        """Record the fixed cost that best explains the change since the earliest past batch
        that tells fixed costs apart (see the module doc)."""
        if self.world_size < 2:
            return
        for before in self._history:
            fits = [_spread(before, now, even * p / (1 - p)) for p in _GRID]
            # A relative change involves four medians: allow three of their standard errors.
            if abs(fits[0] - fits[-1]) < max(_INFORMATIVE, 6 * noise):
                continue  # shares moved too little for the fixed cost to show
            best = min(range(len(_GRID)), key=lambda i: fits[i])
            if fits[best] <= _FITS:
                self._fixed.append(_GRID[best])
            return
