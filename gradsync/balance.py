"""Load-balanced BSP: shares of the global batch follow each rank's measured speed.

A slow rank takes fewer samples and fast ranks more, so all ranks reach the barrier together.
The math stays exact: the Synchronizer weights rank r's gradient (the mean over its n_r
samples) by ``n_r * W / N`` before the mean all-reduce, so the update is still the mean gradient
of the whole global batch of N samples.

Every rank feeds the balancer the same gathered telemetry and gets the same shares, so no
extra collective is needed to agree on them. Each time telemetry is gathered, every rank's
share is scaled by (mean compute / its median compute) over the steps since the last change,
with damping. Equalising compute directly, rather than estimating samples per second, matters:
a step has a fixed cost that does not shrink with the shard, so a per-sample estimate makes a
rank with few samples look ever slower and starves it.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from gradsync.errors import UsageError
from gradsync.telemetry.records import StepRecord


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


class ShardBalancer:
    def __init__(
        self,
        world_size: int,
        *,
        shares: Sequence[float] | None = None,
        adapt: bool = True,
        damping: float = 0.5,
    ) -> None:
        if world_size < 1:
            raise UsageError(f"world_size must be >= 1, got {world_size}")
        if shares is not None and (len(shares) != world_size or min(shares) <= 0):
            raise UsageError(
                f"shares must be {world_size} positive numbers (one per rank), got {list(shares)}"
            )
        if not 0 <= damping < 1:
            raise UsageError(f"damping must be in [0, 1), got {damping}")
        self.world_size = world_size
        total = sum(shares) if shares is not None else world_size
        self.shares = (
            [s / total for s in shares] if shares is not None else [1 / world_size] * world_size
        )
        self.adapt = adapt
        self.damping = damping

    def sizes(self, global_batch: int) -> list[int]:
        return split(global_batch, self.shares)

    def observe(self, records: Sequence[StepRecord]) -> None:
        """Move the shares from one gathered batch of records (the same on every rank; all its
        steps ran with the current shares, since shares only change here)."""
        if not self.adapt:
            return
        compute: list[list[float]] = [[] for _ in range(self.world_size)]
        for r in records:
            if r.compute > 0 and not r.skipped and 0 <= r.rank < self.world_size:
                compute[r.rank].append(r.compute)
        if any(not c for c in compute):
            return
        medians = [statistics.median(sorted(c)) for c in compute]
        mean = sum(medians) / len(medians)
        scaled = [s * mean / m for s, m in zip(self.shares, medians, strict=True)]
        total = sum(scaled)
        target = [s / total for s in scaled]
        self.shares = [
            self.damping * old + (1 - self.damping) * new
            for old, new in zip(self.shares, target, strict=True)
        ]
