"""Measured all-reduce times from ``gradsync bench allreduce``, sampled instead of fitted.

A straight alpha-beta line through sizes spanning four decades misses any one size by up to
40% on a shared CPU box (see docs/simulator.md). The calibration file keeps every size's
repeats, so a prediction can use what was measured at (or next to) the payload it needs:
the median is interpolated log-log between the two nearest measured sizes, and the spread is
the nearest size's repeats rescaled to that median. Outside the measured sizes, and for
another number of ranks, the alpha-beta model supplies only the *ratio* to a measured point.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from gradsync.errors import UsageError
from gradsync.sim.model import AlphaBeta


@dataclass(frozen=True, kw_only=True, slots=True)
class CollectiveTable:
    """All-reduce times measured on ``nproc`` ranks: per size, the repeats in seconds."""

    nproc: int
    sizes: tuple[float, ...]
    samples_s: tuple[tuple[float, ...], ...]
    link: AlphaBeta

    def __post_init__(self) -> None:
        if len(self.sizes) != len(self.samples_s) or not self.sizes:
            raise UsageError("calibration table needs one list of repeats per measured size")
        if list(self.sizes) != sorted(self.sizes) or any(s <= 0 for s in self.sizes):
            raise UsageError("calibration sizes must be positive and increasing")
        if any(not row or min(row) <= 0 for row in self.samples_s):
            raise UsageError("calibration repeats must be positive times")

    def median_s(self, nbytes: float, workers: int | None = None) -> float:
        """Median all-reduce time of ``nbytes`` on ``workers`` ranks (default: as measured)."""
        meds = [float(np.median(r)) for r in self.samples_s]
        if nbytes <= self.sizes[0]:
            # Below the smallest size the latency floor dominates: keep the measured time.
            t = meds[0]
        elif nbytes >= self.sizes[-1]:
            t = meds[-1] * self._line_ratio(nbytes, self.sizes[-1], self.nproc)
        else:
            i = int(np.searchsorted(self.sizes, nbytes))
            lo, hi = self.sizes[i - 1], self.sizes[i]
            w = (math.log(nbytes) - math.log(lo)) / (math.log(hi) - math.log(lo))
            t = math.exp((1 - w) * math.log(meds[i - 1]) + w * math.log(meds[i]))
        if workers is not None and workers != self.nproc:
            t *= self._workers_ratio(nbytes, workers)
        return t

    def sample_s(
        self, nbytes: float, size: int, rng: np.random.Generator, workers: int | None = None
    ) -> np.ndarray:
        """``size`` draws: the nearest measured size's repeats, rescaled to ``median_s``."""
        if nbytes <= 0:
            return np.zeros(size)
        near = int(np.argmin([abs(math.log(nbytes / s)) for s in self.sizes]))
        rep = np.asarray(self.samples_s[near], dtype=float)
        scale = self.median_s(nbytes, workers) / float(np.median(rep))
        return rng.choice(rep, size=size) * scale

    def _line_ratio(self, nbytes: float, ref: float, n: int) -> float:
        ref_t = self.link.time("allreduce", n, ref)
        return self.link.time("allreduce", n, nbytes) / ref_t if ref_t > 0 else 1.0

    def _workers_ratio(self, nbytes: float, workers: int) -> float:
        if workers < 2:
            return 0.0
        base = self.link.time("allreduce", self.nproc, nbytes)
        return self.link.time("allreduce", workers, nbytes) / base if base > 0 else 1.0
