"""Bootstrap intervals of the benchmarks' medians (``benchmarks.intervals``)."""

from __future__ import annotations

import random
import statistics

import pytest

from benchmarks.intervals import median_interval, median_of_medians_interval

pytestmark = pytest.mark.unit


def _noisy(center: float, spread: float, n: int, seed: int) -> list[float]:
    rng = random.Random(seed)
    return [rng.gauss(center, spread) for _ in range(n)]


def test_the_interval_holds_the_median_and_narrows_with_more_pairs() -> None:
    few = _noisy(1.04, 0.03, 11, seed=1)
    many = _noisy(1.04, 0.03, 200, seed=1)
    lo, hi = median_interval(few)
    assert lo <= statistics.median(few) <= hi
    lo_many, hi_many = median_interval(many)
    assert lo_many <= statistics.median(many) <= hi_many
    assert hi_many - lo_many < (hi - lo) / 2
    # about 1.2533 * 0.03 / sqrt(200) = 0.0027 for one standard error: 90% is about 3.3 of them
    assert 0.004 < hi_many - lo_many < 0.016


def test_the_interval_covers_the_true_median_about_as_often_as_it_says() -> None:
    covered = 0
    trials = 200
    for seed in range(trials):
        lo, hi = median_interval(_noisy(1.0, 0.05, 25, seed), draws=400, seed=seed)
        covered += lo <= 1.0 <= hi
    assert 0.8 * trials <= covered <= 0.97 * trials


def test_a_wider_level_gives_a_wider_interval_and_the_same_seed_the_same_one() -> None:
    values = _noisy(1.0, 0.05, 30, seed=3)
    lo50, hi50 = median_interval(values, level=0.5)
    lo90, hi90 = median_interval(values, level=0.9)
    assert lo90 <= lo50 < hi50 <= hi90
    assert median_interval(values, seed=5) == median_interval(values, seed=5)


def test_runs_that_differ_widen_the_interval_beyond_their_pooled_pairs() -> None:
    # Five runs whose levels differ by more than their own pairs spread: the run-to-run
    # movement the in-run blocks show. Pooling the pairs as one sample would hide it.
    runs = [
        _noisy(level, 0.005, 16, seed) for seed, level in enumerate((1.02, 1.05, 1.03, 1.06, 1.01))
    ]
    lo, hi = median_of_medians_interval(runs)
    pooled_lo, pooled_hi = median_interval([x for run in runs for x in run])
    assert lo <= statistics.median(statistics.median(run) for run in runs) <= hi
    assert hi - lo > 2 * (pooled_hi - pooled_lo)


def test_alike_runs_give_about_the_pooled_interval() -> None:
    runs = [_noisy(1.03, 0.02, 16, seed) for seed in range(5)]
    lo, hi = median_of_medians_interval(runs)
    pooled_lo, pooled_hi = median_interval([x for run in runs for x in run])
    assert hi - lo < 3 * (pooled_hi - pooled_lo)
    assert lo < 1.03 < hi


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: median_interval([]), "no values"),
        (lambda: median_interval([1.0], level=1.0), "level must be between 0 and 1"),
        (lambda: median_interval([1.0], draws=0), "draws must be >= 1"),
        (lambda: median_of_medians_interval([[1.0], []]), "every run needs"),
        (lambda: median_of_medians_interval([]), "every run needs"),
    ],
)
def test_bad_input_is_refused_naming_it(call: object, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        call()  # type: ignore[operator]
