"""Straggler detection on synthetic BSP runs: planted stragglers found, noise left alone."""

from __future__ import annotations

import math
import random
import re

import numpy as np
import pytest

from gradsync.errors import UsageError
from gradsync.telemetry.records import StepRecord, fill_idle
from gradsync.telemetry.stragglers import (
    Finding,
    StragglerConfig,
    StragglerDetector,
    find_stragglers,
    runs,
    synthetic_records,
    window_scores,
)


def feed_by_step(det: StragglerDetector, records: list[StepRecord]) -> list[Finding]:
    by_step: dict[int, list[StepRecord]] = {}
    for r in records:
        by_step.setdefault(r.step, []).append(r)
    out: list[Finding] = []
    for step in sorted(by_step):
        out += det.update(by_step[step])
    return out


@pytest.mark.parametrize("factor", [1.5, 2.0, 3.0])
def test_planted_straggler_is_flagged_with_rank_and_interval(factor: float) -> None:
    recs = synthetic_records(200, 8, jitter=0.1, slow=[(3, 40, 199, factor)], seed=4)
    (f,) = find_stragglers(recs)
    assert (f.kind, f.rank, f.first_step, f.last_step, f.steps) == ("straggler", 3, 40, 199, 160)
    assert f.slowdown == pytest.approx(factor, rel=0.1)
    assert f.score < 0.75
    assert f.paced_steps == 160  # 1.5x with +-10% jitter never loses the max to another rank
    # Others wait (factor - 1) * compute at every step, out of a wall of factor*compute + comm.
    assert f.idle_share == pytest.approx((factor - 1) * 0.1 / (factor * 0.1 + 0.01), abs=0.03)


def test_episode_that_ends_gets_its_own_end_step() -> None:
    recs = synthetic_records(200, 8, slow=[(5, 40, 99, 2.0)], seed=1)
    assert [(f.rank, f.first_step, f.last_step) for f in find_stragglers(recs)] == [(5, 40, 99)]


def test_describe_gives_the_evidence_sentence() -> None:
    recs = synthetic_records(100, 4, slow=[(3, 40, 59, 1.8)], seed=2)
    (f,) = find_stragglers(recs)
    text = f.describe()
    assert re.fullmatch(
        r"rank 3: 1\.\dx slower than the fastest rank over steps 40-59; it set the pace in "
        r"\d+ of 20 steps; idle it caused on the other ranks: \d+% of their wall time",
        text,
    ), text
    assert f.to_dict()["description"] == text


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_clean_run_has_no_findings(seed: int) -> None:
    recs = synthetic_records(500, 8, jitter=0.1, seed=seed)
    assert find_stragglers(recs) == []
    # Not a near miss: the worst window is well clear of the 0.75 threshold.
    sc = window_scores(recs, 20)
    assert np.nanmin(sc.relative) > 0.85
    assert np.nanmin(sc.job_individual) > 0.85


def test_the_clean_run_check_can_fail() -> None:
    # The same noise at a threshold near 1 is flagged: "no findings" above is not vacuous.
    recs = synthetic_records(500, 8, jitter=0.1, seed=0)
    assert find_stragglers(recs, threshold=0.97)


def test_single_step_spikes_are_not_stragglers() -> None:
    rng = random.Random(3)
    spikes = [(rng.randrange(8), s, s, 3.0) for s in rng.sample(range(500), 25)]
    recs = synthetic_records(500, 8, jitter=0.1, slow=spikes, seed=3)
    assert find_stragglers(recs) == []


def test_job_wide_slowdown_is_one_finding_not_eight_stragglers() -> None:
    recs = synthetic_records(250, 8, slow=[(None, 100, 149, 2.0)], seed=5)
    (f,) = find_stragglers(recs)
    assert (f.kind, f.rank, f.first_step, f.last_step) == ("slowdown", None, 100, 149)
    assert f.slowdown == pytest.approx(2.0, rel=0.1)
    assert f.describe().startswith("all ranks: 2.0x slower than the job's own best")


def test_missing_records_neither_crash_nor_flag() -> None:
    recs = [r for r in synthetic_records(200, 4, seed=6) if not (r.rank == 2 and r.step < 60)]
    assert find_stragglers(recs) == []


def test_detector_warns_once_per_episode_and_agrees_with_batch() -> None:
    recs = synthetic_records(320, 8, slow=[(3, 40, 99, 2.0), (3, 200, 259, 2.0)], seed=7)
    det = StragglerDetector(StragglerConfig(window=20, threshold=0.75))
    live = feed_by_step(det, recs)
    assert [(f.rank, f.first_step, f.detected_at, f.ongoing) for f in live] == [
        (3, 40, 49, True),
        (3, 200, 209, True),
    ]
    assert det.findings == live
    batch = find_stragglers(recs)
    assert [(f.rank, f.detected_at) for f in batch] == [(3, 49), (3, 209)]
    relative, individual = det.scores[3]
    assert relative > 0.75 and individual > 0.75  # recovered at the end of the run


def test_hovering_at_the_threshold_is_one_episode() -> None:
    recs = synthetic_records(400, 8, jitter=0.1, slow=[(2, 40, 399, 1.34)], seed=8)
    rel = window_scores(recs, 20).relative[:, 2]
    assert len(runs(rel < 0.75)) > 1  # the raw score does cross back and forth
    assert len(feed_by_step(StragglerDetector(), recs)) == 1
    assert [f.rank for f in find_stragglers(recs)] == [2]


def test_detector_waits_for_every_rank_of_a_step() -> None:
    recs = synthetic_records(120, 4, slow=[(1, 30, 119, 2.0)], seed=9)
    rng = random.Random(0)
    rng.shuffle(recs)
    recs.sort(key=lambda r: r.step)  # steps in order, ranks within a step in random order
    det = StragglerDetector(world_size=4)
    live = [f for r in recs for f in det.update([r])]
    assert [(f.rank, f.first_step, f.detected_at) for f in live] == [(1, 30, 39)]


def test_job_slowdown_is_warned_live_once() -> None:
    recs = synthetic_records(250, 4, slow=[(None, 100, 149, 2.0)], seed=10)
    live = feed_by_step(StragglerDetector(), recs)
    assert [(f.kind, f.rank, f.first_step) for f in live] == [("slowdown", None, 100)]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"window": 1},
        {"window": 2.5},
        {"threshold": 0.0},
        {"threshold": 1.0},
        {"threshold": math.nan},
    ],
)
def test_config_rejects_bad_values_by_name(kwargs: dict[str, float]) -> None:
    with pytest.raises(UsageError, match=next(iter(kwargs))):
        StragglerConfig(**kwargs)  # type: ignore[arg-type]
    assert issubclass(UsageError, ValueError)


def test_runs_shorter_than_a_window_are_not_scored() -> None:
    recs = synthetic_records(15, 4, slow=[(0, 0, 14, 3.0)])
    assert window_scores(recs, 20).relative.shape == (0, 4)
    assert find_stragglers(recs) == []


def test_idle_is_charged_at_barriers_with_local_sgd() -> None:
    # Barrier every 4th step (local SGD): rank 3 is 2x slower on the steps in between, so it
    # arrives last at every barrier although its compute *at* the barrier step is normal.
    recs = synthetic_records(200, 4, jitter=0.05, slow=[(3, 0, 199, 2.0)], seed=12)
    for r in recs:
        if r.step % 4 == 3:
            r.compute /= 2.0 if r.rank == 3 else 1.0
        r.barrier = r.step % 4 == 3
        r.idle, r.sync = 0.0, r.comm
    for r in fill_idle(recs):
        r.sync = r.idle + r.comm  # the barrier wait is part of sync
    (f,) = find_stragglers(recs)
    assert f.rank == 3
    # Per barrier the others wait 3 steps x 0.1 s; each of their 4-step blocks lasts 0.4 s of
    # compute, 0.04 s of comm and the wait itself.
    assert f.idle_share == pytest.approx(0.3 / (0.4 + 0.04 + 0.3), abs=0.03)


# Rules that keep real (noisy) runs quiet; each test below fails if its rule is removed.


def test_warmup_steps_are_not_scored() -> None:
    recs = synthetic_records(120, 4, slow=[(0, 0, 11, 3.0)], seed=13)  # a slow first 12 steps
    assert find_stragglers(recs) == []
    assert feed_by_step(StragglerDetector(), recs) == []
    assert [(f.rank, f.first_step) for f in find_stragglers(recs, warmup=0)] == [(0, 0)]


@pytest.mark.parametrize(("min_steps", "found"), [(None, True), (13, True), (14, False)])
def test_episodes_shorter_than_min_steps_are_not_findings(
    min_steps: int | None, found: bool
) -> None:
    recs = synthetic_records(200, 8, slow=[(4, 100, 112, 2.0)], seed=14)  # 13 slow steps
    cfg = StragglerConfig(min_steps=min_steps)
    assert (cfg.min_len, StragglerConfig().min_len) == (min_steps or 10, 10)
    assert bool(find_stragglers(recs, min_steps=min_steps)) is found
    assert bool(feed_by_step(StragglerDetector(cfg), recs)) is found


@pytest.mark.parametrize("seed", [0, 1])
def test_findings_are_supported_by_their_own_evidence(seed: int) -> None:
    # Near the threshold, with noise: the kind of run that used to yield "1.0x slower".
    rng = np.random.default_rng(seed)
    recs = synthetic_records(300, 4, jitter=0.3, slow=[(1, 100, 249, 1.3)], seed=seed)
    for r in recs:
        r.compute *= 3.0 if rng.random() < 0.15 else 1.0  # preemption: whole time slices lost
    for th in (0.75, 0.9):
        det = StragglerDetector(StragglerConfig(threshold=th))
        for f in find_stragglers(recs, threshold=th) + feed_by_step(det, recs):
            assert f.steps >= 10 and f.last_step - f.first_step + 1 >= 10, f
            assert f.slowdown * th >= 1.0, f.describe()
            rows = [r for r in recs if f.first_step <= r.step <= f.last_step]
            med = lambda rs: float(np.median([r.compute for r in rs]))  # noqa: E731
            if f.kind == "straggler":
                mine = med([r for r in rows if r.rank == f.rank])
                fastest = min(
                    med([r for r in rows if r.rank == k]) for k in range(4) if k != f.rank
                )
                assert mine / fastest == pytest.approx(f.slowdown)


def test_a_candidate_failing_its_evidence_is_dropped() -> None:
    # Rank 2 is flagged by its windowed score (the fastest *other* rank in the window is rank 0,
    # fast only in steps 60-79) but over its slow stretch it is no slower than rank 0 there.
    recs = synthetic_records(200, 4, jitter=0.02, slow=[(0, 60, 79, 0.5), (2, 80, 99, 2.0)])
    cfg = StragglerConfig()
    assert cfg.supports(10, 1 / 0.75) and not cfg.supports(10, 1.3) and not cfg.supports(9, 2.0)
    assert not cfg.supports(10, math.nan)
    assert [f.rank for f in find_stragglers(recs)] == [2]


def test_being_slower_than_one_lucky_rank_is_not_straggling() -> None:
    # Rank 0 is unusually fast; ranks 1-3 are "2x slower than the fastest" but nobody waits for
    # one of them in particular.
    recs = synthetic_records(200, 4, jitter=0.1, slow=[(0, 0, 199, 0.5)], seed=15)
    assert np.nanmax(window_scores(recs, 20).relative[:, 1:]) < 0.75  # all candidates
    assert find_stragglers(recs) == []
    assert feed_by_step(StragglerDetector(), recs) == []


def test_a_rank_behind_the_real_straggler_is_not_reported() -> None:
    recs = synthetic_records(200, 8, slow=[(3, 40, 199, 3.0), (1, 40, 199, 1.6)], seed=16)
    assert [f.rank for f in find_stragglers(recs)] == [3]
    assert [f.rank for f in feed_by_step(StragglerDetector(), recs)] == [3]


def test_two_equally_slow_stragglers_are_both_found() -> None:
    recs = synthetic_records(200, 8, slow=[(2, 40, 199, 2.0), (5, 40, 199, 2.0)], seed=17)
    found = find_stragglers(recs)
    assert [(f.rank, f.first_step) for f in found] == [(2, 40), (5, 40)]
    assert all(0.3 < f.paced_steps / f.steps < 0.7 for f in found)  # they share the pace
    assert sorted(f.rank for f in feed_by_step(StragglerDetector(), recs)) == [2, 5]


def test_job_slowdown_obeys_the_same_rules() -> None:
    short = synthetic_records(150, 4, slow=[(None, 100, 112, 2.0)], seed=18)
    assert [f.kind for f in find_stragglers(short)] == ["slowdown"]
    assert find_stragglers(short, min_steps=14) == []


@pytest.mark.parametrize("kwargs", [{"warmup": -1}, {"warmup": 1.5}, {"min_steps": 0}])
def test_config_rejects_bad_rule_values(kwargs: dict[str, float]) -> None:
    with pytest.raises(UsageError, match=next(iter(kwargs))):
        StragglerConfig(**kwargs)  # type: ignore[arg-type]


def test_idle_caused_at_a_barrier_is_measured_over_the_whole_period() -> None:
    """Under local:4 a barrier's idle covers the 4 steps since the previous barrier; an interval
    that starts mid-period must not divide it by the wall of the few steps it happens to hold."""
    from gradsync.telemetry.records import StepRecord, fill_idle
    from gradsync.telemetry.scores import StepMatrix, pace_and_idle

    records = []
    for step in range(16):
        barrier = step % 4 == 3
        for rank in range(3):
            compute = 3.0 if rank == 2 else 1.0
            # at a barrier the fast ranks wait 4 x (3 - 1) = 8 s, plus 0.1 s of communication
            sync = (8.1 if rank != 2 else 0.1) if barrier else 0.0
            records.append(
                StepRecord(rank, step, 0.0, compute, sync, 0.0, 0.0, 4, 0, barrier=barrier)
            )
    m = StepMatrix.from_records(fill_idle(records))
    assert m.idle[15, 0] == pytest.approx(8.0)
    _, share = pace_and_idle(m, col=2, lo=14, hi=16)
    # one period of a fast rank: 3 local steps of 1 s, then 1 s + 8.1 s at the barrier
    assert share == pytest.approx(8.0 / 12.1)
