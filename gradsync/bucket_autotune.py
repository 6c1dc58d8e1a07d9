"""``bucket_mb="auto"``: time the first steps under a few bucket plans and keep the fastest.

Why measure instead of computing the plan from the link's alpha-beta: the best plan depends on
how much of the backward pass a bucket can hide behind, which varies by model and machine and
which the step's own timing shows directly; a fitted link model sees only the transfer. The
candidates are the default plan (``spec.default_bucket_mb``), DDP's 25 MB and 1 MB buckets
(the most overlap, the most messages), each capped at the gradient's size, duplicates dropped.

Schedule: ``WARMUP_STEPS`` steps under the first candidate (allocations, caches, a rendezvous
settling), then ``STEPS_PER_PLAN`` timed steps under each candidate in turn. The median of each
plan's steps is taken on every rank and the ranks agree on the worst rank's median per plan
(the step is as slow as its slowest rank), so all keep the same plan: the strategy runs that
one collective (``BSP``). This module only schedules and decides; it holds no tensors.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence

from gradsync.spec import FIRST_BUCKET_MB, MAX_BUCKET_MB, default_bucket_mb

__all__ = ["AUTO", "STEPS_PER_PLAN", "WARMUP_STEPS", "BucketTuner", "candidates"]

AUTO = "auto"
WARMUP_STEPS = 2
STEPS_PER_PLAN = 4


def candidates(total_mb: float) -> list[float]:
    """The bucket sizes tried for a gradient of ``total_mb``: the default plan first (it is
    what the warm-up steps run), then 25 MB and 1 MB, each at most the gradient's size (larger
    plans are the same plan), without repeats."""
    cap = max(total_mb, FIRST_BUCKET_MB)
    tried: list[float] = []
    for mb in (default_bucket_mb(total_mb), MAX_BUCKET_MB, FIRST_BUCKET_MB):
        mb = min(mb, cap)
        if all(abs(mb - t) > 1e-9 for t in tried):
            tried.append(mb)
    return tried


class BucketTuner:
    """Which plan each step runs, the step times seen, and the plan kept."""

    def __init__(self, plans: Sequence[float]) -> None:
        if not plans:
            raise ValueError("no bucket plan to try")
        self.plans = list(plans)
        self.times: list[list[float]] = [[] for _ in self.plans]
        #: the plan kept, once decided
        self.chosen: float | None = None if len(self.plans) > 1 else self.plans[0]
        self._steps = 0

    @property
    def deciding(self) -> bool:
        return self.chosen is None

    def plan_for_next_step(self) -> float:
        """The plan the coming step runs (the decision, once made)."""
        if self.chosen is not None:
            return self.chosen
        timed = self._steps - WARMUP_STEPS
        return self.plans[max(0, min(timed // STEPS_PER_PLAN, len(self.plans) - 1))]

    def record(self, seconds: float) -> None:
        """The step just run took ``seconds`` (begin of the block to the end of its update)."""
        timed = self._steps - WARMUP_STEPS
        if self.chosen is None and timed >= 0:
            self.times[timed // STEPS_PER_PLAN].append(seconds)
        self._steps += 1

    @property
    def ready_to_decide(self) -> bool:
        return self.chosen is None and all(len(t) >= STEPS_PER_PLAN for t in self.times)

    def medians(self) -> list[float]:
        """This rank's median step time per plan (to be agreed over the ranks: the maximum)."""
        return [statistics.median(t) for t in self.times]

    def decide(self, agreed: Sequence[float]) -> float:
        """Keep the plan whose agreed (slowest-rank) median is the lowest; the first of equals."""
        best = min(range(len(self.plans)), key=lambda i: (agreed[i], i))
        self.chosen = self.plans[best]
        return self.chosen

    def describe(self, agreed: Sequence[float]) -> str:
        tried = ", ".join(
            f"{mb:g} MB {ms * 1000:.1f} ms" for mb, ms in zip(self.plans, agreed, strict=True)
        )
        return f"tried {tried} (median step, slowest rank)"
