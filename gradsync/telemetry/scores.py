"""Windowed straggler scores from step records: the numbers behind ``stragglers``' findings.

Scores follow the usual convention (0.5 = twice as slow as the reference), per rank, over a
sliding window of ``window`` recorded steps, using the window's median compute:

- relative = fastest rank's median compute / this rank's median compute
- individual = this rank's best (lowest) windowed median so far / its current windowed median

Under load-balanced BSP a rank's compute also depends on how many samples it was given, so every
score is computed twice, on compute and on compute per sample (scaled to an even share, so the
two are the same number when shares are equal), and the higher (kinder) score of the two counts:
a rank given more samples than the others is slower per step but not per sample (overloaded,
not slow), and a rank given fewer samples because it is slow takes per step no longer than the
others once balancing works. Per sample alone would not do: a step's fixed cost (launching
kernels, the Python around them) makes a rank with a small shard look slow per sample.

``synthetic_records`` makes a BSP run without processes, for tests and demos. The helpers below
turn flagged windows into step intervals (``runs``, ``kadane``) and measure
the evidence for one (``ratio``, ``above_others``, ``pace_shares``); deciding what counts as a
finding is ``stragglers``' job.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from gradsync.telemetry.records import StepRecord

__all__ = [
    "StepMatrix",
    "WindowScores",
    "above_others",
    "job_pace",
    "kadane",
    "pace_shares",
    "ratio",
    "runs",
    "slow_steps",
    "slowdown",
    "window_scores",
]


@dataclass(slots=True)
class StepMatrix:
    """Records as [step, rank] arrays; NaN where a rank has no record for a step."""

    steps: np.ndarray
    ranks: np.ndarray
    compute: np.ndarray
    idle: np.ndarray
    wall: np.ndarray
    #: per step: whether it ended at a barrier (every step under BSP; every H-th under local SGD)
    barrier: np.ndarray
    #: compute scaled to an even share of the step's samples: compute * mean samples / samples.
    #: ``compute`` itself (the same array) when every step's shares are equal or unknown
    per_sample: np.ndarray

    @classmethod
    def from_records(cls, records: Iterable[StepRecord]) -> StepMatrix:
        recs = list(records)
        steps = np.array(sorted({r.step for r in recs}), dtype=np.int64)
        ranks = np.array(sorted({r.rank for r in recs}), dtype=np.int64)
        shape = (len(steps), len(ranks))
        compute, idle, wall = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
        samples = np.full(shape, np.nan)
        barrier = np.zeros(len(steps), dtype=bool)
        if recs:
            i = np.searchsorted(steps, [r.step for r in recs])
            j = np.searchsorted(ranks, [r.rank for r in recs])
            compute[i, j] = [r.compute for r in recs]
            idle[i, j] = [r.idle for r in recs]
            wall[i, j] = [r.compute + r.sync for r in recs]
            samples[i, j] = [r.samples for r in recs]
            barrier[i] |= np.array([r.barrier for r in recs], dtype=bool)
        return cls(steps, ranks, compute, idle, wall, barrier, _per_sample(compute, samples))

    def rows(self, lo: int, hi: int | None = None) -> StepMatrix:
        """The recorded steps ``lo`` to ``hi`` (exclusive), as a view."""
        s = slice(lo, hi)
        compute = self.compute[s]
        per = compute if self.per_sample is self.compute else self.per_sample[s]  # keep `uneven`
        return StepMatrix(
            self.steps[s],
            self.ranks,
            compute,
            self.idle[s],
            self.wall[s],
            self.barrier[s],
            per,
        )

    @property
    def uneven(self) -> bool:
        """Whether some step gave ranks different numbers of samples (load balancing)."""
        return self.per_sample is not self.compute

    def shares(self, col: int, lo: int, hi: int) -> float:
        """Rank ``col``'s samples over rows [lo, hi) / an even share of them (1.0: even)."""
        if not self.uneven:
            return 1.0
        ratio = self.compute[lo:hi, col] / self.per_sample[lo:hi, col]  # samples / mean samples
        ok = ratio[~np.isnan(ratio)]
        return float(ok.mean()) if ok.size else 1.0


def _per_sample(compute: np.ndarray, samples: np.ndarray) -> np.ndarray:
    """Compute scaled to an even share: ``compute`` itself when no step's shares differ."""
    known = samples > 0  # NaN (no record) and 0 (samples not recorded) compare False
    with quiet():
        mean = np.nanmean(np.where(known, samples, np.nan), axis=1, keepdims=True)
    scale = np.where(known, mean / np.where(known, samples, 1.0), 1.0)
    if np.all((scale == 1.0) | np.isnan(scale)):
        return compute  # shares were even at every step (or unknown): identical arrays
    return compute * np.where(np.isnan(scale), 1.0, scale)


@dataclass(slots=True)
class WindowScores:
    """Row k describes the window of ``window`` recorded steps ending at ``end_steps[k]``."""

    end_steps: np.ndarray
    ranks: np.ndarray
    median: np.ndarray  # [windows, ranks] median compute
    median_per_sample: np.ndarray  # [windows, ranks] median of ``StepMatrix.per_sample``
    relative: np.ndarray  # [windows, ranks]
    individual: np.ndarray  # [windows, ranks]
    #: [windows] windowed median of the job's per-step pace (``job_pace``), per step and per sample
    job_median: np.ndarray
    job_median_per_sample: np.ndarray
    job_individual: np.ndarray  # [windows]


def window_scores(records: Iterable[StepRecord] | StepMatrix, window: int = 20) -> WindowScores:
    """Relative and individual scores of every rank for every full window (NaN: too few records)."""
    m = records if isinstance(records, StepMatrix) else StepMatrix.from_records(records)
    med = _windowed_median(m.compute, window)
    per = _windowed_median(m.per_sample, window) if m.uneven else med
    job = _windowed_median(job_pace(m.compute)[:, None], window)[:, 0]
    job_per = _windowed_median(job_pace(m.per_sample)[:, None], window)[:, 0] if m.uneven else job
    with np.errstate(all="ignore"), quiet():
        return WindowScores(
            end_steps=m.steps[window - 1 :],
            ranks=m.ranks,
            median=med,
            median_per_sample=per,
            relative=np.fmax(_relative(med), _relative(per)),
            individual=np.fmax(
                np.fmin.accumulate(med, axis=0) / med, np.fmin.accumulate(per, axis=0) / per
            ),
            job_median=job,
            job_median_per_sample=job_per,
            job_individual=np.fmax(
                np.fmin.accumulate(job) / job, np.fmin.accumulate(job_per) / job_per
            ),
        )


def _relative(med: np.ndarray) -> np.ndarray:
    fastest = np.nanmin(med, axis=1, keepdims=True) if med.size else med
    return fastest / med


def job_pace(compute: np.ndarray) -> np.ndarray:
    """Per step, the lower median of the ranks' compute: the job as a whole is slower only when
    more than half of its ranks are. (The plain median of two ranks is their mean, which one
    straggler lifts; a job-wide slowdown lifts the fastest half too.)"""
    c = np.sort(compute, axis=1)  # NaN sorts last
    n = np.sum(~np.isnan(compute), axis=1)
    out = np.full(c.shape[0], np.nan)
    has = n > 0
    out[has] = c[has, (n[has] - 1) // 2]
    return out


def ratio(compute: np.ndarray, col: int) -> float:
    """How many times slower rank ``col``'s median compute is than the fastest other rank's
    median over these rows (NaN if unknown)."""
    med = nanmedian(compute, axis=0)
    others = np.delete(med, col)
    ok = others[~np.isnan(others)]
    return float(med[col]) / float(ok.min()) if ok.size and ok.min() > 0 else np.nan


def slowdown(m: StepMatrix, col: int, lo: int, hi: int) -> float:
    """``ratio`` over rows [lo, hi), per step and per sample: the smaller (kinder) of the two."""
    raw = ratio(m.compute[lo:hi], col)
    return raw if not m.uneven else float(np.fmin(raw, ratio(m.per_sample[lo:hi], col)))


def slow_steps(m: StepMatrix, col: int, threshold: float) -> np.ndarray:
    """Per row, how slow rank ``col`` was *at that step*, per step and per sample, as weights
    for ``slow_interval``: 1 where it computed at least 1/threshold times as long as the typical
    other rank (the median of the others); 0 where it did not, but set the pace (computed longer
    than every other rank) and at least 1/threshold times as long as the fastest other rank
    (rule 3's reference); -1 otherwise.

    Comparing within a step, not with a reference taken over many steps, keeps machine-wide
    changes out of the interval: a rank that sleeps leaves its core to the others, which then
    run faster than before it slowed, and their faster steps must not make its earlier steps
    look slow. The steps weighted 0 neither extend nor break a slow stretch. On a loaded host
    the other ranks contend for the cores a sleeping straggler leaves: a rank slowed 2x
    (``--slow 3:2``, 4 ranks on 2 cores) computed about 1.3x as long as the typical other rank
    and 2x the fastest, set the pace at most steps, and was more than 1.33x the typical one at
    only about half of them. Counted against it, the other half broke its stretch into pieces
    shorter than ``min_steps``, and it was never reported. Being only behind the typical rank
    (not the slowest) stays -1: that is where noise puts a rank half of the time. With two ranks
    the typical rank is the other one, and the weights are 1 and -1 as before."""
    flags = _step_evidence(m.compute, col, threshold)
    return np.minimum(flags, _step_evidence(m.per_sample, col, threshold)) if m.uneven else flags


def _step_evidence(compute: np.ndarray, col: int, threshold: float) -> np.ndarray:
    others = np.delete(compute, col, axis=1)
    mine = compute[:, col]
    if others.shape[1] == 0:
        return np.full(len(mine), -1, dtype=np.int8)
    with quiet(), np.errstate(all="ignore"):
        typical = np.nanmedian(others, axis=1)
        fastest, slowest = np.nanmin(others, axis=1), np.nanmax(others, axis=1)
        paced = (mine > slowest) & (fastest / mine < threshold)
        return np.where(typical / mine < threshold, 1, np.where(paced, 0, -1)).astype(np.int8)


def pace_shares(compute: np.ndarray) -> np.ndarray:
    """Per rank, the share of these rows at which it had the largest compute (set the pace)."""
    c = np.where(np.isnan(compute), -np.inf, compute)
    return np.bincount(np.argmax(c, axis=1), minlength=c.shape[1]) / max(1, c.shape[0])


def above_others(compute: np.ndarray, col: int) -> float:
    """The share of these rows at which rank ``col`` computed longer than the median of the
    other ranks at that row (rows where either is missing do not count; NaN if none left)."""
    typical = nanmedian(np.delete(compute, col, axis=1), axis=1)
    mine = compute[:, col]
    ok = ~(np.isnan(mine) | np.isnan(typical))
    return float(np.mean(mine[ok] > typical[ok])) if ok.any() else np.nan


def runs(flags: np.ndarray, merge_gap: int = 0) -> list[tuple[int, int]]:
    """Inclusive index ranges of True, joining ranges separated by fewer than ``merge_gap``."""
    idx = np.flatnonzero(np.diff(np.concatenate([[0], flags.astype(np.int8), [0]])))
    out: list[tuple[int, int]] = []
    for a, b in zip(idx[::2].tolist(), (idx[1::2] - 1).tolist(), strict=True):
        if out and a - out[-1][1] - 1 < merge_gap:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def kadane(slow: np.ndarray) -> tuple[int, int] | None:
    """The range maximising the sum of ``slow``'s weights (booleans: #slow - #not slow), one of
    the ranges with the most weight that starts and ends on a positive one: where the slow steps
    are, robust to noise."""
    weights = np.where(slow, 1, -1) if slow.dtype == bool else slow
    best, best_range, run, start = 0, None, 0, 0
    for i, s in enumerate(weights.tolist()):
        if run <= 0 and s > 0:
            run, start = 0, i
        elif run <= 0:
            continue
        run += s
        if run > best:
            best, best_range = run, (start, i)
    return best_range


def slow_interval(slow: np.ndarray, lo: int, hi: int) -> tuple[int, int]:
    """Rows [a, b] of the slow stretch inside rows [lo, hi) (all of them if none is slow)."""
    found = kadane(slow[lo:hi])
    return (lo, hi - 1) if found is None else (lo + found[0], lo + found[1])


def pace_and_idle(m: StepMatrix, col: int, lo: int, hi: int) -> tuple[int, float]:
    """Over rows [lo, hi): at how many steps rank ``col`` set the pace (largest compute), and the
    idle it caused on the other ranks as a share of their wall time."""
    others = np.arange(len(m.ranks)) != col
    c = m.compute[lo:hi]
    paced = np.argmax(np.where(np.isnan(c), -np.inf, c), axis=1) == col
    # The others' idle is charged to this rank at the steps it arrived last (least idle). For BSP
    # that is where it set the pace; with local SGD the idle of a barrier step covers the compute
    # since the previous barrier, and the rank that arrived last need not be the slowest *then*.
    idle_rows = m.idle[lo:hi]
    last = idle_rows[:, col] <= np.nanmin(np.where(np.isnan(idle_rows), np.inf, idle_rows), axis=1)
    inside = np.nonzero(m.barrier[lo:hi])[0]
    if inside.size == 0:
        # No barrier (gossip's pair waits, a parameter server's staleness bound): the idle the
        # strategy measured at each step, charged the same way, against the others' wall time
        # over the interval.
        idle = float(np.nansum(idle_rows[last][:, others]))
        wall = float(np.nansum(m.wall[lo:hi][:, others]))
        return int(paced.sum()), idle / wall if wall > 0 else 0.0
    last &= m.barrier[lo:hi]
    idle = float(np.nansum(idle_rows[last][:, others]))
    # A barrier's idle covers every step since the previous barrier, so it is measured against
    # the others' wall time over those whole periods: from just after the last barrier before
    # the interval to the last barrier inside it (under BSP, exactly the interval).
    before = np.nonzero(m.barrier[:lo])[0]
    start = int(before[-1]) + 1 if before.size else 0
    end = lo + int(inside[-1]) + 1
    wall = float(np.nansum(m.wall[start:end][:, others]))
    return int(paced.sum()), idle / wall if wall > 0 else 0.0


def _windowed_median(x: np.ndarray, window: int) -> np.ndarray:
    n = x.shape[0] - window + 1
    if n <= 0:
        return np.empty((0, x.shape[1]))
    view = np.lib.stride_tricks.sliding_window_view(x, window, axis=0)
    out = np.empty((n, x.shape[1]))
    for lo in range(0, n, 4096):  # chunks bound the copy nanmedian makes on long runs
        block = view[lo : lo + 4096]
        med = nanmedian(block, axis=-1)
        med[(~np.isnan(block)).sum(axis=-1) < max(2, window // 2)] = np.nan
        out[lo : lo + 4096] = med
    return out


@contextmanager
def quiet() -> Iterator[None]:
    # All-NaN windows (a rank without records) are expected; numpy warns about each one.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def nanmedian(x: np.ndarray, axis: int) -> np.ndarray:
    with quiet():
        return np.asarray(np.nanmedian(x, axis=axis))


def synthetic_records(
    steps: int,
    world_size: int,
    *,
    compute: float = 0.1,
    jitter: float = 0.1,
    comm: float = 0.01,
    slow: Iterable[tuple[int | None, int, int, float]] = (),
    bytes_per_step: int = 1_000_000,
    seed: int = 0,
) -> list[StepRecord]:
    """A BSP run without processes, for tests and demos: compute times jittered by +-``jitter``,
    and ``slow`` entries (rank or None for all, first step, last step, factor) planted on top."""
    rng = np.random.default_rng(seed)
    c = compute * rng.uniform(1 - jitter, 1 + jitter, size=(steps, world_size))
    for rank, first, last, factor in slow:
        c[first : last + 1, slice(None) if rank is None else rank] *= factor
    out, t = [], 1.7e9
    for s in range(steps):
        slowest = float(c[s].max())
        for r in range(world_size):
            idle = slowest - float(c[s, r])
            out.append(
                StepRecord(r, s, t, float(c[s, r]), idle + comm, idle, comm, 32, bytes_per_step)
            )
            out[-1].loss = 2.0 / (1 + 0.01 * s)
        t += slowest + comm
    return out
