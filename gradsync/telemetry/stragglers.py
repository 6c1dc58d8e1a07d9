"""Straggler detection from step records alone: windowed scores, episodes, and their evidence.

Scores (``gradsync.telemetry.scores``): per rank over a sliding window of ``window`` recorded
steps, relative = fastest rank's median compute / this rank's; individual = the rank's best
windowed median so far / its current one (0.5 = twice as slow as the reference). A rank whose
relative score drops below ``threshold`` is a *candidate* straggler. Individual scores do not
flag single ranks (slower than its own past but not than the fastest = the job slowed down):
the formula is applied to the job's per-step median instead, making a ``slowdown`` candidate.

Real runs (a few ms of compute per step, more processes than cores) are noisy, so a candidate,
whose interval is where its slow steps are, becomes a finding only if:

1. warm-up is over: the first ``warmup`` recorded steps (default 10) are never scored;
2. it lasts: its interval spans at least ``min_steps`` recorded steps (default half a window);
3. its evidence supports it: over the interval its median compute is at least 1/threshold times
   the fastest other rank's (never "1.0x slower"); for a slowdown, the job's per-step median
   is at least 1/threshold times the job's best windowed median;
4. (ranks only) the others wait for it, over the flagged window: candidates are at most half
   the ranks (when most ranks are slower than the fastest, the fastest is the odd one); in at
   least 2/3 of the steps
   it computed longer than the other ranks' median, and it set the pace (largest compute) in
   at least 1/(k+1) of them, k being the number of ranks behind the typical one in the window
   (two equally slow stragglers share the pace and are both found). Being slower than one
   unusually fast rank, or descheduled in some steps, is noise spread over ranks.

Live, the same rules are applied to the last window at every step; a warning comes at the first
step where a flagged window passes them, and an episode ends only once the score has stayed
above the threshold for a whole window, so a rank hovering near the threshold warns once. Batch
reports an episode iff live would have warned in it, with the interval of the whole episode.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import numpy as np

from gradsync.errors import UsageError
from gradsync.telemetry.records import StepRecord
from gradsync.telemetry.scores import (
    StepMatrix,
    WindowScores,
    above_others,
    nanmedian,
    pace_and_idle,
    pace_shares,
    ratio,
    runs,
    slow_interval,
    synthetic_records,
    window_scores,
)

__all__ = [
    "Finding",
    "StepMatrix",
    "StragglerConfig",
    "StragglerDetector",
    "WindowScores",
    "find_stragglers",
    "runs",
    "synthetic_records",
    "window_scores",
]


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerConfig:
    """``min_steps=None`` means half a window."""

    window: int = 20
    threshold: float = 0.75
    warmup: int = 10
    min_steps: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.window, bool) or not isinstance(self.window, int) or self.window < 2:
            raise UsageError(f"window must be an integer >= 2 (steps), got {self.window!r}")
        if not 0.0 < self.threshold < 1.0:
            raise UsageError(
                f"threshold must be between 0 and 1 exclusive, got {self.threshold!r} "
                "(0.75 flags a rank more than 1.33x slower than the fastest)"
            )
        if isinstance(self.warmup, bool) or not isinstance(self.warmup, int) or self.warmup < 0:
            raise UsageError(f"warmup must be an integer >= 0 (steps), got {self.warmup!r}")
        m = self.min_steps
        if m is not None and (isinstance(m, bool) or not isinstance(m, int) or m < 1):
            raise UsageError(f"min_steps must be an integer >= 1 (steps) or None, got {m!r}")

    @property
    def min_len(self) -> int:
        """The shortest interval a finding may have, in recorded steps."""
        return max(1, self.window // 2) if self.min_steps is None else self.min_steps

    def supports(self, steps: int, slowdown: float) -> bool:
        """Rules 2 and 3: long enough, and at least 1/threshold times slower (NaN never is)."""
        return steps >= self.min_len and slowdown * self.threshold >= 1.0


@dataclass(frozen=True, slots=True)
class Finding:
    """One episode: a straggling rank, or a job-wide slowdown (``rank is None``).

    ``slowdown``: how many times slower than the reference (the fastest other rank's median, or
    the job's best windowed median) over ``first_step..last_step``. ``score``: the lowest windowed
    score seen. ``idle_share``: idle the rank caused on the other ranks (their idle at steps where
    it arrived last) over their wall time (compute + sync) in the interval. ``detected_at``: the
    step at which the live detector warns (batch: would have warned). ``above_others``: the share
    of the interval's steps where the rank computed longer than the other ranks' median.
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
    above_others: float | None = None

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
    records: Iterable[StepRecord] | StepMatrix,
    window: int = 20,
    threshold: float = 0.75,
    *,
    warmup: int = 10,
    min_steps: int | None = None,
) -> list[Finding]:
    """Every episode in a finished run that passes the rules, ordered by first step."""
    cfg = StragglerConfig(window=window, threshold=threshold, warmup=warmup, min_steps=min_steps)
    full = records if isinstance(records, StepMatrix) else StepMatrix.from_records(records)
    m, w, th = full.rows(cfg.warmup), cfg.window, cfg.threshold
    sc = window_scores(m, w)
    job_best = np.fmin.accumulate(sc.job_median)
    out: list[Finding] = []
    for col, score in [*enumerate(sc.relative.T), (None, sc.job_individual)]:
        for w0, w1 in runs(score < th, merge_gap=w):
            low = float(np.nanmin(score[w0 : w1 + 1]))
            # Reported iff live would have warned: some flagged window's candidate passes.
            ks = (k for k in range(w0, w1 + 1) if score[k] < th)
            hits = (_candidate(m, cfg, col, k, k + w, low, job_best[k]) for k in ks)
            if (first := next((f for f in hits if f), None)) is not None:
                f = _candidate(m, cfg, col, w0, w1 + w, low, job_best[w0], whole_run=True)
                out.append(replace(f or first, detected_at=first.detected_at, ongoing=False))
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
        self._seen = 0  # steps processed, warm-up included
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
        self._seen += 1
        if self._seen <= cfg.warmup:
            return []
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
        for key, score in flagged.items():
            if key in self._calm:
                continue
            c = None if key[1] is None else int(np.searchsorted(m.ranks, key[1]))
            f = _candidate(m, cfg, c, 0, w, score, self._job_best)
            if f is not None:  # else not (yet) supported by its evidence: look again next step
                self._calm[key] = 0
                new.append(replace(f, ongoing=True))
        return new


_ABOVE_OTHERS = 2 / 3  # rule 4: noise rarely keeps a rank behind the typical one this often


def _waited_for(window: np.ndarray, col: int, threshold: float) -> bool:
    """Rule 4 on one window: a minority of candidates, behind the typical rank, pacing."""
    med = nanmedian(window, axis=0)
    with np.errstate(all="ignore"):
        candidates = int(np.sum(np.nanmin(med) / med < threshold))
    if 2 * candidates > len(med):  # most ranks "slower than the fastest": that one is fast
        return False
    behind = [above_others(window, j) >= _ABOVE_OTHERS for j in range(window.shape[1])]
    return behind[col] and pace_shares(window)[col] * (sum(behind) + 1) >= 1.0


def _candidate(
    m: StepMatrix,
    cfg: StragglerConfig,
    col: int | None,
    lo: int,
    hi: int,
    score: float,
    job_best: float,
    whole_run: bool = False,
) -> Finding | None:
    """Rank ``col``'s (None: the job's) candidate in rows [lo, hi), if the rules accept it."""
    if col is None:
        return _slowdown(m, lo, hi, cfg, float(job_best), score)
    return _straggler(m, col, lo, hi, cfg, score, whole_run)


def _straggler(
    m: StepMatrix,
    col: int,
    lo: int,
    hi: int,
    cfg: StragglerConfig,
    score: float,
    whole_run: bool = False,
) -> Finding | None:
    """The finding for rank ``col``'s candidate in rows [lo, hi), or None if the rules reject it.

    Rule 4 is checked on the rows given (the flagged window) unless ``whole_run``: a batch
    episode's rows may span quiet stretches between flagged windows that already passed it.
    """
    others = np.arange(len(m.ranks)) != col
    if not whole_run and not _waited_for(m.compute[lo:hi], col, cfg.threshold):
        return None
    ref = np.nanmin(nanmedian(m.compute[lo:hi][:, others], axis=0), initial=np.inf)
    with np.errstate(all="ignore"):
        a, b = slow_interval(ref / m.compute[:, col] < cfg.threshold, lo, hi)
    slowdown = ratio(m.compute[a : b + 1], col)
    if not cfg.supports(b - a + 1, slowdown):
        return None
    paced, idle_share = pace_and_idle(m, col, a, b + 1)
    return Finding(
        kind="straggler",
        rank=int(m.ranks[col]),
        first_step=int(m.steps[a]),
        last_step=int(m.steps[b]),
        steps=b - a + 1,
        slowdown=slowdown,
        score=score,
        paced_steps=paced,
        idle_share=idle_share,
        detected_at=int(m.steps[hi - 1]),
        above_others=above_others(m.compute[a : b + 1], col),
    )


def _slowdown(
    m: StepMatrix,
    lo: int,
    hi: int,
    cfg: StragglerConfig,
    ref: float,
    score: float,
) -> Finding | None:
    """The job-wide finding for the candidate in rows [lo, hi), or None if the rules reject it."""
    job = nanmedian(m.compute, axis=1)
    with np.errstate(all="ignore"):
        a, b = slow_interval(ref / job < cfg.threshold, lo, hi)
    slowdown = float(nanmedian(job[a : b + 1], axis=0)) / ref if ref > 0 else np.nan
    if not cfg.supports(b - a + 1, slowdown):
        return None
    return Finding(
        kind="slowdown",
        rank=None,
        first_step=int(m.steps[a]),
        last_step=int(m.steps[b]),
        steps=b - a + 1,
        slowdown=slowdown,
        score=score,
        detected_at=int(m.steps[hi - 1]),
    )
