"""Calibrated prediction: the step model, resampling modes, the measured all-reduce table."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from gradsync.errors import UsageError
from gradsync.sim import AlphaBeta, WhatIf, load_profile, predict, simulate
from gradsync.sim.calibrate import load_calibration_table
from gradsync.sim.config import CommModel
from gradsync.sim.table import CollectiveTable
from gradsync.telemetry.records import Span, StepRecord, fill_idle, write_records

pytestmark = pytest.mark.unit

LINK = AlphaBeta(alpha=0.0, beta=1e-9)


def _run(
    path: Path,
    compute: np.ndarray,
    *,
    collective_ms: float,
    overhead_ms: float,
    spans: bool = True,
    nbytes: int = 1_000_000,
    late_ms: tuple[float, ...] = (0.0, 0.0, 0.0, 0.0),
) -> Path:
    """A 4-rank BSP run: every rank waits for the slowest, then ``collective_ms`` of
    all-reduce, then ``overhead_ms`` (write-back, optimizer). Compute in ms, (steps, ranks).
    Rank r enters every step ``late_ms[r]`` late, so its step timer records that much less
    sync than a rank that was on time."""
    records, span_list = [], []
    t0 = 0.0
    for step, row in enumerate(compute):
        for rank, c in enumerate(row):
            records.append(
                StepRecord(
                    rank=rank,
                    step=step,
                    time=t0,
                    compute=c / 1000,
                    sync=0.0,
                    idle=0.0,
                    comm=0.0,
                    samples=8,
                    bytes=nbytes,
                )
            )
        slow_end = t0 + row.max() / 1000
        for rank, c in enumerate(row):
            span_list.append(Span(rank, step, "compute", t0, c / 1000))
            ar = Span(rank, step, "allreduce[0]", t0 + c / 1000, 0.0, "comm")
            ar.dur = slow_end + collective_ms / 1000 - ar.start
            span_list.append(ar)
        t0 = slow_end + (collective_ms + overhead_ms) / 1000
    records = fill_idle(records)
    for r in records:
        r.sync = r.idle + (collective_ms + overhead_ms - late_ms[r.rank]) / 1000
        r.comm = r.sync - r.idle
    path.mkdir()
    write_records(path / "metrics.jsonl", records, append=False)
    if spans:
        write_records(path / "spans.jsonl", span_list, append=False)
    (path / "config.json").write_text(json.dumps({"nproc": 4, "strategy": "bsp"}))
    return path


def _steady(steps: int = 40, slow_rank: int | None = None) -> np.ndarray:
    c = np.full((steps, 4), 10.0)
    if slow_rank is not None:
        c[:, slow_rank] = 20.0
    return c


def test_bsp_with_per_step_comm_adds_it_to_the_slowest_compute() -> None:
    c = np.array([[1.0, 3.0], [2.0, 2.0], [5.0, 1.0]])
    res = simulate("bsp", c, CommModel(comm_ms=0.0), comm_steps=np.array([1.0, 2.0, 0.5]))
    assert res.step_ms is not None
    np.testing.assert_allclose(res.step_ms, [4.0, 4.0, 5.5])
    for strategy in ("ssp:1", "async", "local:2"):
        free = simulate(strategy, c, CommModel(comm_ms=0.0), comm_steps=np.ones(3))
        total = free.compute_ms + free.idle_ms + free.comm_ms[:, None]
        np.testing.assert_allclose(total.sum(axis=0), free.wall_ms)
    with pytest.raises(UsageError, match="per-step comm"):
        simulate("bsp", c, CommModel(comm_ms=0.0), comm_steps=np.ones(2))


def test_profile_splits_comm_into_all_reduce_and_host_overhead(tmp_path: Path) -> None:
    prof = load_profile(_run(tmp_path / "r", _steady(), collective_ms=4.0, overhead_ms=2.0))
    assert prof.collective_steps is not None
    np.testing.assert_allclose(prof.collective_steps, 4.0, atol=1e-6)
    np.testing.assert_allclose(prof.comm_steps, 6.0, atol=1e-6)
    assert prof.measured_step_ms == pytest.approx(16.0)
    run_only = predict(prof, None)
    assert run_only.step_ms == pytest.approx(16.0)
    assert run_only.comm_source == "run telemetry + run overhead"
    # 1 MB on a 1 GB/s ring of 4 costs 1.5 ms; the 2 ms host overhead stays the run's.
    linked = predict(prof, LINK)
    assert linked.step_ms == pytest.approx(10.0 + 1.5 + 2.0)
    assert predict(prof, LINK, host_overhead=False).step_ms == pytest.approx(11.5)
    # Without spans the whole comm counts as the all-reduce.
    bare = load_profile(
        _run(tmp_path / "bare", _steady(), collective_ms=4.0, overhead_ms=2.0, spans=False)
    )
    assert bare.collective_steps is None
    assert predict(bare, LINK).step_ms == pytest.approx(11.5)


def test_whole_step_resampling_keeps_what_ranks_share(tmp_path: Path) -> None:
    # One step in three is slow on every rank at once (a shared hiccup): the slowest rank's
    # median is 10 ms. Drawn rank by rank, most steps would contain a slow draw.
    c = np.full((60, 4), 10.0)
    c[::3] = 30.0
    prof = load_profile(_run(tmp_path / "r", c, collective_ms=1.0, overhead_ms=0.0), warmup=0)
    assert prof.measured_step_ms == pytest.approx(11.0)
    assert predict(prof, None, resample="steps").step_ms == pytest.approx(11.0)
    assert predict(prof, None, resample="ranks").step_ms == pytest.approx(31.0)
    with pytest.raises(UsageError, match="resample"):
        predict(prof, None, resample="bogus")


def test_what_ifs_change_what_they_name(tmp_path: Path) -> None:
    prof = load_profile(
        _run(tmp_path / "r", _steady(slow_rank=2), collective_ms=4.0, overhead_ms=2.0)
    )
    assert prof.slowest_rank() == 2
    base = predict(prof, LINK)
    assert base.step_ms == pytest.approx(20.0 + 1.5 + 2.0)
    fixed = predict(prof, LINK, WhatIf(remove_straggler=True))
    assert fixed.step_ms == pytest.approx(10.0 + 1.5 + 2.0)
    assert fixed.barrier_tax == pytest.approx(0.0)
    squeezed = predict(prof, LINK, WhatIf(compression_ratio=4))
    assert squeezed.comm_ms == pytest.approx(1.5 / 4 + 2.0)
    wide = predict(prof, LINK, WhatIf(workers=8))
    assert wide.result.workers == 8
    assert wide.comm_ms == pytest.approx(1000 * LINK.time("allreduce", 8, 1e6) + 2.0)
    stale = predict(prof, LINK, WhatIf(strategy="ssp:2"))
    assert stale.result.strategy == "ssp:2"
    assert stale.step_ms < base.step_ms + 1e-9


def test_table_interpolates_measured_times_log_log() -> None:
    table = CollectiveTable(
        nproc=4,
        sizes=(1e3, 1e5),
        samples_s=((1e-3, 2e-3, 3e-3), (4e-3, 8e-3, 12e-3)),
        link=LINK,
    )
    assert table.median_s(1e3) == pytest.approx(2e-3)
    assert table.median_s(1e4) == pytest.approx(4e-3)  # halfway in log size: geometric mean
    assert table.median_s(10) == pytest.approx(2e-3)  # the latency floor
    big = LINK.time("allreduce", 4, 1e7) / LINK.time("allreduce", 4, 1e5)
    assert table.median_s(1e7) == pytest.approx(8e-3 * big)
    eight = LINK.time("allreduce", 8, 1e3) / LINK.time("allreduce", 4, 1e3)
    assert table.median_s(1e3, workers=8) == pytest.approx(2e-3 * eight)
    draws = table.sample_s(1e5, 500, np.random.default_rng(0))
    assert set(np.round(draws, 6)) <= {0.004, 0.008, 0.012}
    with pytest.raises(UsageError):
        CollectiveTable(nproc=4, sizes=(2.0, 1.0), samples_s=((1.0,), (1.0,)), link=LINK)


def test_prediction_draws_the_all_reduce_from_the_calibration_repeats(tmp_path: Path) -> None:
    prof = load_profile(_run(tmp_path / "r", _steady(), collective_ms=4.0, overhead_ms=2.0))
    cal = tmp_path / "cal.json"
    cal.write_text(
        json.dumps(
            {
                "kind": "gradsync.allreduce_calibration",
                "nproc": 4,
                "alpha_s": 0.0,
                "beta_s_per_byte": 1e-9,
                "measurements": [
                    {"bytes": 1_000_000, "time_s": 0.003, "samples_s": [0.002, 0.003, 0.004]},
                    {"bytes": 4_000_000, "time_s": 0.009},
                ],
            }
        )
    )
    table = load_calibration_table(cal)
    assert table is not None and table.sizes == (1e6, 4e6)
    pred = predict(prof, LINK, table=table)
    assert pred.comm_source == "calibration (measured repeats) + run overhead"
    assert pred.step_ms == pytest.approx(10.0 + 3.0 + 2.0)


def test_predicted_tax_counts_worker_time_as_the_telemetry_does(tmp_path: Path) -> None:
    # Ranks 1-3 enter each step 1, 2, 3 ms late: the telemetry's worker-time (each rank's
    # compute + sync) leaves that out, so the tax divides by 4 x (20 + 6) - 6 per step.
    late = (0.0, 1.0, 2.0, 3.0)
    prof = load_profile(
        _run(
            tmp_path / "r",
            _steady(slow_rank=2),
            collective_ms=4.0,
            overhead_ms=2.0,
            late_ms=late,
        )
    )
    assert prof.measured_barrier_tax == pytest.approx(30.0 / (4 * 26.0 - 6.0))
    assert prof.measured_step_ms == pytest.approx(26.0)
    pred = predict(prof, None)
    assert pred.step_ms == pytest.approx(26.0)  # the step still pays the slowest rank's comm
    assert pred.barrier_tax == pytest.approx(prof.measured_barrier_tax)
    # Without the run's host overhead there is no record of who was late either.
    bare = predict(prof, None, host_overhead=False)
    assert bare.barrier_tax == pytest.approx(30.0 / (4 * 24.0))


def test_a_run_under_bucket_mb_auto_is_modelled_with_the_plan_it_kept(tmp_path: Path) -> None:
    from gradsync.sim.calibrate import _planned_bucket_mb

    assert _planned_bucket_mb(tmp_path, None) is None
    assert _planned_bucket_mb(tmp_path, 4) == 4.0
    assert _planned_bucket_mb(tmp_path, "auto") is None  # no report: the default plan
    (tmp_path / "report.json").write_text('{"strategy_summary": {"bucket_mb": 1.0}}')
    assert _planned_bucket_mb(tmp_path, "auto") == 1.0


def _ps_run(
    path: Path,
    strategy: str,
    compute: np.ndarray,
    comm: np.ndarray,
    held: np.ndarray | None = None,
) -> Path:
    """A parameter-server run's records: rank k computes ``compute[t, k]``, exchanges
    ``comm[t, k]`` (its push and pull), then waits ``held[t, k]`` for the server's reply
    (idle, the staleness bound), back to back: no barrier, each rank at its own pace (ms)."""
    held = np.zeros_like(comm) if held is None else held
    records = []
    for k in range(compute.shape[1]):
        start = 0.0
        for t, (c, x, h) in enumerate(zip(compute[:, k], comm[:, k], held[:, k], strict=True)):
            records.append(
                StepRecord(
                    rank=k,
                    step=t,
                    time=start / 1000,
                    compute=c / 1000,
                    sync=(x + h) / 1000,
                    idle=h / 1000,
                    comm=x / 1000,
                    samples=8,
                    bytes=1000,
                )
            )
            start += c + x + h
    path.mkdir()
    write_records(path / "metrics.jsonl", records, append=False)
    (path / "config.json").write_text(json.dumps({"nproc": compute.shape[1], "strategy": strategy}))
    return path


def _held_by_ssp(compute: np.ndarray, comm: np.ndarray, s: int) -> np.ndarray:
    """What the server holds each reply under ssp:s: clock t starts once every worker has
    finished clock t-s-1 (ps_server.allowed), the wait closing step t-1 (ms)."""
    held = np.zeros_like(comm)
    end = np.zeros_like(comm)
    ready = np.zeros(comm.shape[1])
    for t in range(comm.shape[0]):
        start = np.maximum(ready, end[t - s - 1].max() if t > s else 0.0)
        if t:
            held[t - 1] = start - ready
        end[t] = ready = start + compute[t] + comm[t]
    return held


def test_an_ssp_run_is_measured_and_predicted_by_its_pace(tmp_path: Path) -> None:
    """Under ssp:S ranks are not at the same step at the same moment: the slowest rank's
    compute + sync at a step is the longest of four ranks' steps, not the pace of the run, and
    a worker waits for its own push and pull, not for the slowest rank's. Measured as the
    slowest rank's step and predicted with the slowest rank's comm charged to every worker, a
    4-worker ssp:1 run read 16% low (a tester saw 19.5% on a real one)."""
    rng = np.random.default_rng(3)
    compute = rng.gamma(4.0, 15.0, size=(200, 4))
    comm = rng.gamma(3.0, 8.0, size=(200, 4))
    held = _held_by_ssp(compute, comm, 1)
    prof = load_profile(_ps_run(tmp_path / "ssp", "ssp:1", compute, comm, held))
    # the median over clocks of the time from every rank having finished one to the next,
    # the statistic predict reports
    done = np.maximum.accumulate((compute + comm + held).cumsum(axis=0).max(axis=1))
    assert prof.measured_step_ms == pytest.approx(float(np.median(np.diff(done)[1:])))
    longest = float(np.median((compute + comm + held)[2:].max(axis=1)))
    assert longest > 1.3 * prof.measured_step_ms  # what it measured before
    pred = predict(prof, None)
    assert pred.comm_source == "run telemetry (each worker's own)"
    assert pred.step_ms == pytest.approx(prof.measured_step_ms, rel=0.02)
    pace = float(done[-1]) / 200  # the run's wall-clock per step
    assert pred.mean_step_ms == pytest.approx(pace, rel=0.03)
    assert pred.barrier_tax == pytest.approx(prof.measured_barrier_tax, abs=0.02)
    # A barrier strategy keeps the slowest rank's step, which is its superstep.
    bsp = load_profile(_ps_run(tmp_path / "bsp", "bsp", compute, comm, held))
    assert bsp.measured_step_ms == pytest.approx(longest)


def test_each_parameter_server_worker_pays_its_own_exchange(tmp_path: Path) -> None:
    # Rank 0's push and pull take 2 ms, rank 1's 10 ms: under ssp:1 rank 0 waits 8 ms a step
    # at the bound, a barrier tax of 8 / (2 x 20), which charging both 10 ms would hide.
    compute = np.full((40, 2), 10.0)
    comm = np.tile([2.0, 10.0], (40, 1))
    held = _held_by_ssp(compute, comm, 1)
    prof = load_profile(_ps_run(tmp_path / "r", "ssp:1", compute, comm, held), warmup=4)
    assert prof.measured_barrier_tax == pytest.approx(0.2, abs=0.01)
    pred = predict(prof, None)
    assert pred.step_ms == pytest.approx(20.0)
    assert pred.barrier_tax == pytest.approx(0.2, abs=0.01)
    res = simulate("ssp:1", compute, CommModel(comm_ms=0.0), comm_steps=comm)
    np.testing.assert_allclose(res.comm_ms, 6.0)  # the workers' mean
    total = res.compute_ms.sum() + res.idle_ms.sum() + comm.sum()
    assert total == pytest.approx(2 * res.wall_ms)  # every worker's time, accounted for
    with pytest.raises(UsageError, match="per-step comm"):
        simulate("bsp", compute, CommModel(comm_ms=0.0), comm_steps=comm)


def _local_run(
    path: Path, strategy: str, h: int, *, steps: int = 40, exchange_ms: float, local_ms: float
) -> Path:
    """A 4-rank ``local:H`` (or ``diloco:H``) run of 10 ms steps: every H-th step all-reduces
    1 MB (``exchange_ms`` of comm), the others send nothing and pay ``local_ms`` (ms)."""
    records = []
    t0 = 0.0
    for step in range(steps):
        exchange = (step + 1) % h == 0
        comm = (exchange_ms if exchange else local_ms) / 1000
        for rank in range(4):
            records.append(
                StepRecord(
                    rank=rank,
                    step=step,
                    time=t0,
                    compute=0.010,
                    sync=comm,
                    idle=0.0,
                    comm=comm,
                    samples=8,
                    bytes=1_000_000 if exchange else 0,
                )
            )
        t0 += 0.010 + comm
    path.mkdir()
    write_records(path / "metrics.jsonl", records, append=False)
    (path / "config.json").write_text(json.dumps({"nproc": 4, "strategy": strategy}))
    return path


@pytest.mark.parametrize("strategy", ["local:4", "diloco:4"])
def test_a_periodic_run_is_priced_by_what_an_exchange_sends(tmp_path: Path, strategy: str) -> None:
    """local:H and diloco:H send every H-th step only: the median of the bytes per step was 0,
    so a calibrated prediction priced no exchange at all, and the run's own comm was drawn
    from steps at random, mostly local ones (a tester's runs read 14-35% off)."""
    prof = load_profile(
        _local_run(tmp_path / "r", strategy, 4, exchange_ms=4.0, local_ms=0.5), warmup=3
    )
    assert prof.exchange_bytes == 1_000_000
    assert prof.bytes_per_step == pytest.approx(250_000)
    assert prof.period == 4
    # a round: four 10 ms steps, three local steps' 0.5 ms and one 4 ms exchange, over 4 steps
    round_ms = (40.0 + 1.5 + 4.0) / 4
    assert prof.measured_step_ms == pytest.approx(round_ms)
    assert predict(prof, None).step_ms == pytest.approx(round_ms)
    # 1 MB on a 1 GB/s ring of 4 costs 1.5 ms, once a round
    assert predict(prof, LINK).step_ms == pytest.approx((40.0 + 1.5 + 1.5) / 4)
    # what-ifs built on it: ssp:2 and bsp exchange every step, each as the run's exchange did
    stale = predict(prof, LINK, WhatIf(strategy="ssp:2"))
    assert stale.step_ms == pytest.approx(10.0 + 1.5)
    assert predict(prof, None, WhatIf(strategy="bsp")).step_ms == pytest.approx(10.0 + 4.0)
    assert predict(prof, None, WhatIf(strategy="local:8")).step_ms == pytest.approx(
        (80.0 + 7 * 0.5 + 4.0) / 8
    )


def _free_run(
    path: Path, strategy: str, compute: np.ndarray, comm: np.ndarray, between: np.ndarray
) -> Path:
    """A run without a barrier: rank k computes ``compute[t, k]``, then its own update or
    exchange ``comm[t, k]`` (no idle), then spends ``between[t, k]`` outside its step timer
    (the script's own code) before its next step (ms)."""
    records = []
    for k in range(compute.shape[1]):
        start = 0.0
        for t in range(compute.shape[0]):
            c, x = compute[t, k], comm[t, k]
            records.append(StepRecord(k, t, start / 1000, c / 1000, x / 1000, 0.0, x / 1000, 8, 0))
            start += c + x + between[t, k]
    path.mkdir()
    write_records(path / "metrics.jsonl", records, append=False)
    (path / "config.json").write_text(json.dumps({"nproc": compute.shape[1], "strategy": strategy}))
    return path


@pytest.mark.parametrize("strategy", ["hogwild", "async"])
def test_a_run_without_a_barrier_is_predicted_without_one(tmp_path: Path, strategy: str) -> None:
    """Rank 0 takes 10 + 3 + 2 ms a step, rank 1 15 + 5 + 4: the run goes at rank 1's pace,
    24 ms, and nobody waits (tax 0). Hogwild's update (its comm) and both strategies' time
    between steps were not charged: a hogwild prediction was the compute alone (15 ms, -38%;
    a tester's run: -84%); and the fast worker's wait for the slow one after its last step,
    in no step record, was counted as barrier tax (here 17%, a tester's hogwild run 10.5%)."""
    rng = np.random.default_rng(5)
    steps = 200
    compute = np.column_stack([np.full(steps, 10.0), np.full(steps, 15.0)])
    compute *= rng.uniform(0.95, 1.05, size=compute.shape)
    comm = np.tile([3.0, 5.0], (steps, 1))
    between = np.tile([2.0, 4.0], (steps, 1))
    prof = load_profile(_free_run(tmp_path / "r", strategy, compute, comm, between))
    assert prof.measured_barrier_tax == 0.0
    assert prof.measured_step_ms == pytest.approx(24.0, rel=0.03)
    pred = predict(prof, None)
    assert pred.step_ms == pytest.approx(prof.measured_step_ms, rel=0.03)
    assert pred.mean_step_ms == pytest.approx(24.0, rel=0.03)
    assert pred.barrier_tax == pytest.approx(0.0, abs=1e-9)
    if strategy == "hogwild":
        assert pred.comm_source == "run telemetry (each worker's own update; no exchange)"
        # as bsp, the fast worker waits for the slow one at every step: a barrier tax
        alt = predict(prof, None, WhatIf(strategy="bsp"))
        assert alt.step_ms == pytest.approx(pred.step_ms, rel=0.03) and alt.barrier_tax > 0.1
