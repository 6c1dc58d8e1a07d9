"""The simulator's ZeRO stages priced with the alpha-beta model.

``zero:1`` = bsp's all-reduce + one all-gather of the parameters; ``zero:2`` = one
reduce-scatter + the same all-gather; ``zero:3`` = one reduce-scatter + two all-gathers (before
the forward and the backward pass) (docs/simulator.md). Ring costs are written out by hand
here, not taken from ``gradsync.sim.model``, so a wrong formula there is caught too.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

import numpy as np
import pytest

from gradsync.errors import UsageError
from gradsync.sim import CommModel, ComputeModel, SimStrategy, WhatIf, parse_sim_strategy, simulate
from gradsync.sim.cli import add_parsers
from gradsync.sim.model import AlphaBeta, collective_time
from gradsync.sim.simulate import Overlap

pytestmark = pytest.mark.unit

ALPHA = 20e-6  # s
SLOW_BETA = 8.0 / 1e9  # 1 Gbit/s, s/byte
NBYTES = 100 * 2**20  # gradient = parameters, bytes


def _ring_half_ms(n: int, alpha: float, beta: float, nbytes: float) -> float:
    """A ring reduce-scatter or all-gather, by hand: (n-1) alpha + (n-1)/n S beta, in ms."""
    return 1000.0 * ((n - 1) * alpha + (n - 1) / n * nbytes * beta)


def _compute(workers: int, steps: int = 30) -> np.ndarray:
    return ComputeModel(
        workers=workers,
        steps=steps,
        base_ms=(20.0,),
        jitter_ms=4.0,
        stragglers=((workers - 1, 1.5),),
        seed=3,
    ).draw()


def _link(algorithm: str = "ring", beta: float = SLOW_BETA) -> CommModel:
    return CommModel(link=AlphaBeta(alpha=ALPHA, beta=beta, algorithm=algorithm), nbytes=NBYTES)


@pytest.mark.parametrize("n", [2, 4, 7, 64])
def test_zero2_comm_is_reduce_scatter_plus_all_gather(n: int) -> None:
    c = _compute(n)
    res = simulate("zero:2", c, _link())
    expected = 2 * _ring_half_ms(n, ALPHA, SLOW_BETA, NBYTES)
    np.testing.assert_allclose(res.comm_ms, expected, rtol=1e-12)
    assert res.step_ms is not None
    np.testing.assert_allclose(res.step_ms, c.max(axis=1) + expected, rtol=1e-12)
    # Every worker: compute + idle + unhidden comm = wall-clock; the barrier ends every step.
    np.testing.assert_allclose(
        res.compute_ms.sum(0) + res.idle_ms.sum(0) + res.comm_ms.sum(), res.wall_ms
    )
    assert res.strategy == "zero:2" and not res.staleness.any()


@pytest.mark.parametrize("algorithm", ["ring", "rhd", "tree"])
@pytest.mark.parametrize("n", [2, 8, 64])
def test_zero1_costs_one_all_gather_more_than_bsp(algorithm: str, n: int) -> None:
    c = _compute(n)
    comm = _link(algorithm)
    gather = 1000.0 * collective_time("allgather", n, NBYTES, ALPHA, SLOW_BETA, algorithm)
    if algorithm == "ring":
        assert gather == pytest.approx(_ring_half_ms(n, ALPHA, SLOW_BETA, NBYTES), rel=1e-12)
    z1, bsp = simulate("zero:1", c, comm), simulate("bsp", c, comm)
    np.testing.assert_allclose(z1.comm_ms - bsp.comm_ms, gather, rtol=1e-9)
    assert z1.wall_ms - bsp.wall_ms == pytest.approx(c.shape[0] * gather, rel=1e-9)
    # zero:1's all-reduce overlaps backward as bsp's; its all-gather never does.
    ov = Overlap(buckets=4)
    z1o, bspo = simulate("zero:1", c, comm, overlap=ov), simulate("bsp", c, comm, overlap=ov)
    np.testing.assert_allclose(z1o.comm_ms - bspo.comm_ms, gather, rtol=1e-9)
    assert z1o.strategy == "zero:1+overlap"


def test_zero_with_fixed_comm_halves_it() -> None:
    # A fixed --comm-ms is one all-reduce; reduce-scatter and all-gather are half of it each.
    c = _compute(4)
    comm = CommModel(comm_ms=6.0)
    assert simulate("zero:1", c, comm).comm_ms == pytest.approx(np.full(c.shape[0], 9.0))
    assert simulate("zero:2", c, comm).comm_ms == pytest.approx(np.full(c.shape[0], 6.0))


@pytest.mark.parametrize("algorithm", ["ring", "rhd", "tree"])
@pytest.mark.parametrize("n", [4, 64, 1024])
def test_zero2_step_at_most_bsp_plus_one_all_gather_on_a_slow_link(algorithm: str, n: int) -> None:
    c = _compute(n, steps=10)
    comm = _link(algorithm, beta=8.0 / 1e8)  # 100 Mbit/s: communication dominates
    gather = 1000.0 * collective_time("allgather", n, NBYTES, ALPHA, 8.0 / 1e8, algorithm)
    z2, bsp = simulate("zero:2", c, comm), simulate("bsp", c, comm)
    assert z2.step_ms is not None and bsp.step_ms is not None
    assert np.all(z2.step_ms <= bsp.step_ms + gather + 1e-9)
    assert z2.wall_ms / z2.steps <= bsp.wall_ms / bsp.steps + gather + 1e-9
    if algorithm in ("ring", "rhd"):  # there an all-reduce is a reduce-scatter + all-gather
        np.testing.assert_allclose(z2.step_ms, bsp.step_ms, rtol=1e-12)


def _run_cli(argv: list[str], capsys: pytest.CaptureFixture[str]) -> str:
    parser = argparse.ArgumentParser(prog="gradsync")
    add_parsers(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(argv)
    assert args.func(args) == 0
    return capsys.readouterr().out


def _rows(text: str) -> dict[str, list[str]]:
    return {line.split()[0]: line.split() for line in text.splitlines() if line.strip()}


def test_simulate_prints_zero_rows_beside_bsp(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["simulate", "--workers", "8", "--compute", "20", "--steps", "5", "--message-mb", "100"]
    text = _run_cli([*argv, "--link-gbps", "1", "--strategy", "zero:2"], capsys)
    rows = _rows(text.split("beside bsp")[1])
    gather = _ring_half_ms(8, ALPHA, SLOW_BETA, NBYTES)
    assert rows["bsp"][1:3] == ["allreduce", f"{2 * gather:.3f}"]
    assert rows["zero:1"][1:4] == ["allreduce", f"{2 * gather:.3f}", f"{gather:.3f}"]
    assert rows["zero:2"][1:4] == ["reducescatter", f"{gather:.3f}", f"{gather:.3f}"]
    assert rows["zero:3"][1:4] == ["reducescatter", f"{gather:.3f}", f"{2 * gather:.3f}"]
    doc = json.loads(
        _run_cli([*argv, "--link-gbps", "1", "--strategy", "zero:1", "--json"], capsys)
    )
    assert doc["strategy"] == "zero:1"
    assert [r["strategy"] for r in doc["beside_bsp"]] == ["bsp", "zero:1", "zero:2", "zero:3"]
    assert doc["comm_ms_total"] == pytest.approx(5 * 3 * gather)


def test_sweep_shows_zero_beside_bsp(capsys: pytest.CaptureFixture[str], tmp_path: Any) -> None:
    argv = ["simulate", "--compute", "20", "--steps", "5", "--message-mb", "100"]
    text = _run_cli([*argv, "--sweep-workers", "4,16", "--plot-dir", str(tmp_path)], capsys)
    header = text.splitlines()[1].split()
    assert header[:4] == ["workers", "bsp", "zero:1", "zero:2"]  # the default --strategies
    bsp, z1, z2 = (float(x) for x in _rows(text)["16"][1:4])
    assert z1 < bsp == z2  # ring: zero:2 moves what bsp moves; zero:1 one all-gather more
    assert (tmp_path / "sim_scaling.png").is_file()


@pytest.mark.parametrize("n", [2, 4, 7])
def test_zero3_comm_is_a_reduce_scatter_and_two_all_gathers(n: int) -> None:
    c = _compute(n)
    res = simulate("zero:3", c, _link())
    expected = 3 * _ring_half_ms(n, ALPHA, SLOW_BETA, NBYTES)
    np.testing.assert_allclose(res.comm_ms, expected, rtol=1e-12)
    assert res.strategy == "zero:3"


@pytest.mark.parametrize(
    "make", [lambda: parse_sim_strategy("zero:4"), lambda: SimStrategy(kind="zero", param=4)]
)
def test_a_stage_beyond_3_is_refused_naming_what_is_modelled(make: Any) -> None:
    with pytest.raises(
        UsageError, match=r"zero:4.*the simulator models bsp, zero:1, zero:2, zero:3"
    ):
        make()


def test_zero_refusals_on_the_command_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(UsageError, match="the simulator models bsp, zero:1, zero:2, zero:3"):
        _run_cli(["simulate", "--strategy", "zero:4"], capsys)
    with pytest.raises(UsageError, match="reduce-scatter runs after the backward pass"):
        _run_cli(["simulate", "--strategy", "zero:2", "--overlap"], capsys)
    with pytest.raises(UsageError, match="does not predict zero:1"):
        WhatIf(strategy="zero:1")


def test_zero_specs_parse_through_the_shared_parser() -> None:
    from gradsync.spec import parse_strategy_spec

    for text in ("zero:1", " ZERO:2 "):
        spec = parse_strategy_spec(text)
        strategy = parse_sim_strategy(text)
        assert strategy.spec == str(spec) and strategy.param == spec.stage
