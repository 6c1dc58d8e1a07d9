"""Straggler detection from step records alone: windowed scores, episodes, and their evidence.

Scores follow the usual convention (0.5 = twice as slow as the reference), per rank, over a
sliding window of ``window`` steps:

- relative = fastest rank's median compute / this rank's median compute
- individual = this rank's best (lowest) windowed median so far / its current windowed median

A rank is flagged as a *straggler* when its relative score drops below ``threshold``: at a
barrier everyone waits for it. The individual score is not used to flag single ranks, because a
rank that is slow against its own past but not against the fastest rank means the whole job
slowed down, and calling every rank a straggler would hide that. Instead the individual formula
is applied to the job (per-step median compute across ranks): below ``threshold`` it raises one
``slowdown`` finding for all ranks (input pipeline, throttling, a busy host...).

An episode starts when a score first crosses the threshold and ends only once the score has
stayed above it for a whole window, so a rank hovering near the threshold warns once, not on
every crossing. Windows are counted in recorded steps, and a rank needs records for at least
half a window to be scored, so runs shorter than one window produce no findings.
"""

from __future__ import annotations

import warnings
from collections import deque
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from typing import Any, Literal

import numpy as np

from gradsync.errors import UsageError
from gradsync.telemetry.records import StepRecord

__all__ = [
    "Finding",
    "StepMatrix",
    "StragglerConfig",
    "StragglerDetector",
    "WindowScores",
    "find_stragglers",
    "synthetic_records",
    "window_scores",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerConfig:
    window: int = 20
    threshold: float = 0.75

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 2:
            raise UsageError(f"window must be an integer >= 2 (steps), got {self.window!r}")
        if not 0.0 < self.threshold < 1.0:
            raise UsageError(
                f"threshold must be between 0 and 1 exclusive, got {self.threshold!r} "
                "(0.75 flags a rank more than 1.33x slower than the fastest)"
            )


@dataclass(frozen=True, slots=True)
class Finding:
    """One episode: a straggling rank, or a job-wide slowdown (``rank is None``).

    ``slowdown``: how many times slower than the reference (the fastest other rank's median, or
    the job's best windowed median) over ``first_step..last_step``. ``score``: the lowest
    windowed score seen. ``idle_share``: idle the rank caused on the other ranks (their idle at
    steps where it arrived last) over their wall time (compute + sync) in the interval.
    """

    kind: Literal["straggler", "slowdown"]
    rank: int | None
    first_step: int
    last_step: int
    steps: int
    slowdown: float
    score: float
    paced_steps: int = 0
    idle_share: float = 0.0
    detected_at: int = -1
    ongoing: bool = False

    def describe(self) -> str:
        span = f"steps {self.first_step}-{self.last_step}"
        if self.ongoing:
            span += " (still slow)"
        if self.kind == "slowdown":
            return (
                f"all ranks: {self.slowdown:.1f}x slower than the job's own best over {span}; "
                "a job-wide slowdown, not one straggler (look for a shared cause: input "
                "pipeline, throttling, a busy host)"
            )
        return (
            f"rank {self.rank}: {self.slowdown:.1f}x slower than the fastest rank over {span}; "
            f"it set the pace in {self.paced_steps} of {self.steps} steps; "
            f"idle it caused on the other ranks: {self.idle_share:.0%} of their wall time"
        )

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "description": self.describe()}


def find_stragglers(
    records: Iterable[StepRecord] | StepMatrix, window: int = 20, threshold: float = 0.75
) -> list[Finding]:
    """Every episode in a finished run, with its evidence, ordered by first step."""
    cfg = StragglerConfig(window=window, threshold=threshold)
    m = records if isinstance(records, StepMatrix) else StepMatrix.from_records(records)
    sc = window_scores(m, cfg.window)
    w = cfg.window
    out: list[Finding] = []
    for col in range(len(m.ranks)):
        rel = sc.relative[:, col]
        for w0, w1 in runs(rel < cfg.threshold, merge_gap=w):
            score = float(np.nanmin(rel[w0 : w1 + 1]))
            f = _straggler(m, col, w0, w1 + w, cfg.threshold, score, int(m.steps[w0 + w - 1]))
            out.append(f)
    job_best = np.fmin.accumulate(sc.job_median)
    for w0, w1 in runs(sc.job_individual < cfg.threshold, merge_gap=w):
        score = float(np.nanmin(sc.job_individual[w0 : w1 + 1]))
        ref = float(job_best[w0])
        out.append(_slowdown(m, w0, w1 + w, cfg.threshold, ref, score, int(m.steps[w0 + w - 1])))
    return sorted(out, key=lambda f: (f.first_step, -1 if f.rank is None else f.rank))


class StragglerDetector:
    """Live detection: feed records as steps finish; get a ``Finding`` once per new episode.

    Pass whole steps (every rank's record of a step in one ``update`` call), or give
    ``world_size`` so that a step waits until all ranks reported (or ``window`` newer steps
    arrived without it). ``scores`` holds the latest (relative, individual) per rank.
    """

    def __init__(self, config: StragglerConfig | None = None, *, world_size: int | None = None):
        self.config = config or StragglerConfig()
        self.world_size = world_size
        self.findings: list[Finding] = []
        self.scores: dict[int, tuple[float, float]] = {}
        self._pending: dict[int, dict[int, StepRecord]] = {}
        self._rows: deque[list[StepRecord]] = deque(maxlen=self.config.window)
        self._best: dict[int, float] = {}
        self._job_best = np.inf
        self._calm: dict[tuple[str, int | None], int] = {}  # open episode -> windows unflagged

    def update(self, records: Iterable[StepRecord]) -> list[Finding]:
        for r in records:
            self._pending.setdefault(r.step, {})[r.rank] = r
        if not self._pending:
            return []
        newest = max(self._pending)
        new: list[Finding] = []
        for step in sorted(self._pending):
            row = self._pending[step]
            complete = self.world_size is None or len(row) >= self.world_size
            if not complete and step > newest - self.config.window:
                break  # later steps must wait too, or windows would run out of order
            del self._pending[step]
            new.extend(self._process(list(row.values())))
        self.findings.extend(new)
        return new

    def _process(self, row: list[StepRecord]) -> list[Finding]:
        cfg, w = self.config, self.config.window
        self._rows.append(row)
        if len(self._rows) < w:
            return []
        m = StepMatrix.from_records(r for rs in self._rows for r in rs)
        sc = window_scores(m, w)
        med, rel = sc.median[-1], sc.relative[-1]
        flagged: dict[tuple[str, int | None], float] = {}
        for col, rank in enumerate(m.ranks.tolist()):
            if np.isnan(med[col]):
                continue
            best = min(self._best.get(rank, np.inf), float(med[col]))
            self._best[rank] = best
            self.scores[rank] = (float(rel[col]), best / float(med[col]))
            if rel[col] < cfg.threshold:
                flagged[("straggler", rank)] = float(rel[col])
        job = float(sc.job_median[-1])
        if not np.isnan(job):
            self._job_best = min(self._job_best, job)
            if self._job_best / job < cfg.threshold:
                flagged[("slowdown", None)] = self._job_best / job
        for key in list(self._calm):
            self._calm[key] = 0 if key in flagged else self._calm[key] + 1
            if self._calm[key] >= w:
                del self._calm[key]  # a whole window above threshold: the episode is over
        new: list[Finding] = []
        step = int(m.steps[-1])
        for key, score in flagged.items():
            if key in self._calm:
                continue
            self._calm[key] = 0
            if key[1] is None:
                f = _slowdown(m, 0, w, cfg.threshold, self._job_best, score, step, ongoing=True)
            else:
                col = int(np.searchsorted(m.ranks, key[1]))
                f = _straggler(m, col, 0, w, cfg.threshold, score, step, ongoing=True)
            new.append(f)
        return new


@dataclass(slots=True)
class StepMatrix:
    """Records as [step, rank] arrays; NaN where a rank has no record for a step."""

    steps: np.ndarray
    ranks: np.ndarray
    compute: np.ndarray
    idle: np.ndarray
    wall: np.ndarray

    @classmethod
    def from_records(cls, records: Iterable[StepRecord]) -> StepMatrix:
        recs = list(records)
        steps = np.array(sorted({r.step for r in recs}), dtype=np.int64)
        ranks = np.array(sorted({r.rank for r in recs}), dtype=np.int64)
        shape = (len(steps), len(ranks))
        compute, idle, wall = np.full(shape, np.nan), np.full(shape, np.nan), np.full(shape, np.nan)
        if recs:
            i = np.searchsorted(steps, [r.step for r in recs])
            j = np.searchsorted(ranks, [r.rank for r in recs])
            compute[i, j] = [r.compute for r in recs]
            idle[i, j] = [r.idle for r in recs]
            wall[i, j] = [r.compute + r.sync for r in recs]
        return cls(steps, ranks, compute, idle, wall)


@dataclass(slots=True)
class WindowScores:
    """Row k describes the window of ``window`` recorded steps ending at ``end_steps[k]``."""

    end_steps: np.ndarray
    ranks: np.ndarray
    median: np.ndarray  # [windows, ranks] median compute
    relative: np.ndarray  # [windows, ranks]
    individual: np.ndarray  # [windows, ranks]
    job_median: np.ndarray  # [windows] windowed median of the per-step median across ranks
    job_individual: np.ndarray  # [windows]


def window_scores(records: Iterable[StepRecord] | StepMatrix, window: int = 20) -> WindowScores:
    """Relative and individual scores of every rank for every full window (NaN: too few records)."""
    m = records if isinstance(records, StepMatrix) else StepMatrix.from_records(records)
    med = _windowed_median(m.compute, window)
    job = _windowed_median(_nanmedian(m.compute, axis=1)[:, None], window)[:, 0]
    with np.errstate(all="ignore"), _quiet():
        fastest = np.nanmin(med, axis=1, keepdims=True) if med.size else med
        return WindowScores(
            end_steps=m.steps[window - 1 :],
            ranks=m.ranks,
            median=med,
            relative=fastest / med,
            individual=np.fmin.accumulate(med, axis=0) / med,
            job_median=job,
            job_individual=np.fmin.accumulate(job) / job,
        )


def _windowed_median(x: np.ndarray, window: int) -> np.ndarray:
    n = x.shape[0] - window + 1
    if n <= 0:
        return np.empty((0, x.shape[1]))
    view = np.lib.stride_tricks.sliding_window_view(x, window, axis=0)
    out = np.empty((n, x.shape[1]))
    for lo in range(0, n, 4096):  # chunks bound the copy nanmedian makes on long runs
        block = view[lo : lo + 4096]
        med = _nanmedian(block, axis=-1)
        med[(~np.isnan(block)).sum(axis=-1) < max(2, window // 2)] = np.nan
        out[lo : lo + 4096] = med
    return out


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
    """The range maximising (#slow - #not slow): where the slow steps are, robust to noise."""
    best, best_range, run, start = 0, None, 0, 0
    for i, s in enumerate(slow.tolist()):
        if run <= 0:
            run, start = 0, i
        run += 1 if s else -1
        if run > best:
            best, best_range = run, (start, i)
    return best_range


def _interval(slow: np.ndarray, lo: int, hi: int) -> tuple[int, int]:
    """Rows [a, b] of the slow stretch inside rows [lo, hi)."""
    found = kadane(slow[lo:hi])
    return (lo, hi - 1) if found is None else (lo + found[0], lo + found[1])


def _fastest_other(m: StepMatrix, col: int, a: int, b: int) -> tuple[float, float]:
    """(fastest other rank's median, this rank's median) of compute over rows [a, b)."""
    meds = _nanmedian(m.compute[a:b], axis=0)
    others = np.delete(meds, col)
    ok = others[~np.isnan(others)]
    return (float(ok.min()) if ok.size else np.nan), float(meds[col])


def _straggler(
    m: StepMatrix,
    col: int,
    lo: int,
    hi: int,
    th: float,
    score: float,
    at: int,
    ongoing: bool = False,
) -> Finding:
    ref, _ = _fastest_other(m, col, lo, hi)
    with np.errstate(all="ignore"):
        a, b = _interval(ref / m.compute[:, col] < th, lo, hi)
    ref, mine = _fastest_other(m, col, a, b + 1)
    others = np.arange(len(m.ranks)) != col
    c = m.compute[a : b + 1]
    paced = np.argmax(np.where(np.isnan(c), -np.inf, c), axis=1) == col
    # The others' idle is charged to this rank at the steps it arrived last (least idle). For BSP
    # that is where it set the pace; with local SGD the idle of a barrier step covers the compute
    # since the previous barrier, and the rank that arrived last need not be the slowest *then*.
    idle_rows = m.idle[a : b + 1]
    last = idle_rows[:, col] <= np.nanmin(np.where(np.isnan(idle_rows), np.inf, idle_rows), axis=1)
    idle = float(np.nansum(idle_rows[last][:, others]))
    wall = float(np.nansum(m.wall[a : b + 1][:, others]))
    return Finding(
        kind="straggler",
        rank=int(m.ranks[col]),
        first_step=int(m.steps[a]),
        last_step=int(m.steps[b]),
        steps=b - a + 1,
        slowdown=mine / ref if ref > 0 else np.inf,
        score=score,
        paced_steps=int(paced.sum()),
        idle_share=idle / wall if wall > 0 else 0.0,
        detected_at=at,
        ongoing=ongoing,
    )


def _slowdown(
    m: StepMatrix,
    lo: int,
    hi: int,
    th: float,
    ref: float,
    score: float,
    at: int,
    ongoing: bool = False,
) -> Finding:
    job = _nanmedian(m.compute, axis=1)
    with np.errstate(all="ignore"):
        a, b = _interval(ref / job < th, lo, hi)
    return Finding(
        kind="slowdown",
        rank=None,
        first_step=int(m.steps[a]),
        last_step=int(m.steps[b]),
        steps=b - a + 1,
        slowdown=float(_nanmedian(job[a : b + 1], axis=0)) / ref if ref > 0 else np.inf,
        score=score,
        detected_at=at,
        ongoing=ongoing,
    )


@contextmanager
def _quiet() -> Iterator[None]:
    # All-NaN windows (a rank without records) are expected; numpy warns about each one.
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        yield


def _nanmedian(x: np.ndarray, axis: int) -> np.ndarray:
    with _quiet():
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
