"""Simulation mechanics: hand-computable BSP, strategy equivalences, invariants."""

from __future__ import annotations

import math
import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from gradsync.errors import UsageError
from gradsync.sim import (
    AlphaBeta,
    CommModel,
    ComputeModel,
    Overlap,
    overlap_summary,
    parse_sim_strategy,
    simulate,
)
from gradsync.sim.report import bsp_summary

pytestmark = pytest.mark.unit

FIXED = CommModel(comm_ms=5.0)


def test_bsp_by_hand() -> None:
    c = np.array([[10.0, 20.0, 12.0], [30.0, 15.0, 15.0]])
    res = simulate("bsp", c, FIXED)
    assert res.step_ms is not None
    np.testing.assert_array_equal(res.step_ms, [25.0, 35.0])  # slowest + comm
    np.testing.assert_array_equal(res.idle_ms, [[10.0, 0.0, 8.0], [0.0, 15.0, 15.0]])
    assert res.wall_ms == 60.0
    summary = bsp_summary(res, mean_base_ms=17.0)
    assert summary["barrier_idle_ms"] == pytest.approx(60.0 - 17.0 * 2 - 5.0 * 2)
    assert summary["compute_split"] == pytest.approx([40 / 102, 35 / 102, 27 / 102])
    assert summary["barrier_tax"] == pytest.approx(48.0 / (3 * 60.0))


def test_jitter_is_drawn_step_by_step_then_worker_by_worker() -> None:
    model = ComputeModel(workers=3, steps=2, base_ms=(10.0, 20.0, 30.0), jitter_ms=2.0, seed=42)
    rng = random.Random(42)
    expected = [[b + rng.uniform(-2.0, 2.0) for b in (10.0, 20.0, 30.0)] for _ in range(2)]
    np.testing.assert_array_equal(model.draw(), expected)


def test_stragglers_and_transient_slowdowns() -> None:
    base = ComputeModel(workers=4, steps=3, base_ms=(10.0,), stragglers=((2, 3.0),))
    np.testing.assert_array_equal(base.draw()[:, 2], [30.0, 30.0, 30.0])
    always = ComputeModel(
        workers=4, steps=3, base_ms=(10.0,), transient_prob=1.0, transient_factor=2.0
    )
    np.testing.assert_array_equal(always.draw(), np.full((3, 4), 20.0))
    # Transient draws use their own stream, so turning them on never moves the jitter.
    jit = ComputeModel(workers=4, steps=50, base_ms=(10.0,), jitter_ms=1.0, seed=3)
    both = ComputeModel(
        workers=4,
        steps=50,
        base_ms=(10.0,),
        jitter_ms=1.0,
        seed=3,
        transient_prob=0.1,
        transient_factor=4.0,
    )
    a, b = jit.draw(), both.draw()
    hit = ~np.isclose(a, b)
    assert hit.any()
    np.testing.assert_allclose(b[hit], 4.0 * a[hit])


def _jittered(workers: int = 6, steps: int = 40, seed: int = 1) -> np.ndarray:
    model = ComputeModel(
        workers=workers,
        steps=steps,
        base_ms=(20.0, 22.0, 25.0),
        jitter_ms=6.0,
        transient_prob=0.05,
        transient_factor=3.0,
        seed=seed,
    )
    return model.draw()


def test_ssp_zero_equals_bsp() -> None:
    c = _jittered()
    bsp, ssp0 = simulate("bsp", c, FIXED), simulate("ssp:0", c, FIXED)
    assert ssp0.wall_ms == pytest.approx(bsp.wall_ms)
    np.testing.assert_allclose(ssp0.idle_per_worker, bsp.idle_per_worker)
    assert ssp0.staleness.max() == 0
    # and the per-step statistic the calibrated prediction reports is the same superstep
    np.testing.assert_allclose(ssp0.period_step_ms(), bsp.step_ms, rtol=1e-12)


def test_ssp_inf_equals_async() -> None:
    c = _jittered()
    inf, free = simulate("ssp:inf", c, FIXED), simulate("async", c, FIXED)
    assert inf.wall_ms == pytest.approx(free.wall_ms)
    np.testing.assert_allclose(inf.idle_ms, free.idle_ms, atol=1e-9)
    np.testing.assert_array_equal(inf.staleness, free.staleness)
    assert free.staleness.max() > 0


def test_staleness_respects_the_bound_and_loosening_it_never_slows() -> None:
    c = _jittered(steps=80)
    walls = []
    for s in (0, 1, 2, 4, 8):
        res = simulate(f"ssp:{s}", c, FIXED)
        assert res.staleness.max() <= s
        walls.append(res.wall_ms)
    assert all(a >= b - 1e-9 for a, b in zip(walls, walls[1:], strict=False))
    assert walls[0] > walls[-1]


def test_local_sgd_by_hand() -> None:
    c = np.array([[10.0, 5.0], [10.0, 5.0], [1.0, 9.0]])
    res = simulate("local:2", c, FIXED)
    # round 1: max(20, 10) + 5; round 2 (short, one step): max(1, 9) + 5
    assert res.wall_ms == 25.0 + 14.0
    np.testing.assert_array_equal(res.idle_per_worker, [8.0, 10.0])
    np.testing.assert_array_equal(res.comm_ms, [0.0, 5.0, 5.0])
    np.testing.assert_array_equal(res.staleness[:, 0], [0, 1, 0])
    assert simulate("diloco:2", c, FIXED).wall_ms == res.wall_ms


def test_period_step_is_the_pace_of_every_worker() -> None:
    c = np.array([[10.0, 20.0], [10.0, 20.0], [10.0, 20.0], [10.0, 20.0]])
    no_comm = CommModel(comm_ms=0.0)
    # Async: every worker has finished clock t when the slow one has, at 20 (t + 1).
    np.testing.assert_allclose(simulate("async", c, no_comm).period_step_ms(), [20.0] * 4)
    # local:2: rounds of max(20, 40) + 5 over 2 steps.
    np.testing.assert_allclose(simulate("local:2", c, FIXED).period_step_ms(), [22.5, 22.5])
    # local:3 on 4 steps: a round of 3 (60 + 5) / 3, then a short one (20 + 5) / 1.
    np.testing.assert_allclose(simulate("local:3", c, FIXED).period_step_ms(), [65 / 3, 25.0])


def test_throughput_while_all_train_shows_what_async_gains_from_not_waiting() -> None:
    # Two workers, 10 and 20 ms a step, 4 steps, no comm.
    c = np.array([[10.0, 20.0]] * 4)
    no_comm = CommModel(comm_ms=0.0)
    free = simulate("async", c, no_comm)
    # Every worker runs 4 steps: 8 worker-steps in 80 ms, whatever the strategy.
    assert free.throughput == pytest.approx(100.0)
    # Worker 0 finishes at 40 ms; by then it did 4 steps and worker 1 did 2: 6 in 40 ms.
    assert free.throughput_while_all_train == pytest.approx(150.0)
    # ssp:1: worker 0 runs 0-10, 10-20, 20-30, then waits for clock 1 (done at 40): 40-50.
    bounded = simulate("ssp:1", c, no_comm)
    assert bounded.throughput == pytest.approx(100.0)
    assert bounded.throughput_while_all_train == pytest.approx(6 / 0.050)
    bsp = simulate("bsp", c, no_comm)
    assert bsp.throughput_while_all_train == bsp.throughput == pytest.approx(100.0)


STRATEGIES = [
    "bsp",
    "ssp:0",
    "ssp:1",
    "ssp:3",
    "ssp:inf",
    "async",
    "local:1",
    "local:3",
    "diloco:4",
]


@settings(max_examples=25, deadline=None)
@given(
    workers=st.integers(1, 6),
    steps=st.integers(1, 12),
    jitter=st.floats(0, 30),
    comm=st.floats(0, 20),
    seed=st.integers(0, 1000),
    strategy=st.sampled_from(STRATEGIES),
)
# found by hypothesis: a subnormal comm time made the first step's end a subnormal number of
# ms, 0 once turned into seconds (a division by zero in the steady rate)
@example(workers=1, steps=1, jitter=7.0, comm=5e-324, seed=1, strategy="ssp:0")
def test_invariants(
    workers: int, steps: int, jitter: float, comm: float, seed: int, strategy: str
) -> None:
    c = ComputeModel(
        workers=workers, steps=steps, base_ms=(5.0, 15.0), jitter_ms=jitter, seed=seed
    ).draw()
    res = simulate(strategy, c, CommModel(comm_ms=comm))
    assert (res.idle_ms >= -1e-9).all()
    assert res.wall_ms >= c.sum(axis=0).max() - 1e-9
    # Every worker's time is compute, idle or unhidden comm; nothing else.
    np.testing.assert_allclose(
        c.sum(axis=0) + res.idle_per_worker + res.comm_ms.sum(), res.wall_ms, rtol=1e-9, atol=1e-9
    )
    assert (res.staleness >= 0).all()
    plain = simulate("bsp", c, CommModel(comm_ms=comm))
    over = simulate("bsp", c, CommModel(comm_ms=comm), overlap=Overlap(buckets=3))
    assert c.max(axis=1).sum() - 1e-9 <= over.wall_ms <= plain.wall_ms + 1e-9


def test_overlap_summary_by_hand() -> None:
    o = overlap_summary(200.0, CommModel(comm_ms=60.0), 4, Overlap(backward_frac=2 / 3))
    assert o["naive_step_ms"] == 260.0
    assert o["comm_share"] == pytest.approx(60 / 260)
    assert o["best_overlapped_step_ms"] == pytest.approx(200.0)
    assert o["best_residual_ms"] == pytest.approx(0.0)
    # Buckets of 15 ms ready at 100, 133.3, 166.7, 200: the last one ends at 215.
    assert o["bucketed_step_ms"] == pytest.approx(215.0)
    slow = overlap_summary(90.0, CommModel(comm_ms=100.0), 4, Overlap(backward_frac=2 / 3))
    assert slow["best_residual_ms"] == pytest.approx(100.0 - 60.0)


def test_alpha_beta_comm_grows_with_workers_and_shrinks_per_bucket() -> None:
    comm = CommModel(link=AlphaBeta(alpha=20e-6, beta=8e-10), nbytes=100 * 2**20)
    costs = [comm.exchange_ms(n) for n in (2, 8, 64, 1024)]
    assert costs == sorted(costs)
    assert comm.exchange_ms(1) == 0.0
    assert comm.exchange_ms(8, 0.25) < comm.exchange_ms(8)


def test_specs_parse_and_reject() -> None:
    assert parse_sim_strategy("ssp:inf").param == math.inf
    assert parse_sim_strategy("local:8").spec == "local:8"
    assert parse_sim_strategy(" BSP ").spec == "bsp"
    for bad in ("ssp", "ssp:-1", "local:0", "diloco:x", "async:2", "gossip"):
        with pytest.raises(UsageError, match="valid"):
            parse_sim_strategy(bad)
    with pytest.raises(UsageError, match="bsp and zero:1 only"):
        simulate("async", np.ones((2, 2)), FIXED, overlap=Overlap())


def test_config_validation_names_the_bad_value() -> None:
    with pytest.raises(UsageError, match="straggler rank 9"):
        ComputeModel(workers=4, steps=1, base_ms=(1.0,), stragglers=((9, 2.0),))
    with pytest.raises(UsageError, match="--jitter"):
        ComputeModel(workers=4, steps=1, base_ms=(1.0,), jitter_ms=-1.0)
    for bad in (math.nan, math.inf):
        with pytest.raises(UsageError, match="--jitter must be a finite number"):
            ComputeModel(workers=4, steps=1, base_ms=(1.0,), jitter_ms=bad)
        with pytest.raises(UsageError, match="straggler factor"):
            ComputeModel(workers=4, steps=1, base_ms=(1.0,), stragglers=((1, bad),))
        with pytest.raises(UsageError, match="transient factor"):
            ComputeModel(workers=4, steps=1, base_ms=(1.0,), transient_factor=bad)
        with pytest.raises(UsageError, match="message size"):
            CommModel(link=AlphaBeta(alpha=0.0, beta=1e-9), nbytes=bad)
    with pytest.raises(UsageError, match="either"):
        CommModel()
    with pytest.raises(UsageError, match="--buckets"):
        Overlap(buckets=0)
