"""Straggler detection on synthetic BSP runs: planted stragglers found, noise left alone."""

from __future__ import annotations

import json
import math
import random
import re
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from gradsync.errors import UsageError
from gradsync.telemetry.cli import analyze_run
from gradsync.telemetry.records import METRICS_FILE, StepRecord, fill_idle, write_records
from gradsync.telemetry.scores import StepMatrix
from gradsync.telemetry.stragglers import (
    Finding,
    StragglerConfig,
    StragglerDetector,
    find_stragglers,
    rank_scores,
    runs,
    synthetic_records,
    window_scores,
)

pytestmark = pytest.mark.unit


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


def test_idle_measured_without_a_barrier_is_charged_to_the_rank_waited_for() -> None:
    """gossip:2 on 2 ranks: rank 1 computes 3 s a step, rank 0 1 s, so at each round (every
    other step) rank 0 waits 4 s for it, which the strategy measured (no barrier). Before, idle
    was charged only at barriers: the finding said 0% caused."""
    from gradsync.telemetry.records import StepRecord, fill_idle
    from gradsync.telemetry.scores import StepMatrix, pace_and_idle

    records = []
    for step in range(8):
        wait = 4.0 if step % 2 == 1 else 0.0
        for rank, compute in ((0, 1.0), (1, 3.0)):
            idle = wait if rank == 0 else 0.0
            sync = idle + (0.1 if wait else 0.0)
            records.append(
                StepRecord(rank, step, 0.0, compute, sync, idle, 0.0, 4, 0, barrier=False)
            )
    m = StepMatrix.from_records(fill_idle(records))
    _, share = pace_and_idle(m, col=1, lo=0, hi=8)
    # rank 0 over 8 steps: 8 s of compute, 4 rounds of 4.1 s; 16 s of it idle
    assert share == pytest.approx(16.0 / (8.0 + 4 * 4.1))
    _, none = pace_and_idle(m, col=0, lo=0, hi=8)  # rank 0 held no one back
    assert none == 0.0


# Half the ranks or fewer straggling is not a job-wide slowdown (the job's pace is the lower
# median of the ranks' compute), and intervals start where the rank slowed.


@pytest.mark.parametrize(
    ("world", "slow", "expected"),
    [
        (2, [1], [("straggler", 1)]),  # the plain median of two ranks is their mean
        (4, [1, 2], [("straggler", 1), ("straggler", 2)]),
        (4, [0, 1, 2], [("slowdown", None)]),  # more than half: the job slowed
    ],
)
def test_job_wide_slowdown_needs_more_than_half_the_ranks(
    world: int, slow: list[int], expected: list[tuple[str, int | None]]
) -> None:
    recs = synthetic_records(200, world, slow=[(r, 40, 199, 2.0) for r in slow], seed=19)
    found = find_stragglers(recs)
    assert [(f.kind, f.rank) for f in found] == expected, [f.describe() for f in found]
    assert all((f.first_step, f.last_step) == (40, 199) for f in found)
    live = feed_by_step(StragglerDetector(), recs)
    assert sorted((f.kind, f.rank or -1) for f in live) == sorted((k, r or -1) for k, r in expected)


@pytest.mark.parametrize("world", [2, 8])
def test_interval_starts_where_the_rank_slowed_not_where_the_machine_changed(world: int) -> None:
    # Before step 40 every rank computes 2x longer (contention); from step 40 the others are
    # back to normal and rank 1 is not. Against the others' median over the whole stretch, its
    # steps before 40 would look slow too; at each step they were not slower than the others.
    recs = synthetic_records(
        200, world, slow=[(None, 0, 39, 2.0), (1, 40, 199, 2.0)], jitter=0.1, seed=20
    )
    (f,) = find_stragglers(recs)
    assert f.rank == 1 and abs(f.first_step - 40) <= 2 and f.last_step >= 197, f.describe()
    (live,) = feed_by_step(StragglerDetector(), recs)
    assert live.rank == 1 and abs(live.first_step - 40) <= 2, live.describe()


def balanced_records(
    steps: int,
    sizes: Callable[[int], list[int]],
    speed: Callable[[int, int], float],
    *,
    fixed: float = 0.0,
    per_sample: float = 0.01,
    jitter: float = 0.05,
    seed: int = 0,
) -> list[StepRecord]:
    """A BSP run under load balancing: rank r takes sizes(step)[r] samples and computes
    (fixed + per_sample * samples) / speed(step, r), jittered."""
    rng = np.random.default_rng(seed)
    out: list[StepRecord] = []
    for s in range(steps):
        n = sizes(s)
        c = [
            (fixed + per_sample * n[r]) / speed(s, r) * rng.uniform(1 - jitter, 1 + jitter)
            for r in range(len(n))
        ]
        for r in range(len(n)):
            idle = max(c) - c[r]
            out.append(StepRecord(r, s, float(s), c[r], idle + 0.001, idle, 0.001, n[r], 0))
    return out


def test_a_rank_overloaded_by_balancing_is_not_a_straggler() -> None:
    # Speeds are equal, but the balancer still gives rank 0 29 of 32 samples (it lags behind a
    # slowdown of rank 1 that ended): rank 0 computes longest at every step, per sample it
    # is as fast as rank 1.
    recs = balanced_records(
        150, lambda s: [16, 16] if s < 30 else [29, 3], lambda s, r: 1.0, fixed=0.02
    )
    assert find_stragglers(recs) == []
    assert feed_by_step(StragglerDetector(), recs) == []


def test_a_balanced_straggler_is_reported_until_balancing_took_over() -> None:
    # Rank 1 is 3x slower from step 40; from step 60 it takes a quarter of the samples, and
    # both ranks compute equally long. Nobody waits any more, and the steps, though 1.5x as
    # long as before for both ranks, are not a job-wide slowdown: per sample rank 0 is as fast
    # as ever.
    recs = balanced_records(
        200,
        lambda s: [16, 16] if s < 60 else [24, 8],
        lambda s, r: 1 / 3 if (r == 1 and s >= 40) else 1.0,
    )
    found = find_stragglers(recs)
    assert [(f.kind, f.rank, f.first_step) for f in found] == [("straggler", 1, 40)]
    assert 59 <= found[0].last_step <= 62
    assert found[0].slowdown == pytest.approx(3.0, rel=0.1)
    assert [(f.kind, f.rank) for f in feed_by_step(StragglerDetector(), recs)] == [("straggler", 1)]


def test_a_straggler_balancing_cannot_fix_is_judged_per_step() -> None:
    # A fixed cost dominates the step, so even at 1 sample of 32 rank 1 (3x slower) sets the
    # pace. Per sample it looks 16 times slower again; the finding gives the time it costs.
    recs = balanced_records(
        200,
        lambda s: [16, 16] if s < 60 else [31, 1],
        lambda s, r: 1 / 3 if (r == 1 and s >= 40) else 1.0,
        fixed=0.1,
        per_sample=0.001,
    )
    (f,) = find_stragglers(recs)
    assert (f.rank, f.first_step, f.last_step) == (1, 40, 199)
    ratio_after = 3 * (0.1 + 0.001) / (0.1 + 0.031)  # per step, at 31 to 1 samples
    assert 2.0 < ratio_after < f.slowdown < 3.0  # between the balanced and unbalanced ratios
    assert f.share == pytest.approx((20 * 16 + 140 * 1) / 160 / 16, rel=0.01)
    assert "(with 0.18x an even share of the samples)" in f.describe()


def test_rank_scores_give_each_ranks_last_and_lowest_scores(tmp_path: Path) -> None:
    recs = synthetic_records(200, 4, jitter=0.05, slow=[(3, 100, 159, 2.0)], seed=21)
    scores = {s.rank: s for s in rank_scores(recs)}
    assert sorted(scores) == [0, 1, 2, 3]
    slow = scores[3]
    assert slow.lowest_relative == pytest.approx(0.5, abs=0.05)
    assert slow.lowest_individual == pytest.approx(0.5, abs=0.05)
    # the lowest window lies inside the slow stretch (window of 20 ending at its step)
    assert 119 <= slow.lowest_relative_step <= 159  # type: ignore[operator]
    assert slow.relative == pytest.approx(1.0, abs=0.1)  # recovered by the last window
    for r in (0, 1, 2):
        assert scores[r].lowest_relative > 0.9 and scores[r].lowest_individual > 0.9  # type: ignore[operator]
    # Too short a run: no window after warm-up, no scores (None, not NaN, for JSON).
    (short,) = rank_scores(synthetic_records(25, 1))
    assert short.relative is None and short.lowest_individual_step is None
    # `gradsync report --json` and the text summary carry them.
    run = tmp_path / "run"
    run.mkdir()
    write_records(run / METRICS_FILE, recs)
    analysis = analyze_run(run, plots=False)
    data = json.loads(json.dumps(analysis.to_dict()))
    assert data["scores"][3]["lowest_relative"] == pytest.approx(slow.lowest_relative)
    assert data["scores"][3]["lowest_relative_step"] == slow.lowest_relative_step
    text = analysis.format()
    assert "scores (window 20 steps;" in text
    low = f"{slow.lowest_relative:.2f} \\({slow.lowest_relative_step}\\)"
    row = rf"\n +3 +{slow.relative:.2f} +{low} "
    assert re.search(row, text), text


# Compute (ms) of a recorded `gradsync compare ... --slow 3:2 --steps 40` bsp run: charlm, 4 ranks
# on a loaded 2-core host. Rank 3 sleeps as long as it computed; the others contend for the
# cores, one of them (a different one from step to step) gets a core alone. Rank 3 set the pace
# at most steps, 2x the fastest other rank, but only about 1.3x the typical one.
SLOWED_ON_A_LOADED_HOST = [
    [44.7, 41.5, 47.9, 47.6], [19.0, 24.5, 28.5, 65.6], [27.3, 17.4, 30.3, 41.7],
    [29.5, 16.4, 29.7, 49.2], [20.8, 45.6, 39.7, 53.4], [30.4, 18.8, 24.8, 42.2],
    [17.2, 37.6, 39.8, 33.9], [17.8, 30.1, 35.9, 34.2], [18.6, 29.3, 32.0, 40.3],
    [23.6, 31.1, 27.5, 40.7], [18.8, 32.3, 24.8, 35.3], [36.9, 32.2, 19.2, 35.6],
    [35.1, 31.3, 23.8, 38.3], [33.9, 36.5, 41.5, 53.2], [17.1, 27.0, 24.6, 46.2],
    [34.6, 34.2, 25.6, 34.6], [34.1, 32.8, 19.9, 35.6], [33.4, 33.9, 18.2, 33.7],
    [36.7, 31.6, 19.7, 40.1], [29.9, 34.1, 15.9, 42.2], [30.7, 32.7, 18.6, 43.1],
    [36.0, 23.8, 16.6, 43.0], [45.7, 32.0, 16.6, 35.2], [17.9, 32.7, 33.0, 33.7],
    [18.2, 32.8, 32.4, 38.4], [17.5, 29.5, 31.9, 38.2], [41.7, 56.8, 55.7, 67.1],
    [26.2, 26.7, 18.1, 66.1], [17.2, 26.7, 28.6, 37.7], [32.6, 17.4, 26.8, 41.2],
    [21.4, 35.8, 35.7, 40.6], [17.5, 29.9, 30.6, 41.5], [24.8, 33.3, 33.0, 40.1],
    [17.6, 30.3, 26.5, 44.7], [25.8, 28.8, 17.4, 39.2], [17.9, 33.5, 33.7, 33.6],
    [16.9, 38.1, 27.7, 43.2], [17.7, 33.3, 32.8, 41.0], [16.6, 30.2, 34.7, 35.1],
    [34.0, 17.5, 26.7, 41.1],
]  # fmt: skip


def records_from_compute(compute_ms: list[list[float]], comm: float = 0.005) -> list[StepRecord]:
    out = []
    for step, row in enumerate(compute_ms):
        c = [x / 1000 for x in row]
        for rank, mine in enumerate(c):
            idle = max(c) - mine
            out.append(StepRecord(rank, step, float(step), mine, idle + comm, idle, comm, 16, 0))
    return out


def test_a_slowed_rank_on_a_loaded_host_is_found() -> None:
    """Before, a step counted as slow only at 1.33x the typical other rank: rank 3 was so at
    about half of its steps, the other half broke its stretch into pieces shorter than half a
    window, and the report said "none" although rank 3 set the pace in 35 of 40 steps. A step
    where it set the pace at 1.33x the fastest other rank no longer breaks the stretch."""
    recs = records_from_compute(SLOWED_ON_A_LOADED_HOST)
    m = StepMatrix.from_records(recs).rows(10)
    typical = np.median(m.compute[:, :3], axis=1)
    assert 0.3 < np.mean(m.compute[:, 3] * 0.75 >= typical) < 0.6  # the pieces that were left
    (f,) = find_stragglers(recs)
    assert (f.kind, f.rank) == ("straggler", 3)
    assert f.first_step <= 20 and f.last_step == 39 and f.paced_steps >= 0.8 * f.steps
    assert 1.5 < f.slowdown < 2.2
    assert [(f.rank, f.ongoing) for f in feed_by_step(StragglerDetector(), recs)] == [(3, True)]


# Another run of the same command (`gradsync run --slow 3:2 --steps 40`, 4 ranks, 2 cores):
# from step 19 rank 2 had a core to itself and computed 16 ms a step, the others 35-70 ms.
LUCKY_RANK_AND_A_STRAGGLER = [
    [70.6, 47.1, 54.2, 23.4], [48.1, 18.1, 44.9, 40.0], [50.0, 21.6, 49.2, 44.8],
    [44.8, 20.6, 53.4, 44.3], [61.1, 32.8, 51.4, 73.1], [46.1, 51.4, 55.0, 84.8],
    [38.7, 22.0, 36.0, 48.8], [58.9, 67.9, 59.7, 65.8], [18.8, 28.2, 32.9, 62.6],
    [43.1, 45.2, 63.8, 52.3], [60.2, 61.6, 53.4, 57.7], [45.8, 26.0, 18.7, 51.1],
    [43.7, 35.9, 40.0, 46.9], [62.3, 67.8, 63.9, 75.9], [48.3, 51.4, 48.6, 69.2],
    [64.6, 70.2, 65.2, 62.3], [59.0, 56.6, 58.8, 66.3], [47.1, 47.5, 43.1, 57.6],
    [61.5, 57.0, 59.4, 78.5], [34.8, 32.8, 16.3, 55.0], [38.5, 47.8, 16.9, 47.8],
    [29.9, 33.9, 15.8, 44.4], [69.3, 69.6, 15.3, 75.3], [36.3, 32.7, 15.6, 72.9],
    [43.1, 45.6, 15.8, 42.7], [36.6, 39.3, 16.2, 47.9], [44.2, 52.4, 18.6, 53.0],
    [34.1, 40.1, 16.3, 47.6], [48.3, 45.0, 16.0, 50.6], [41.2, 37.5, 15.8, 48.0],
    [51.1, 43.8, 19.3, 62.3], [18.0, 31.7, 29.9, 57.4], [15.7, 44.5, 41.1, 50.6],
    [16.1, 35.3, 29.1, 47.8], [33.0, 37.9, 17.4, 44.4], [33.9, 37.2, 19.2, 69.1],
    [37.5, 39.9, 15.9, 54.5], [61.7, 63.7, 24.5, 35.9], [41.9, 49.3, 15.9, 53.3],
    [35.1, 38.9, 20.6, 49.8],
]  # fmt: skip


def test_a_straggler_beside_a_lucky_rank_is_found() -> None:
    """Three ranks are "slower than the fastest" (the lucky rank 2), so rule 4 took the fastest
    for the odd one and reported nobody, although rank 3 set the pace at 17-18 of every 20
    steps, where chance among three equally slow ranks gives about 7. A pace share that chance
    gives with probability at most 1e-5 still counts; three ranks taking turns do not
    (test_being_slower_than_one_lucky_rank_is_not_straggling)."""
    from gradsync.telemetry.stragglers import _paces_beyond_chance

    recs = records_from_compute(LUCKY_RANK_AND_A_STRAGGLER)
    window = window_scores(StepMatrix.from_records(recs).rows(10), 20)
    assert np.all(np.sum(window.relative < 0.75, axis=1) == 3)  # most ranks are candidates
    (f,) = find_stragglers(recs)
    assert (f.kind, f.rank, f.last_step) == ("straggler", 3, 36) and f.first_step <= 21
    assert f.paced_steps >= 0.8 * f.steps
    assert [f.rank for f in feed_by_step(StragglerDetector(), recs)] == [3]
    # the line: 17 of 20 among 3 is beyond chance, 16 is not; among 2 only all 20 are
    assert _paces_beyond_chance(17 / 20, 3, 20) and not _paces_beyond_chance(16 / 20, 3, 20)
    assert _paces_beyond_chance(20 / 20, 2, 20) and not _paces_beyond_chance(19 / 20, 2, 20)
