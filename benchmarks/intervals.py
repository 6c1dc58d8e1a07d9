"""How far a benchmark's median can be trusted: bootstrap intervals of a median of ratios.

Why: on this project's 2-core machines the cost of a checkpoint every step (a few percent of
step time) is about the size of the run-to-run noise of its own measure, and a median alone
read +6.6% in one run and -0.4% in the next on nearly the same code (RELIABILITY.md). A
figure printed with the interval its samples allow says whether a run can tell the cost from
a bound at all, and more repeats narrow it.

Percentile bootstrap: resample with replacement, take the statistic, and read the middle
``level`` of those statistics. ``median_interval`` resamples one list of per-pair ratios (the
separate runs); ``median_of_medians_interval`` resamples at two levels, the runs and then the
pairs within each run drawn, because the runs differ from each other by more than their own
pairs spread (the in-run blocks). Seeded, so a file regenerated from the same samples reads
the same. Plain Python: no numpy or scipy needed by the benchmarks.
"""

from __future__ import annotations

import random
import statistics
from collections.abc import Sequence

__all__ = ["median_interval", "median_of_medians_interval"]

#: resamples per interval: enough that the interval's ends move by well under its width
DRAWS = 2000


def _check(level: float, draws: int) -> None:
    if not 0.0 < level < 1.0:
        raise ValueError(f"level must be between 0 and 1 (exclusive), got {level}")
    if draws < 1:
        raise ValueError(f"draws must be >= 1, got {draws}")


def _ends(statistics_drawn: list[float], level: float) -> tuple[float, float]:
    ordered = sorted(statistics_drawn)
    tail = (1.0 - level) / 2.0
    lo = ordered[int(tail * (len(ordered) - 1))]
    hi = ordered[round((1.0 - tail) * (len(ordered) - 1))]
    return lo, hi


def median_interval(
    values: Sequence[float], level: float = 0.9, draws: int = DRAWS, seed: int = 0
) -> tuple[float, float]:
    """The middle ``level`` of the medians of ``draws`` resamples of ``values``."""
    _check(level, draws)
    if not values:
        raise ValueError("no values to take an interval of")
    rng = random.Random(seed)
    n = len(values)
    drawn = [statistics.median(rng.choices(values, k=n)) for _ in range(draws)]
    return _ends(drawn, level)


def median_of_medians_interval(
    runs: Sequence[Sequence[float]], level: float = 0.9, draws: int = DRAWS, seed: int = 0
) -> tuple[float, float]:
    """The middle ``level`` of the median of run medians over ``draws`` two-level resamples:
    the runs drawn with replacement, then each drawn run's values."""
    _check(level, draws)
    if not runs or any(not run for run in runs):
        raise ValueError("every run needs at least one value")
    rng = random.Random(seed)
    drawn = []
    for _ in range(draws):
        chosen = rng.choices(runs, k=len(runs))
        drawn.append(
            statistics.median(statistics.median(rng.choices(run, k=len(run))) for run in chosen)
        )
    return _ends(drawn, level)
