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
   the ranks (when most ranks are slower than the fastest, the fastest is the odd one), unless
   it set the pace beyond chance among that many equally slow ranks (``_paces_beyond_chance``);
   in at least 2/3 of the steps
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

import math
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
    job_pace,
    nanmedian,
    pace_and_idle,
    pace_shares,
    runs,
    slow_interval,
    slow_steps,
    slowdown,
    synthetic_records,
    window_scores,
)

__all__ = [
    "Finding",
    "RankScores",
    "StepMatrix",
    "StragglerConfig",
    "StragglerDetector",
    "WindowScores",
    "find_stragglers",
    "format_scores",
    "rank_scores",
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
    ``share``: the rank's samples over the interval / an even share of them (1.0 unless load
    balancing moved samples; the slowdown is then also judged per sample, see ``scores``).
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
    share: float = 1.0

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
        if abs(self.share - 1.0) > 0.05:
            span += f" (with {self.share:.2f}x an even share of the samples)"
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
    best = np.fmin.accumulate(sc.job_median), np.fmin.accumulate(sc.job_median_per_sample)
    job_best = list(zip(best[0].tolist(), best[1].tolist(), strict=True))
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


@dataclass(frozen=True, slots=True)
class RankScores:
    """One rank's scores over a finished run (None: no full window after warm-up).

    ``relative`` and ``individual`` are those of the last full window; ``lowest_*`` the lowest
    of any window, with the step that window ended at (``lowest_*_step``)."""

    rank: int
    relative: float | None
    individual: float | None
    lowest_relative: float | None
    lowest_relative_step: int | None
    lowest_individual: float | None
    lowest_individual_step: int | None

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def rank_scores(
    records: Iterable[StepRecord] | StepMatrix, window: int = 20, *, warmup: int = 10
) -> list[RankScores]:
    """Every rank's relative and individual scores: the last window's and the lowest, scored
    like ``find_stragglers`` (the first ``warmup`` recorded steps left out)."""
    cfg = StragglerConfig(window=window, warmup=warmup)
    full = records if isinstance(records, StepMatrix) else StepMatrix.from_records(records)
    sc = window_scores(full.rows(cfg.warmup), cfg.window)
    out = []
    for col, rank in enumerate(sc.ranks.tolist()):
        rel, ind = _last_and_lowest(sc.relative[:, col]), _last_and_lowest(sc.individual[:, col])
        out.append(
            RankScores(
                rank=int(rank),
                relative=rel[0],
                individual=ind[0],
                lowest_relative=rel[1],
                lowest_relative_step=None if rel[2] is None else int(sc.end_steps[rel[2]]),
                lowest_individual=ind[1],
                lowest_individual_step=None if ind[2] is None else int(sc.end_steps[ind[2]]),
            )
        )
    return out


def _last_and_lowest(score: np.ndarray) -> tuple[float | None, float | None, int | None]:
    ok = np.flatnonzero(~np.isnan(score))
    if not ok.size:
        return None, None, None
    low = int(ok[np.argmin(score[ok])])
    return float(score[ok[-1]]), float(score[low]), low


def format_scores(scores: list[RankScores], limit: int = 16) -> list[str]:
    """A table for the text report: every rank, or the ``limit // 2`` lowest of a larger job."""
    shown = scores
    if len(scores) > limit:
        key = [np.inf if s.lowest_relative is None else s.lowest_relative for s in scores]
        shown = [scores[i] for i in sorted(np.argsort(key, kind="stable")[: limit // 2].tolist())]

    def num(x: float | None, step: int | None = None) -> str:
        text = "-" if x is None else f"{x:.2f}"
        return text if step is None else f"{text} ({step})"

    lines = [
        f"  {'rank':>4}  {'relative':>8}  {'lowest (step)':>14}  {'individual':>10}  "
        f"{'lowest (step)':>14}"
    ]
    lines += [
        f"  {s.rank:>4}  {num(s.relative):>8}  "
        f"{num(s.lowest_relative, s.lowest_relative_step):>14}  {num(s.individual):>10}  "
        f"{num(s.lowest_individual, s.lowest_individual_step):>14}"
        for s in shown
    ]
    if len(shown) < len(scores):
        lines.append(f"  ({len(scores) - len(shown)} more ranks, none lower: see --json)")
    return lines


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
        # the best windowed medians so far, per step and per sample (see ``scores``)
        self._best: dict[int, tuple[float, float]] = {}
        self._job_best = (np.inf, np.inf)
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
        med, per, rel = sc.median[-1], sc.median_per_sample[-1], sc.relative[-1]
        flagged: dict[tuple[str, int | None], float] = {}
        for col, rank in enumerate(m.ranks.tolist()):
            if np.isnan(med[col]):
                continue
            now = (float(med[col]), float(per[col]))
            best = _lower(self._best.get(rank, (np.inf, np.inf)), now)
            self._best[rank] = best
            self.scores[rank] = (float(rel[col]), _score(best, now))
            if rel[col] < cfg.threshold:
                flagged[("straggler", rank)] = float(rel[col])
        job = (float(sc.job_median[-1]), float(sc.job_median_per_sample[-1]))
        if not np.isnan(job[0]):
            self._job_best = _lower(self._job_best, job)
            if (score := _score(self._job_best, job)) < cfg.threshold:
                flagged[("slowdown", None)] = score
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


def _lower(a: tuple[float, float], b: tuple[float, float]) -> tuple[float, float]:
    return (min(a[0], b[0]), min(a[1], b[1]))


def _score(best: tuple[float, float], now: tuple[float, float]) -> float:
    """best / now, per step and per sample: the higher (kinder) of the two, as in ``scores``."""
    with np.errstate(all="ignore"):
        return float(np.fmax(best[0] / now[0], best[1] / now[1]))


def _waited_for(m: StepMatrix, lo: int, hi: int, col: int, threshold: float) -> bool:
    """Rule 4 on rows [lo, hi): a minority of candidates, behind the typical rank, pacing.

    Candidates are counted with the scores' (per step and per sample) relative score; waiting
    is about time, so the rest looks at compute per step."""
    relative = window_scores(m.rows(lo, hi), hi - lo).relative
    candidates = int(np.sum(relative[-1] < threshold)) if relative.size else 0
    window = m.compute[lo:hi]
    pace = pace_shares(window)[col]
    if 2 * candidates > len(m.ranks) and not _paces_beyond_chance(pace, candidates, hi - lo):
        return False  # most ranks "slower than the fastest": that one is fast
    behind = [above_others(window, j) >= _ABOVE_OTHERS for j in range(window.shape[1])]
    return behind[col] and pace * (sum(behind) + 1) >= 1.0


_BEYOND_CHANCE = 1e-5  # rule 4's exception: how unlikely a pace share must be among equals


def _paces_beyond_chance(share: float, candidates: int, steps: int) -> bool:
    """Whether setting the pace in ``share`` of ``steps`` steps is beyond what chance gives
    one of ``candidates`` equally slow ranks (probability at most ``_BEYOND_CHANCE``).

    Most ranks are candidates when one rank is unusually fast (on a loaded host, the one that
    got a core to itself): the others are all "slower than the fastest" and take the pace in
    turn. A real straggler among them still takes it at most steps (a rank slowed 2x on 4 ranks
    on 2 cores: 70-90% of a window, where chance among 3 gives 1/3), and was not reported."""
    if candidates < 2 or steps < 1:
        return False
    k, p = round(share * steps), 1.0 / candidates
    tail = sum(math.comb(steps, i) * p**i * (1 - p) ** (steps - i) for i in range(k, steps + 1))
    return tail <= _BEYOND_CHANCE


def _candidate(
    m: StepMatrix,
    cfg: StragglerConfig,
    col: int | None,
    lo: int,
    hi: int,
    score: float,
    job_best: tuple[float, float],
    whole_run: bool = False,
) -> Finding | None:
    """Rank ``col``'s (None: the job's) candidate in rows [lo, hi), if the rules accept it."""
    if col is None:
        return _slowdown(m, lo, hi, cfg, job_best, score)
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
    if not whole_run and not _waited_for(m, lo, hi, col, cfg.threshold):
        return None
    a, b = slow_interval(slow_steps(m, col, cfg.threshold), lo, hi)
    times = slowdown(m, col, a, b + 1)
    if not cfg.supports(b - a + 1, times):
        return None
    paced, idle_share = pace_and_idle(m, col, a, b + 1)
    return Finding(
        kind="straggler",
        rank=int(m.ranks[col]),
        first_step=int(m.steps[a]),
        last_step=int(m.steps[b]),
        steps=b - a + 1,
        slowdown=times,
        score=score,
        paced_steps=paced,
        idle_share=idle_share,
        detected_at=int(m.steps[hi - 1]),
        above_others=above_others(m.compute[a : b + 1], col),
        share=m.shares(col, a, b + 1),
    )


def _slowdown(
    m: StepMatrix,
    lo: int,
    hi: int,
    cfg: StragglerConfig,
    ref: tuple[float, float],
    score: float,
) -> Finding | None:
    """The job-wide finding for the candidate in rows [lo, hi), or None if the rules reject it.

    The job's pace is the lower median of the ranks' compute at each step (``job_pace``): it
    moves only when more than half of the ranks slowed, the complement of rule 4."""
    kinds = [(m.compute, ref[0])] + ([(m.per_sample, ref[1])] if m.uneven else [])
    with np.errstate(all="ignore"):
        jobs = [(job_pace(c), r) for c, r in kinds]
        a, b = slow_interval(
            np.logical_and.reduce([r / j < cfg.threshold for j, r in jobs]), lo, hi
        )
        ratios = [float(nanmedian(j[a : b + 1], axis=0)) / r if r > 0 else np.nan for j, r in jobs]
    times = float(np.min(ratios))  # NaN if any is unknown: rule 3 then rejects it
    if not cfg.supports(b - a + 1, times):
        return None
    return Finding(
        kind="slowdown",
        rank=None,
        first_step=int(m.steps[a]),
        last_step=int(m.steps[b]),
        steps=b - a + 1,
        slowdown=times,
        score=score,
        detected_at=int(m.steps[hi - 1]),
    )
